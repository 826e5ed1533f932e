"""Messages as CloudEvents and back (docs/eventbus.md, "Mappings"): the bus's own
layout (the Kafka binding's ``ce_`` properties), the AMQP and MQTT bindings'
property names, a structured-mode body, and any other message field by field."""

from __future__ import annotations

import json

import pytest

from polymq.protocols.eventbus.cloudevent import EventError, parse_binary
from polymq.protocols.eventbus.mapping import event_to_message, message_to_event
from polymq.storage.model import Message, QueueRef, StoredMessage

ONE_FORM = True  # pure: starts no server


def _stored(message: Message) -> StoredMessage:
    return StoredMessage(
        message=message,
        queue=QueueRef("ns", "orders"),
        offset=3,
        message_id="MID",
        store_timestamp_ms=1_700_000_000_000,
    )


def test_an_event_round_trips_through_a_message() -> None:
    headers = {
        "ce-specversion": "1.0",
        "ce-id": "e1",
        "ce-source": "/s",
        "ce-type": "t",
        "ce-subject": "sub",
        "ce-tenant": "acme",
        "content-type": "application/json",
    }
    event = parse_binary(headers.items(), b'{"a": [1, 2]}')
    message = event_to_message(event)
    assert message.key == b"sub" and message.content_type == "application/json"
    assert message.property("ce_tenant") == b"acme"
    back = message_to_event(_stored(message))
    assert dict(back.attributes) == dict(event.attributes)
    assert back.view()["data"] == {"a": [1, 2]}


@pytest.mark.parametrize("prefix", ["cloudEvents:", "cloudEvents_", ""])
def test_amqp_and_mqtt_binding_properties(prefix: str) -> None:
    properties = tuple(
        (f"{prefix}{name}", value)
        for name, value in (
            ("specversion", b"1.0"),
            ("id", b"x"),
            ("source", b"/amqp"),
            ("type", b"t"),
        )
    )
    event = message_to_event(_stored(Message(body=b"hi", properties=properties)))
    assert (event.id, event.attributes["source"]) == ("x", "/amqp")


def test_a_structured_body_is_the_event() -> None:
    body = json.dumps({"specversion": "1.0", "id": "s", "source": "/x", "type": "t", "data": 1})
    message = Message(body=body.encode(), content_type="application/cloudevents+json")
    assert message_to_event(_stored(message)).view()["data"] == 1


def test_any_other_message_maps_field_by_field() -> None:
    message = Message(
        body=b'{"t": 3}',
        key=b"room-1",
        tag="hot",
        properties=(("site", b"north"), ("mqtt.qos", b"1"), ("Not-Valid", b"x")),
        born_timestamp_ms=1_700_000_000_123,
    )
    event = message_to_event(_stored(message))
    assert dict(event.attributes) == {
        "specversion": "1.0",
        "id": "MID",
        "source": "polymq://ns/topics/orders",
        "type": "com.polymq.message",
        "time": "2023-11-14T22:13:20.123Z",
        "subject": "room-1",
        "tag": "hot",
        "site": "north",
    }
    assert event.view()["data"] == {"t": 3}


def test_a_message_claiming_to_be_an_event_must_be_one() -> None:
    with pytest.raises(EventError, match="'id' is missing"):
        message_to_event(_stored(Message(properties=(("ce_specversion", b"1.0"),))))
