"""MNS messages onto the abstract model and back (the mapping in docs/interop.md).

MessageBody text is stored as its UTF-8 bytes (the SDK base64-encodes by default; it is
still text to us). MessageGroupId is the message group, MessageTag the tag; user
properties are message properties, except the interop names of
:mod:`protocols.interop` which go to their model fields and come back under the same
names. Priority has no model field: it travels as the ``mns.priority`` property.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polymq.protocols import interop
from polymq.protocols.mns import codec
from polymq.protocols.mns.attributes import parse_int
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.priority import DEFAULT_PRIORITY, PRIORITY, priority_of
from polymq.storage.model import Message, StoredMessage

__all__ = [
    "DEFAULT_PRIORITY",
    "Outgoing",
    "body_md5",
    "body_text",
    "notification_body",
    "parse_message",
    "render_message",
    "render_notification",
]

PROPERTY_TYPES = "mns.property-types"  # "name=TYPE;..." for non-STRING user properties
_INTERNAL = frozenset({PRIORITY, PROPERTY_TYPES})
_TYPES = ("STRING", "NUMBER", "BOOLEAN", "BINARY")
# Characters XML 1.0 cannot carry (https://www.w3.org/TR/xml/#charsets).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A message to store, and the SQS-style deduplication id it came with."""

    message: Message
    dedup_id: str | None


def body_md5(body: bytes) -> str:
    return hashlib.md5(body, usedforsecurity=False).hexdigest().upper()


def body_text(body: bytes) -> str:
    """A stored body as MNS text. Bodies from other protocols may be any bytes: what
    is not UTF-8, or not allowed in XML, becomes U+FFFD rather than a broken document."""
    text = body.decode("utf-8", errors="replace")
    return _NOT_XML.sub("\ufffd", text)


def _properties(items: Any) -> tuple[list[tuple[str, bytes]], list[str]]:
    if items in (None, "", {}):
        return [], []
    if isinstance(items, Mapping):  # JSON may give {"PropertyValue": [...]}
        items = items.get("PropertyValue", [])
    if not isinstance(items, list):
        raise MnsError.invalid_argument("UserProperties must be a list of PropertyValue.")
    props: list[tuple[str, bytes]] = []
    typed: list[str] = []
    for item in items:
        if not isinstance(item, Mapping) or not str(item.get("Name", "")).strip():
            raise MnsError.invalid_argument("each PropertyValue needs a Name.")
        name = str(item["Name"]).strip()
        kind = str(item.get("Type", "STRING")).strip().upper() or "STRING"
        if kind not in _TYPES:
            raise MnsError.invalid_argument(f"property {name!r} has an unknown Type {kind!r}.")
        raw = item.get("Value", "")
        text = str(raw).lower() if isinstance(raw, bool) else str(raw)
        if kind == "BINARY":
            try:
                value = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise MnsError.invalid_argument(f"property {name!r} is not base64.") from None
        else:
            value = text.encode()
        props.append((name, value))
        if kind != "STRING":
            typed.append(f"{name}={kind}")
    return props, typed


def parse_message(
    document: Any,
    *,
    now_ms: int,
    default_delay_s: int,
    max_body_bytes: int,
    retention_s: int | None,
    allow_delay: bool = True,
) -> Outgoing:
    """A ``<Message>`` document (SendMessage, a BatchSendMessage entry, PublishMessage)
    as a model message. Delay and expiry are absolute times from ``now_ms``."""
    if not isinstance(document, Mapping):
        raise MnsError.invalid_argument("expected a <Message> document")
    if "MessageBody" not in document:
        raise MnsError.invalid_argument("MessageBody is required.")
    text = document["MessageBody"]
    if not isinstance(text, str):
        raise MnsError.invalid_argument("MessageBody must be text.")
    body = text.encode("utf-8")
    if len(body) > max_body_bytes:
        raise MnsError.body_too_long(max_body_bytes)
    delay = default_delay_s
    if allow_delay and "DelaySeconds" in document:
        delay = parse_int("DelaySeconds", document["DelaySeconds"], 0, 604800)
    props, typed = _properties(document.get("UserProperties"))
    fields: dict[str, Any] = {}
    user: list[tuple[str, bytes]] = []
    for name, value in props:
        if name == interop.KEY:
            fields["key"] = value
        elif name == interop.CONTENT_TYPE:
            fields["content_type"] = value.decode(errors="replace")
        elif name == interop.CORRELATION_ID:
            fields["correlation_id"] = value
        elif name == interop.REPLY_TO:
            fields["reply_to"] = value.decode(errors="replace")
        elif name in _INTERNAL:
            continue
        else:
            user.append((name, value))
    if "Priority" in document:
        priority = parse_int("Priority", document["Priority"], 1, 16)
        if priority != DEFAULT_PRIORITY:
            user.append((PRIORITY, str(priority).encode()))
    if typed:
        user.append((PROPERTY_TYPES, ";".join(typed).encode()))
    group = str(document.get("MessageGroupId", "") or "").strip() or None
    tag = str(document.get("MessageTag", "") or "").strip() or None
    dedup = str(document.get("MessageDeduplicationId", "") or "").strip() or None
    message = Message(
        body=body,
        tag=tag,
        properties=tuple(user),
        message_group=group,
        delivery_time_ms=now_ms + delay * 1000 if delay > 0 else None,
        expiry_ms=now_ms + retention_s * 1000 if retention_s is not None else None,
        born_timestamp_ms=now_ms,
        **fields,
    )
    return Outgoing(message=message, dedup_id=dedup)


def _user_properties(message: Message) -> list[dict[str, str]]:
    types: dict[str, str] = {}
    typed = message.property(PROPERTY_TYPES)
    if typed:
        for pair in typed.decode(errors="replace").split(";"):
            name, _, kind = pair.rpartition("=")
            types[name] = kind
    out: list[dict[str, str]] = []

    def add(name: str, value: bytes, kind: str | None = None) -> None:
        kind = kind or types.get(name, "STRING")
        if kind == "STRING":
            try:
                text = value.decode()
            except UnicodeDecodeError:
                kind = "BINARY"
            else:
                if _NOT_XML.search(text):
                    kind = "BINARY"
        if kind == "BINARY":
            out.append({"Name": name, "Value": base64.b64encode(value).decode(), "Type": kind})
        else:
            out.append({"Name": name, "Value": value.decode(errors="replace"), "Type": kind})

    for name, value in message.properties:
        if not interop.is_private(name):  # MNS's own and other protocols' bookkeeping
            add(name, value)
    if message.key is not None:
        add(interop.KEY, message.key)
    if message.content_type is not None:
        add(interop.CONTENT_TYPE, message.content_type.encode())
    if message.correlation_id is not None:
        add(interop.CORRELATION_ID, message.correlation_id)
    if message.reply_to is not None:
        add(interop.REPLY_TO, message.reply_to.encode())
    return out


def render_message(stored: StoredMessage, *, receipt: bool) -> dict[str, Any]:
    """The ``<Message>`` fields of ReceiveMessage (``receipt``) or PeekMessage."""
    message = stored.message
    fields: dict[str, Any] = {
        "MessageId": stored.message_id,
        "ReceiptHandle": stored.receipt if receipt else None,
        "MessageBodyMD5": body_md5(message.body),
        "MessageBody": body_text(message.body),
        "EnqueueTime": stored.store_timestamp_ms,
        "FirstDequeueTime": stored.first_pop_ms or 0,
        "NextVisibleTime": (stored.next_visible_ms or 0) if receipt else None,
        "DequeueCount": stored.delivery_attempt,
        "Priority": priority_of(message),
        "MessageGroupId": message.message_group,
        "MessageTag": message.tag,
    }
    properties = _user_properties(message)
    if properties:
        fields["UserProperties"] = properties
    return fields


def notification_body(
    stored: StoredMessage,
    content_format: str,
    *,
    topic_owner: str,
    topic: str,
    subscription: str,
) -> tuple[bytes, str]:
    """What a subscriber gets in ``content_format``, and its content type: the
    ``<Notification>`` document (XML), its JSON form, or the body alone (SIMPLIFIED)."""
    if content_format == "SIMPLIFIED":
        return stored.message.body, "text/plain;charset=UTF-8"
    fields = render_notification(
        stored, topic_owner=topic_owner, topic=topic, subscription=subscription
    )
    if content_format == "JSON":
        return codec.encode("Notification", fields, as_json=True), "application/json;charset=UTF-8"
    return codec.encode("Notification", fields, as_json=False), "text/xml;charset=UTF-8"


def render_notification(
    stored: StoredMessage, *, topic_owner: str, topic: str, subscription: str
) -> dict[str, Any]:
    """The ``<Notification>`` fields an HTTP endpoint receives (MNS "HTTP endpoint")."""
    message = stored.message
    return {
        "TopicOwner": topic_owner,
        "TopicName": topic,
        "Subscriber": topic_owner,
        "SubscriptionName": subscription,
        "MessageId": stored.message_id,
        "MessageMD5": body_md5(message.body),
        "MessageTag": message.tag,
        "Message": body_text(message.body),
        "PublishTime": stored.store_timestamp_ms,
    }
