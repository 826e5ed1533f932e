"""MQTT PUBLISH packets to the abstract :class:`Message` and back (docs/interop.md):
the storage topic is the topic name's first level, the full name
travels as the ``mqtt.topic`` property, v5 properties land in the model's own fields
where it has them and in ``properties`` (in order) where not.
"""

from __future__ import annotations

import math

from polymq.protocols import interop
from polymq.protocols.mqtt import codec
from polymq.storage.model import Message

__all__ = [
    "MQTT_PAYLOAD_FORMAT",
    "MQTT_QOS",
    "MQTT_RETAIN",
    "message_from_publish",
    "mqtt_topic_of",
    "publish_from_message",
    "published_qos",
    "storage_topic",
]

# Fields only MQTT has: kept so an MQTT subscriber gets them back, set only when not
# the default so other protocols' consumers rarely see them.
MQTT_QOS = interop.MQTT_QOS
MQTT_RETAIN = interop.MQTT_RETAIN
MQTT_PAYLOAD_FORMAT = interop.MQTT_PAYLOAD_FORMAT

# A topic name starting with "/" has an empty first level; storage names cannot be
# empty, so those topics share this storage topic.
EMPTY_LEVEL_TOPIC = "/"


def storage_topic(mqtt_topic: str) -> str:
    """The storage topic an MQTT topic name is kept in: its first level."""
    first = mqtt_topic.split("/", 1)[0]
    return first or EMPTY_LEVEL_TOPIC


def mqtt_topic_of(message: Message, stored_topic: str) -> str:
    """The MQTT topic name a stored message is served under: the one it was published
    with, or for a message from another protocol its storage topic's name."""
    raw = message.property(interop.MQTT_TOPIC)
    if raw is not None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return stored_topic


def published_qos(message: Message) -> int:
    """The QoS a message was published with; messages from other protocols count as
    QoS 1 (they were acknowledged to their producer)."""
    raw = message.property(MQTT_QOS)
    if raw is None:
        return 1
    return 2 if raw == b"2" else 0 if raw == b"0" else 1


def message_from_publish(
    packet: codec.Publish, *, client_id: str, now_ms: int, topic: str | None = None
) -> Message:
    """The model message for an inbound PUBLISH (``topic`` after alias resolution)."""
    name = topic if topic is not None else packet.topic
    props = packet.properties
    properties: list[tuple[str, bytes]] = [(interop.MQTT_TOPIC, name.encode())]
    if packet.qos != 1:
        properties.append((MQTT_QOS, str(packet.qos).encode()))
    if packet.retain:
        properties.append((MQTT_RETAIN, b"1"))
    if props.get(codec.PAYLOAD_FORMAT):
        properties.append((MQTT_PAYLOAD_FORMAT, b"1"))
    key: bytes | None = name.encode()
    tag = group = None
    for user_name, user_value in props.get(codec.USER_PROPERTY, ()):
        # Fields other protocols expose as user properties map back onto the field.
        if user_name == interop.KEY:
            key = user_value.encode()
        elif user_name == interop.TAG:
            tag = user_value
        elif user_name == interop.MESSAGE_GROUP:
            group = user_value
        else:
            properties.append((user_name, user_value.encode()))
    expiry = props.get(codec.MESSAGE_EXPIRY)
    return Message(
        body=packet.payload,
        key=key,
        tag=tag,
        message_group=group,
        properties=tuple(properties),
        expiry_ms=now_ms + expiry * 1000 if expiry is not None else None,
        content_type=props.get(codec.CONTENT_TYPE),
        correlation_id=props.get(codec.CORRELATION_DATA),
        reply_to=props.get(codec.RESPONSE_TOPIC),
        producer=client_id,
        born_timestamp_ms=now_ms,
    )


def publish_from_message(
    message: Message, *, topic: str, qos: int, retain: bool, now_ms: int, v5: bool
) -> codec.Publish:
    """The PUBLISH a subscriber gets (packet id, DUP and subscription ids are the
    session's to set). Returns the remaining expiry, rounded up (v5 3.3.2.3.3)."""
    packet = codec.Publish(topic=topic, payload=message.body, qos=qos, retain=retain)
    if not v5:
        return packet
    props = packet.properties
    if message.property(MQTT_PAYLOAD_FORMAT) == b"1":
        props[codec.PAYLOAD_FORMAT] = 1
    if message.expiry_ms is not None:
        props[codec.MESSAGE_EXPIRY] = max(1, math.ceil((message.expiry_ms - now_ms) / 1000))
    if message.content_type is not None:
        props[codec.CONTENT_TYPE] = message.content_type
    if message.reply_to is not None:
        props[codec.RESPONSE_TOPIC] = message.reply_to
    if message.correlation_id is not None:
        props[codec.CORRELATION_DATA] = message.correlation_id
    user: list[tuple[str, str]] = []
    if message.key is not None and message.key != topic.encode():
        user.append((interop.KEY, message.key.decode("utf-8", "replace")))
    if message.tag is not None:
        user.append((interop.TAG, message.tag))
    if message.message_group is not None:
        user.append((interop.MESSAGE_GROUP, message.message_group))
    for name, value in message.properties:
        if not interop.is_private(name):
            user.append((name, value.decode("utf-8", "replace")))
    if user:
        props[codec.USER_PROPERTY] = user
    return packet
