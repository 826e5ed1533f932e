"""The records gateways tell each other, and the stamp on their publishes: pure."""

from __future__ import annotations

from polymq.protocols import interop
from polymq.protocols.mqtt.peers import (
    GATEWAY_PROPERTY,
    Event,
    decode_event,
    encode_event,
    stamp_of,
    stamped,
)
from polymq.storage.model import Message, QueueRef, StoredMessage


def test_events_round_trip() -> None:
    events = [
        Event(kind="session", origin="g1", client="c", record={"subs": {"a/#": [1]}}),
        Event(kind="gone", origin="g2", client="c", incarnation="abc"),
        Event(kind="attach", origin="g1", client="c", host="g2", nonce="n1"),
        Event(kind="attach", origin="g1", client="c"),
        Event(kind="released", origin="g2", client="c", nonce="n1"),
    ]
    for event in events:
        assert decode_event(encode_event(event, 5)) == event


def test_records_this_version_cannot_read_are_skipped() -> None:
    for body in (b"", b"not json", b"[]", b'{"k": "session"}'):
        assert decode_event(Message(body=body)) is None


def _stored(message: Message) -> StoredMessage:
    return StoredMessage(
        message=message, queue=QueueRef("ns", "t"), offset=0, message_id="m", store_timestamp_ms=0
    )


def test_the_stamp_goes_second_and_reads_back() -> None:
    message = Message(body=b"x", properties=((interop.MQTT_TOPIC, b"t/1"), ("user", b"v")))
    stamp = stamped(message, b"42:gateway-1")
    assert stamp.properties == (
        (interop.MQTT_TOPIC, b"t/1"),
        (GATEWAY_PROPERTY, b"42:gateway-1"),
        ("user", b"v"),
    )
    assert stamp_of(_stored(stamp)) == ("gateway-1", 42)
    assert stamp_of(_stored(message)) is None
    assert stamp_of(_stored(stamped(message, b"garbage"))) is None
    assert interop.is_private(GATEWAY_PROPERTY)  # never shown to a consumer
