"""RocketMQ 5 protobuf messages <-> the abstract model (pure: no I/O).

Field mapping (docs/rocketmq.md has the table): keys -> ``Message.key`` (several
space-joined, as RocketMQ 4 joins them), tag -> ``tag``, message group ->
``message_group``, delivery timestamp -> ``delivery_time_ms``, born host/time ->
``born_host`` / ``born_timestamp_ms``; user properties named as in
:mod:`protocols.interop` (``content-type``, ``correlation-id``, ``reply-to``) map onto
their model fields and back, every other user property travels as it is.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2

from polymq.protocols import interop
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.model import Message, MessageType, StoredMessage

__all__ = [
    "MAX_MESSAGE_GROUP_LENGTH",
    "PB_MESSAGE_TYPES",
    "accepted_types",
    "from_proto",
    "message_type_of",
    "to_proto",
]

# Apache RocketMQ proxy limits (ProxyConfig: maxMessageGroupSize, maxUserPropertySize).
MAX_MESSAGE_GROUP_LENGTH = 64
MAX_USER_PROPERTIES = 128
# Apache's broker keeps a message's properties (tag, keys, group, user properties) in
# a string whose length is a 16-bit field: longer ones are refused.
MAX_PROPERTIES_BYTES = 32767
# The latest time a protobuf Timestamp may hold (9999-12-31T23:59:59Z).
MAX_TIMESTAMP_MS = 253_402_300_799_999

PB_MESSAGE_TYPES: dict[MessageType, int] = {
    MessageType.NORMAL: definition_pb2.NORMAL,
    MessageType.FIFO: definition_pb2.FIFO,
    MessageType.DELAY: definition_pb2.DELAY,
    MessageType.TRANSACTION: definition_pb2.TRANSACTION,
}
_MODEL_TYPES = {v: k for k, v in PB_MESSAGE_TYPES.items()}

_FIELD_PROPERTIES = (interop.CONTENT_TYPE, interop.CORRELATION_ID, interop.REPLY_TO)


def accepted_types(message_type: MessageType | None) -> list[int]:
    """What a route advertises: the topic's type, or every type for a topic that does
    not exist yet and will be created (with the first message's type) on first send."""
    if message_type is None:
        return list(PB_MESSAGE_TYPES.values())
    return [PB_MESSAGE_TYPES[message_type]]


def message_type_of(pb: Any) -> MessageType:
    """The type a sent message declares; undeclared ones are typed by their fields."""
    declared = _MODEL_TYPES.get(pb.system_properties.message_type)
    if declared is not None:
        return declared
    if pb.system_properties.message_type not in (0, definition_pb2.NORMAL):
        raise RpcFailure(Code.UNSUPPORTED, "message type is not supported")
    props = pb.system_properties
    if props.HasField("message_group"):
        return MessageType.FIFO
    if props.HasField("delivery_timestamp"):
        return MessageType.DELAY
    return MessageType.NORMAL


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _check_text(value: str, what: str, code: int) -> None:
    if not value.strip() or _CONTROL.search(value) is not None:
        raise RpcFailure(code, f"{what} {value!r} is blank or holds control characters")


def _gunzip(body: bytes, max_body_bytes: int) -> bytes:
    """The body inflated, but never past ``max_body_bytes``: a few MiB of gzip can
    claim gigabytes, so the limit applies to what it inflates to, while inflating."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        plain = inflater.decompress(body, max_body_bytes + 1)
    except zlib.error as e:
        raise RpcFailure(Code.MESSAGE_CORRUPTED, f"gzip body does not decode: {e}") from e
    if len(plain) > max_body_bytes:
        raise RpcFailure(
            Code.MESSAGE_BODY_TOO_LARGE,
            f"gzip body inflates past the limit of {max_body_bytes} bytes",
        )
    if not inflater.eof:
        raise RpcFailure(Code.MESSAGE_CORRUPTED, "gzip body is truncated")
    return plain


def _check_properties_size(pb: Any) -> None:
    """Tag, keys, message group, born host and user properties together stay within
    Apache's broker limit, checked before any of them is looked at one by one."""
    if len(pb.user_properties) > MAX_USER_PROPERTIES:
        raise RpcFailure(Code.MESSAGE_PROPERTIES_TOO_LARGE, "too many user properties")
    props = pb.system_properties
    size = (
        len(props.tag)
        + len(props.born_host)
        + len(props.message_group)
        + sum(map(len, props.keys))
        + sum(len(name) + len(value) for name, value in pb.user_properties.items())
    )
    if size > MAX_PROPERTIES_BYTES:
        raise RpcFailure(
            Code.MESSAGE_PROPERTIES_TOO_LARGE,
            f"tag, keys, group, born host and properties take {size} characters, "
            f"over the limit of {MAX_PROPERTIES_BYTES}",
        )


def from_proto(
    pb: Any, *, max_body_bytes: int, now_ms: int, max_delay_ms: int | None = None
) -> Message:
    """A sent ``apache.rocketmq.v2.Message`` as a model message, checked as Apache's
    proxy checks it (each failure with the client's status code)."""
    props = pb.system_properties
    body: bytes = pb.body
    if not body:
        raise RpcFailure(Code.MESSAGE_BODY_EMPTY, "message body is empty")
    if len(body) > max_body_bytes:
        raise RpcFailure(
            Code.MESSAGE_BODY_TOO_LARGE,
            f"message body of {len(body)} bytes exceeds the limit of {max_body_bytes}",
        )
    if props.body_encoding == definition_pb2.GZIP:
        body = _gunzip(body, max_body_bytes)
    _check_properties_size(pb)
    tag = props.tag if props.HasField("tag") else None
    if tag is not None:
        _check_text(tag, "tag", Code.ILLEGAL_MESSAGE_TAG)
        if "|" in tag:
            raise RpcFailure(Code.ILLEGAL_MESSAGE_TAG, "tag must not contain '|'")
    keys = list(props.keys)
    for key in keys:
        _check_text(key, "key", Code.ILLEGAL_MESSAGE_KEY)
    group = props.message_group if props.HasField("message_group") else None
    if group is not None:
        _check_text(group, "message group", Code.ILLEGAL_MESSAGE_GROUP)
        if len(group) > MAX_MESSAGE_GROUP_LENGTH:
            raise RpcFailure(
                Code.ILLEGAL_MESSAGE_GROUP,
                f"message group is longer than {MAX_MESSAGE_GROUP_LENGTH} characters",
            )
    delivery_ms = None
    if props.HasField("delivery_timestamp"):
        ts = props.delivery_timestamp
        delivery_ms = ts.seconds * 1000 + ts.nanos // 1_000_000
        if delivery_ms <= 0:
            raise RpcFailure(Code.ILLEGAL_DELIVERY_TIME, "delivery timestamp is not positive")
        if delivery_ms > MAX_TIMESTAMP_MS:
            raise RpcFailure(Code.ILLEGAL_DELIVERY_TIME, "delivery timestamp is past year 9999")
        if max_delay_ms is not None and delivery_ms - now_ms > max_delay_ms:
            raise RpcFailure(
                Code.ILLEGAL_DELIVERY_TIME,
                f"delivery timestamp is more than {max_delay_ms // 1000} s ahead",
            )
    fields: dict[str, str] = {}
    properties: list[tuple[str, bytes]] = []
    for name, value in sorted(pb.user_properties.items()):
        if not name:
            raise RpcFailure(Code.ILLEGAL_MESSAGE_PROPERTY_KEY, "empty user property name")
        if name in _FIELD_PROPERTIES:
            fields[name] = value
        else:
            properties.append((name, value.encode()))
    born_ms = None
    if props.HasField("born_timestamp"):
        born = props.born_timestamp
        born_ms = born.seconds * 1000 + born.nanos // 1_000_000 or None
        if born_ms is not None and not 0 < born_ms <= MAX_TIMESTAMP_MS:
            raise RpcFailure(Code.BAD_REQUEST, f"born timestamp {born_ms} ms is out of range")
    correlation = fields.get(interop.CORRELATION_ID)
    return Message(
        body=body,
        key=" ".join(keys).encode() if keys else None,
        tag=tag,
        properties=tuple(properties),
        message_group=group,
        delivery_time_ms=delivery_ms if delivery_ms and delivery_ms > now_ms else None,
        content_type=fields.get(interop.CONTENT_TYPE),
        correlation_id=correlation.encode() if correlation is not None else None,
        reply_to=fields.get(interop.REPLY_TO),
        born_timestamp_ms=born_ms,
        born_host=props.born_host or None,
    )


def _set_time(field: Any, ms: int) -> None:
    field.seconds = ms // 1000
    field.nanos = (ms % 1000) * 1_000_000


def to_proto(
    stored: StoredMessage,
    *,
    namespace: str,
    message_type: MessageType,
    store_host: str,
    invisible_ms: int | None = None,
) -> Any:
    """A stored message as the ``Message`` a RocketMQ consumer decodes, with a body
    digest (the clients verify it) and the receipt handle of this hand-out.

    The digest is MD5, upper-case hex: every official client computes that the same
    way, while their CRC32 strings differ (Python: 8 hex digits, node: decimal, Java:
    unpadded hex), so a CRC32 digest would mark messages corrupted for some of them."""
    msg = stored.message
    pb = definition_pb2.Message()
    pb.topic.name = stored.queue.topic
    pb.topic.resource_namespace = namespace
    user = pb.user_properties
    for name, value in msg.properties:
        if name not in user and not interop.is_private(name):
            user[name] = value.decode(errors="replace")
    if msg.content_type is not None:
        user[interop.CONTENT_TYPE] = msg.content_type
    if msg.correlation_id is not None:
        user[interop.CORRELATION_ID] = msg.correlation_id.decode(errors="replace")
    if msg.reply_to is not None:
        user[interop.REPLY_TO] = msg.reply_to
    props = pb.system_properties
    if msg.tag is not None:
        props.tag = msg.tag
    if msg.key is not None:
        props.keys.extend(k for k in msg.key.decode(errors="replace").split(" ") if k)
    props.message_id = stored.message_id
    props.body_digest.type = definition_pb2.MD5
    props.body_digest.checksum = hashlib.md5(msg.body, usedforsecurity=False).hexdigest().upper()
    props.body_encoding = definition_pb2.IDENTITY
    props.message_type = PB_MESSAGE_TYPES[message_type]
    _set_time(props.born_timestamp, msg.born_timestamp_ms or stored.store_timestamp_ms)
    props.born_host = msg.born_host or msg.producer or ""
    _set_time(props.store_timestamp, stored.store_timestamp_ms)
    props.store_host = store_host
    if msg.delivery_time_ms is not None:
        _set_time(props.delivery_timestamp, msg.delivery_time_ms)
    if stored.receipt is not None:
        props.receipt_handle = stored.receipt
    props.queue_id = stored.queue.queue_id
    props.queue_offset = stored.offset
    if invisible_ms is not None:
        props.invisible_duration.seconds = invisible_ms // 1000
        props.invisible_duration.nanos = (invisible_ms % 1000) * 1_000_000
    if stored.delivery_attempt:
        props.delivery_attempt = stored.delivery_attempt
    if msg.message_group is not None:
        props.message_group = msg.message_group
    pb.body = msg.body
    return pb
