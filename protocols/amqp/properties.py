"""AMQP content (basic properties, routing) to the abstract :class:`Message` and back.

The properties arrive as a content header; their raw bytes are stored whole under
:data:`RAW_PROPERTIES`, so an AMQP consumer gets back exactly what the publisher sent,
every field-table type included, without re-encoding. The fields other protocols
understand are also mapped onto the model (content type, correlation id, reply-to,
string headers as properties, the headers ``polymq.key`` / ``polymq.tag`` /
``polymq.message-group`` as those fields) following :mod:`protocols.interop`.
"""

from __future__ import annotations

import datetime
from typing import Any, Final

from pamqp import commands

from polymq.protocols import interop
from polymq.protocols.amqp import fields
from polymq.storage.model import Message, StoredMessage

__all__ = [
    "RAW_PROPERTIES",
    "decode_properties",
    "delivery_content",
    "encode_properties",
    "foreign_headers",
    "to_message",
    "with_header",
]

RAW_PROPERTIES: Final = interop.AMQP_PROPERTIES
_STORED_DEPTH: Final = 4096
_FIELD_HEADERS: Final = frozenset({interop.KEY, interop.TAG, interop.MESSAGE_GROUP})


def decode_properties(raw: bytes) -> commands.Basic.Properties:
    """Stored properties, decoded again (dead-lettering, stream offsets). They were
    checked against ``limits.max_nesting_depth`` when published; the bound here is
    only generous, in case that limit was lowered since (the decoder does not recurse)."""
    return fields.decode_properties(raw, 0, _STORED_DEPTH)


def with_header(raw: bytes, name: str, value: Any) -> bytes:
    """``raw`` properties with one header set (x-stream-offset on stream deliveries)."""
    properties = decode_properties(raw)
    properties.headers = {**(properties.headers or {}), name: value}
    return encode_properties(properties)


def encode_properties(properties: commands.Basic.Properties) -> bytes:
    return bytes(properties.marshal())


def _header_bytes(value: Any) -> bytes | None:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, bool | int | float):
        return str(value).encode()
    return None  # tables, arrays, timestamps: only in the raw properties


def to_message(
    *,
    exchange: str,
    routing_key: str,
    properties: commands.Basic.Properties,
    raw_properties: bytes,
    body: bytes,
) -> Message:
    pairs: list[tuple[str, bytes]] = [
        (interop.AMQP_EXCHANGE, exchange.encode()),
        (interop.AMQP_ROUTING_KEY, routing_key.encode()),
        (RAW_PROPERTIES, raw_properties),
    ]
    # Headers other protocols' fields are delivered under map back onto the fields.
    fields: dict[str, bytes] = {}
    for name, value in (properties.headers or {}).items():
        encoded = _header_bytes(value)
        if encoded is None:
            continue
        if name in _FIELD_HEADERS:
            fields[name] = encoded
        elif not interop.is_private(name):
            pairs.append((name, encoded))
    key = fields.get(interop.KEY, routing_key.encode() if routing_key else None)
    tag = fields.get(interop.TAG)
    group = fields.get(interop.MESSAGE_GROUP)
    timestamp = properties.timestamp
    born_ms = (
        int(timestamp.timestamp() * 1000) if isinstance(timestamp, datetime.datetime) else None
    )
    return Message(
        body=body,
        key=key,
        tag=tag.decode(errors="replace") if tag is not None else None,
        message_group=group.decode(errors="replace") if group is not None else None,
        properties=tuple(pairs),
        content_type=properties.content_type or None,
        correlation_id=properties.correlation_id.encode() if properties.correlation_id else None,
        reply_to=properties.reply_to or None,
        born_timestamp_ms=born_ms,
    )


def delivery_content(stored: StoredMessage) -> tuple[str, str, bytes]:
    """(exchange, routing key, raw properties) to deliver ``stored`` with."""
    message = stored.message
    exchange = message.property(interop.AMQP_EXCHANGE)
    routing_key = message.property(interop.AMQP_ROUTING_KEY)
    raw = message.property(RAW_PROPERTIES)
    if raw is None:
        raw = encode_properties(_foreign_properties(message))
    return (
        exchange.decode(errors="replace") if exchange is not None else "",
        routing_key.decode(errors="replace") if routing_key is not None else stored.queue.topic,
        raw,
    )


def foreign_headers(message: Message) -> dict[str, Any]:
    """The headers an AMQP consumer gets with a message another protocol produced
    (what a headers exchange matches it on)."""
    headers: dict[str, Any] = {}
    for name, value in message.properties:
        if interop.is_private(name):
            continue
        try:
            headers[name] = value.decode()
        except UnicodeDecodeError:
            headers[name] = bytearray(value)
    for name, field in (
        (interop.KEY, message.key),
        (interop.TAG, message.tag.encode() if message.tag else None),
        (interop.MESSAGE_GROUP, message.message_group.encode() if message.message_group else None),
    ):
        if field is not None:
            headers[name] = field.decode(errors="replace")
    return headers


def _foreign_properties(message: Message) -> commands.Basic.Properties:
    """Properties for a message produced through another protocol."""
    headers = foreign_headers(message)
    timestamp = (
        datetime.datetime.fromtimestamp(message.born_timestamp_ms / 1000, datetime.UTC)
        if message.born_timestamp_ms
        else None
    )
    return commands.Basic.Properties(
        content_type=message.content_type,
        headers=headers or None,
        correlation_id=(
            message.correlation_id.decode(errors="replace") if message.correlation_id else None
        ),
        reply_to=message.reply_to,
        timestamp=timestamp,
    )
