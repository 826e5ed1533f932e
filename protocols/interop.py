"""The names under which a message's fields travel through protocols with no slot
for them: the one table every adapter reads, so a message produced through one
protocol arrives in every other with the same names.

The rule: an adapter maps its protocol's own constructs onto :class:`Message` fields
first (Kafka record key -> ``key``, RocketMQ tag -> ``tag``, AMQP ``content-type`` ->
``content_type``, MQTT v5 correlation data -> ``correlation_id``...). When it serves
a message whose field has no native slot in its protocol, it exposes the field as a
header / user property under the name below, and when such a header arrives from its
own clients it maps it back onto the field (so the name round-trips). Everything else
in ``Message.properties`` is the user's own headers / user properties, in order.
"""

from __future__ import annotations

__all__ = [
    "AMQP_EXCHANGE",
    "AMQP_EXPIRES_AT",
    "AMQP_PROPERTIES",
    "AMQP_ROUTING_KEY",
    "AMQP_TOPIC_ARGUMENT",
    "CONTENT_TYPE",
    "CORRELATION_ID",
    "KEY",
    "MESSAGE_GROUP",
    "MQTT_PAYLOAD_FORMAT",
    "MQTT_QOS",
    "MQTT_RETAIN",
    "MQTT_TOPIC",
    "PRIVATE_PREFIXES",
    "REPLY_TO",
    "RESERVED",
    "TAG",
    "is_private",
]

# Message fields, for protocols without a slot for them.
KEY = "polymq.key"  # AMQP headers, MQTT user properties, MNS user properties
TAG = "polymq.tag"  # Kafka headers, AMQP headers, MQTT user properties
MESSAGE_GROUP = "polymq.message-group"  # Kafka headers, AMQP headers, MQTT
CONTENT_TYPE = "content-type"  # Kafka headers, RocketMQ and MNS user properties
CORRELATION_ID = "correlation-id"  # Kafka headers, RocketMQ and MNS user properties
REPLY_TO = "reply-to"  # Kafka headers, RocketMQ and MNS user properties

# Where a message came from, kept so the same protocol can serve it back whole.
# The full MQTT topic name; the storage topic is its first level (``sensors/a/b`` is
# stored in topic ``sensors``). A message without it is served to MQTT under its
# storage topic name, so a Kafka record produced to ``sensors`` reaches subscribers of
# ``sensors`` and ``sensors/#``.
MQTT_TOPIC = "mqtt.topic"
MQTT_QOS = "mqtt.qos"
MQTT_RETAIN = "mqtt.retain"
MQTT_PAYLOAD_FORMAT = "mqtt.payload-format"
AMQP_EXCHANGE = "amqp.exchange"
AMQP_ROUTING_KEY = "amqp.routing-key"
# The AMQP basic properties as published (byte for byte, so every field-table type
# round-trips), and a per-message expiration as an absolute deadline.
AMQP_PROPERTIES = "amqp.properties"
AMQP_EXPIRES_AT = "amqp.expires-at"

RESERVED = frozenset(
    {
        KEY,
        TAG,
        MESSAGE_GROUP,
        CONTENT_TYPE,
        CORRELATION_ID,
        REPLY_TO,
        MQTT_TOPIC,
        MQTT_QOS,
        MQTT_RETAIN,
        MQTT_PAYLOAD_FORMAT,
        AMQP_EXCHANGE,
        AMQP_ROUTING_KEY,
        AMQP_PROPERTIES,
        AMQP_EXPIRES_AT,
    }
)

# Properties under these prefixes are one protocol's bookkeeping (the raw AMQP basic
# properties, an MQTT QoS, an MNS property-type list, a Kafka control flag): the
# protocol that wrote them reads them back, every other one leaves them out, so a
# consumer sees only the fields of the model and the user's own properties.
PRIVATE_PREFIXES = ("amqp.", "mqtt.", "mns.", "kafka.")

# Where AMQP meets the storage topics other protocols address (docs/interop.md): an
# exchange declared with this argument (a string naming a storage topic) also appends
# each publish to that topic, and a queue declared with it is consumed from that topic.
AMQP_TOPIC_ARGUMENT = "x-polymq-topic"


def is_private(name: str) -> bool:
    """Whether a property is a field's carrier or another protocol's bookkeeping, never
    shown to a consumer as a user property of its own."""
    return name in RESERVED or name.startswith(PRIVATE_PREFIXES)
