"""CloudEvents and the model's messages, both ways (docs/eventbus.md, "Mappings").

An event becomes a message as the CloudEvents Kafka binding's binary mode lays it out
(``bindings/kafka-protocol-binding.md`` 3.2): the data is the body, each attribute a
``ce_<name>`` property, ``datacontenttype`` the content type; the subject (else the
``partitionkey`` extension) is the key. So a Kafka consumer sees a binary-mode
CloudEvents record, and every other protocol the same message.

A message becomes an event: one carrying ``ce_`` properties (this bus, or a Kafka
producer of the Kafka binding), ``cloudEvents:``/``cloudEvents_`` properties (an AMQP
producer of the AMQP binding) or MQTT 5 user properties named as attributes (the MQTT
binding) is that event; a structured-mode body (content type
``application/cloudevents+json``) is parsed; any other message is mapped field by
field (:func:`message_to_event`).

Pure: no I/O.
"""

from __future__ import annotations

import datetime
import json
from typing import Final

from polymq.protocols.eventbus.cloudevent import (
    STRUCTURED_TYPE,
    Attribute,
    CloudEvent,
    EventError,
    check_attributes,
    is_json_type,
    parse_structured,
)
from polymq.storage.model import Message, StoredMessage

__all__ = ["event_to_message", "message_to_event", "native_source", "rfc3339"]

PREFIX: Final = "ce_"
# The binding prefixes a message's properties may carry attributes under.
_BINDING_PREFIXES: Final = ("ce_", "cloudEvents:", "cloudEvents_", "")
NATIVE_TYPE: Final = "com.polymq.message"
# Properties that are another field's carrier or a protocol's bookkeeping: never
# extensions of a mapped event (docs/interop.md, "Reserved names").
_NOT_EXTENSIONS: Final = ("polymq.", "amqp.", "mqtt.", "mns.", "kafka.")


def event_to_message(event: CloudEvent) -> Message:
    properties = tuple(
        (f"{PREFIX}{name}", _text(value))
        for name, value in event.attributes.items()
        if name != "datacontenttype"
    )
    key = event.attributes.get("subject", event.attributes.get("partitionkey"))
    return Message(
        body=event.data or b"",
        key=None if key is None else str(key).encode(),
        properties=properties,
        content_type=event.content_type,
    )


def _text(value: Attribute) -> bytes:
    if isinstance(value, bool):
        return b"true" if value else b"false"
    return str(value).encode()


def rfc3339(ms: int) -> str:
    stamp = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def native_source(namespace: str, topic: str) -> str:
    """The ``source`` of an event mapped from a message of storage topic ``topic``."""
    return f"polymq://{namespace}/topics/{topic}"


def message_to_event(stored: StoredMessage) -> CloudEvent:
    """The event a stored message is. Raises :class:`EventError` only for a message
    that claims to be a CloudEvent (a binding's attributes, a structured body) and is
    not a valid one; any other message maps."""
    message = stored.message
    if message.content_type is not None and message.content_type.startswith(STRUCTURED_TYPE):
        return parse_structured(message.body)
    for prefix in _BINDING_PREFIXES:
        if message.property(f"{prefix}specversion") is not None:
            return _bound_event(message, prefix)
    return _mapped_event(stored)


def _bound_event(message: Message, prefix: str) -> CloudEvent:
    raw: dict[str, Attribute] = {}
    for name, value in message.properties:
        if not name.startswith(prefix):
            continue
        attribute = name[len(prefix) :]
        if prefix == "" and (not attribute.isalnum() or attribute != attribute.lower()):
            continue  # MQTT binding: only user properties named as attributes
        raw[attribute] = value.decode("utf-8", "replace")
    if message.content_type is not None:
        raw["datacontenttype"] = message.content_type
    attributes = check_attributes(raw)
    return _event(attributes, message.body)


def _mapped_event(stored: StoredMessage) -> CloudEvent:
    message, queue = stored.message, stored.queue
    attributes: dict[str, Attribute] = {
        "specversion": "1.0",
        "id": stored.message_id,
        "source": native_source(queue.namespace, queue.topic),
        "type": NATIVE_TYPE,
        "time": rfc3339(message.born_timestamp_ms or stored.store_timestamp_ms),
    }
    if message.key:
        attributes["subject"] = message.key.decode("utf-8", "replace")
    if message.content_type:
        attributes["datacontenttype"] = message.content_type
    if message.tag:
        attributes["tag"] = message.tag
    if message.message_group:
        attributes["messagegroup"] = message.message_group
    for name, value in message.properties:
        lower = name.lower()
        if name.startswith(_NOT_EXTENSIONS) or not lower.isalnum() or len(lower) > 20:
            continue
        if not lower.isascii() or lower in attributes:
            continue
        attributes[lower] = value.decode("utf-8", "replace")
    return _event(attributes, message.body)


def _event(attributes: dict[str, Attribute], body: bytes) -> CloudEvent:
    content_type = attributes.get("datacontenttype")
    if body and (is_json_type(str(content_type)) if content_type else _looks_json(body)):
        try:
            return CloudEvent(
                attributes=attributes, data=body, data_json=json.loads(body), has_json=True
            )
        except (ValueError, UnicodeDecodeError):
            if content_type:
                raise EventError(f"data is not valid JSON as {content_type} says") from None
    return CloudEvent(attributes=attributes, data=body if body else None)


def _looks_json(body: bytes) -> bool:
    """A body without a content type is looked into when it is a JSON object or
    array, so patterns can match other protocols' JSON payloads."""
    return body[:1] in (b"{", b"[")
