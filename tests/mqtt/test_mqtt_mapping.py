"""PUBLISH <-> Message: the storage topic, properties, fields other protocols read."""

from __future__ import annotations

from polymq.protocols import interop
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.mapping import (
    message_from_publish,
    mqtt_topic_of,
    publish_from_message,
    published_qos,
    storage_topic,
)
from polymq.storage.model import Message


def test_storage_topic_is_the_first_level() -> None:
    assert storage_topic("sensors/a/b") == "sensors"
    assert storage_topic("sensors") == "sensors"
    assert storage_topic("/rooted") == "/"


def test_v5_properties_map_to_fields_and_back() -> None:
    packet = codec.Publish(
        topic="rpc/x",
        payload=b"{}",
        qos=2,
        retain=True,
        properties={
            codec.CONTENT_TYPE: "application/json",
            codec.CORRELATION_DATA: b"c1",
            codec.RESPONSE_TOPIC: "rpc/reply",
            codec.MESSAGE_EXPIRY: 10,
            codec.PAYLOAD_FORMAT: 1,
            codec.USER_PROPERTY: [("a", "1"), (interop.TAG, "t"), ("a", "2")],
        },
    )
    message = message_from_publish(packet, client_id="c", now_ms=1_000)
    assert message.content_type == "application/json"
    assert message.correlation_id == b"c1"
    assert message.reply_to == "rpc/reply"
    assert message.expiry_ms == 11_000
    assert message.tag == "t"
    assert message.producer == "c"
    assert message.property(interop.MQTT_TOPIC) == b"rpc/x"
    assert published_qos(message) == 2
    assert [(k, v) for k, v in message.properties if k == "a"] == [("a", b"1"), ("a", b"2")]
    back = publish_from_message(message, topic="rpc/x", qos=1, retain=False, now_ms=5_000, v5=True)
    assert back.properties[codec.MESSAGE_EXPIRY] == 6
    assert back.properties[codec.PAYLOAD_FORMAT] == 1
    assert back.properties[codec.USER_PROPERTY] == [(interop.TAG, "t"), ("a", "1"), ("a", "2")]
    v3 = publish_from_message(message, topic="rpc/x", qos=1, retain=False, now_ms=0, v5=False)
    assert v3.properties == {}


def test_foreign_message_is_served_under_its_storage_topic() -> None:
    record = Message(body=b"k", key=b"id-1", properties=(("h", b"v"),))
    assert mqtt_topic_of(record, "sensors") == "sensors"
    assert published_qos(record) == 1
    packet = publish_from_message(record, topic="sensors", qos=1, retain=False, now_ms=0, v5=True)
    assert packet.properties[codec.USER_PROPERTY] == [(interop.KEY, "id-1"), ("h", "v")]
