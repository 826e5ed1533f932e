"""What both MNS targets do: decode a request body (XML or JSON) as the request
reader does, then hand the document to each parser a call could give it: the message
documents of a (batch) send, queue, topic and subscription attributes, the receipt
handles of a batch delete.

Documented errors: :class:`MalformedDocument` (MNS ``MalformedXML``, 400) and
:class:`MnsError` (an MNS error document with its status).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from polymq.protocols.mns import codec
from polymq.protocols.mns.attributes import QueueAttributes, SubscriptionAttributes, TopicAttributes
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import parse_message
from polymq.protocols.mns.queue_handlers import _receipt_handles
from polymq.protocols.mns.request import message_documents

_NOW_MS = 1_700_000_000_000


def _messages(root: str | None, document: Any) -> None:
    documents, _ = message_documents(root, document)
    for item in documents:
        with contextlib.suppress(MnsError):
            parse_message(
                item, now_ms=_NOW_MS, default_delay_s=0, max_body_bytes=65536, retention_s=None
            )


_PARSERS: tuple[Callable[[str | None, Any], object], ...] = (
    _messages,
    lambda root, doc: QueueAttributes().updated(doc, creating=True),
    lambda root, doc: TopicAttributes().updated(doc),
    lambda root, doc: SubscriptionAttributes.parse(doc, now_ms=_NOW_MS),
    _receipt_handles,
)


def run(data: bytes, *, json_body: bool) -> None:
    try:
        root, document = codec.decode(data, json_body=json_body)
    except codec.MalformedDocument:
        return
    for parser in _PARSERS:
        with contextlib.suppress(MnsError):
            parser(root, document)
