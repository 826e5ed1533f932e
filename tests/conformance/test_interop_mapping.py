"""The adapters' mapping rules docs/interop.md states, one adapter at a time (pure:
no server): field carriers map back onto fields, protocol bookkeeping stays private."""

from __future__ import annotations

import dataclasses

from pamqp import commands

from polymq.protocols import interop
from polymq.protocols.amqp.properties import decode_properties, delivery_content, to_message
from polymq.protocols.kafka.records import message_headers
from polymq.protocols.mns.messages import render_message
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.mapping import publish_from_message
from polymq.protocols.rocketmq.mapping import to_proto
from polymq.storage.model import Message, MessageType, QueueRef, StoredMessage

# A message as another protocol stored it: fields, a user property, and bookkeeping
# of AMQP, MQTT, MNS and Kafka that no other protocol's consumer should see.
FOREIGN = Message(
    body=b"payload",
    key=b"k-1",
    tag="t-1",
    content_type="text/plain",
    properties=(
        ("color", b"blue"),
        (interop.AMQP_PROPERTIES, b"\x00\x01raw"),
        (interop.AMQP_EXCHANGE, b"ex"),
        (interop.MQTT_QOS, b"2"),
        ("mns.property-types", b"n=NUMBER"),
        ("kafka.control", b"commit"),
    ),
)
STORED = StoredMessage(
    message=FOREIGN,
    queue=QueueRef("default", "t"),
    offset=0,
    message_id="m-1",
    store_timestamp_ms=1,
)


def test_private_names_are_the_reserved_ones_and_protocol_prefixes() -> None:
    assert interop.is_private(interop.TAG)
    assert interop.is_private("amqp.anything") and interop.is_private("mqtt.topic")
    assert interop.is_private("mns.priority") and interop.is_private("kafka.corrupt")
    assert not interop.is_private("color")
    assert not interop.is_private("amqp")  # only the prefix with its dot


def test_amqp_headers_named_after_fields_become_the_fields() -> None:
    properties = commands.Basic.Properties(
        headers={
            interop.KEY: "explicit-key",
            interop.TAG: "t-9",
            interop.MESSAGE_GROUP: "g-1",
            interop.MQTT_QOS: "0",  # another protocol's bookkeeping: dropped
            "color": "blue",
            "count": 3,
        }
    )
    message = to_message(
        exchange="ex",
        routing_key="rk",
        properties=properties,
        raw_properties=bytes(properties.marshal()),
        body=b"b",
    )
    assert message.key == b"explicit-key"
    assert message.tag == "t-9"
    assert message.message_group == "g-1"
    user = [(n, v) for n, v in message.properties if not interop.is_private(n)]
    assert user == [("color", b"blue"), ("count", b"3")]


def test_amqp_routing_key_is_the_key_without_a_key_header() -> None:
    properties = commands.Basic.Properties()
    message = to_message(
        exchange="", routing_key="rk", properties=properties, raw_properties=b"", body=b""
    )
    assert message.key == b"rk" and message.tag is None


def test_amqp_delivers_a_foreign_message_without_bookkeeping() -> None:
    # Without the raw AMQP properties: an AMQP consumer would get those back as sent.
    properties = tuple(p for p in FOREIGN.properties if p[0] != interop.AMQP_PROPERTIES)
    stored = dataclasses.replace(
        STORED, message=dataclasses.replace(FOREIGN, properties=properties)
    )
    _, _, raw = delivery_content(stored)
    headers = decode_properties(raw).headers or {}
    assert headers == {"color": "blue", interop.KEY: "k-1", interop.TAG: "t-1"}


def test_kafka_headers_leave_out_bookkeeping() -> None:
    assert message_headers(FOREIGN) == [
        (interop.TAG, b"t-1"),
        (interop.CONTENT_TYPE, b"text/plain"),
        ("color", b"blue"),
    ]


def test_rocketmq_user_properties_leave_out_bookkeeping() -> None:
    pb = to_proto(STORED, namespace="", message_type=MessageType.NORMAL, store_host="h")
    assert dict(pb.user_properties) == {"color": "blue", interop.CONTENT_TYPE: "text/plain"}
    assert list(pb.system_properties.keys) == ["k-1"]


def test_mns_user_properties_leave_out_bookkeeping() -> None:
    fields = render_message(STORED, receipt=False)
    names = [p["Name"] for p in fields["UserProperties"]]
    assert names == ["color", interop.KEY, interop.CONTENT_TYPE]


def test_mqtt_user_properties_leave_out_bookkeeping() -> None:
    packet = publish_from_message(FOREIGN, topic="t", qos=1, retain=False, now_ms=0, v5=True)
    assert packet.properties[codec.USER_PROPERTY] == [
        (interop.KEY, "k-1"),
        (interop.TAG, "t-1"),
        ("color", "blue"),
    ]
