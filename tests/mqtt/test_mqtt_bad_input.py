"""Bad input closes at most the offending connection, with the protocol's own error:
v5 clients get a reason code, v3 clients a CONNACK return code or a close."""

from __future__ import annotations

from pathlib import Path

import pytest

from polymq.protocols.mqtt import codec
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, RawClient, mqtt_server


def _still_serving(server: LiveServer, bystander: Paho) -> None:
    """The bystander connected before the bad input still publishes and receives."""
    bystander.publish("alive/check", b"ok", qos=1)
    bystander.wait(lambda: any(m.payload == b"ok" for m in bystander.messages), "echo")
    bystander.messages.clear()
    fresh = Paho(server.port("mqtt"), v5=True, username="alice", password="secret")
    fresh.connect()
    assert fresh.connack == (False, 0)
    fresh.disconnect()


def _reasons(packets: list[codec.Packet]) -> list[int]:
    """The reason codes of the DISCONNECTs received, each with its reason string."""
    reasons = []
    for packet in packets:
        assert isinstance(packet, codec.Disconnect), packet
        assert packet.properties[codec.REASON_STRING]
        reasons.append(packet.reason)
    return reasons


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    with mqtt_server(
        tmp_path, {"mqtt.max_packet_bytes": "4096"}, accounts={"alice": "secret"}
    ) as server:
        bystander = Paho(server.port("mqtt"), v5=True, username="alice", password="secret")
        bystander.connect()
        bystander.subscribe("alive/#", qos=1)
        yield server, bystander
        _still_serving(server, bystander)


def test_garbage_bytes(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    assert raw.closed() == []


def test_malformed_remaining_length(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    raw.connect("mal", username="alice", password=b"secret")
    raw.send(b"\x30\xff\xff\xff\xff\x01")  # five length bytes (v5 1.5.5)
    assert _reasons(raw.closed()) == [0x81]


def test_second_connect_is_a_protocol_error(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    raw.connect("twice", username="alice", password=b"secret")
    raw.send(codec.Connect(level=5, client_id="twice", username="alice", password=b"secret"))
    assert _reasons(raw.closed()) == [0x82]


def test_oversize_packet(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    ack = raw.connect("big", username="alice", password=b"secret")
    assert ack.properties[codec.MAXIMUM_PACKET_SIZE] == 4096
    raw.send(codec.Publish(topic="alive/big", payload=b"x" * 5000, qos=1, packet_id=1))
    assert _reasons(raw.closed()) == [0x95]


def test_invalid_utf8_topic(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    raw.connect("utf", username="alice", password=b"secret")
    raw.send(b"\x30\x05\x00\x03a\xff\xfe")  # topic bytes that are not UTF-8
    assert _reasons(raw.closed()) == [0x81]


@pytest.mark.parametrize("topic", ["alive/+", "alive/#"])
def test_wildcard_in_publish_topic(served, topic: str) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    raw.connect("wild", username="alice", password=b"secret")
    raw.send(codec.Publish(topic=topic, payload=b"x", qos=1, packet_id=1))
    assert _reasons(raw.closed()) == [0x90]


def test_wildcard_in_publish_topic_v3_closes(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"), level=4)
    raw.connect("wild3", username="alice", password=b"secret")
    raw.send(codec.Publish(topic="a/#", payload=b"x", qos=1, packet_id=1))
    assert raw.closed() == []


def test_bad_credentials_v5(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"))
    ack = raw.connect("who", username="alice", password=b"wrong")
    assert ack.reason == 0x86
    assert raw.closed() == []


def test_bad_credentials_v311_with_paho(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    client = Paho(server.port("mqtt"), username="mallory", password="x")
    client.client.reconnect_delay_set(60, 120)
    client.connect()
    assert client.connack is not None and client.connack[1] == 134  # paho maps return code 4
    client.client.loop_stop()


def test_bad_credentials_v3_return_code(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"), level=4)
    ack = raw.connect("who3", username="alice", password=b"nope")
    assert ack.reason == 4
    assert raw.closed() == []


def test_unknown_protocol_level(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"), level=4)
    raw.send(b"\x10\x0c\x00\x04MQTT\x09\x02\x00\x3c\x00\x00")
    assert raw.closed() == [codec.ConnAck(reason=1)]


def test_first_packet_not_connect(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    raw = RawClient(server.port("mqtt"), level=4)
    raw.send(codec.PingReq())
    assert raw.closed() == []


def test_long_and_odd_topic_names(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    long_level = "x" * 300  # longer than a storage topic name may be
    client = Paho(server.port("mqtt"), v5=True, username="alice", password="secret").connect()
    client.subscribe(f"{long_level}/#", qos=1)
    client.subscribe("alive/#", qos=1)
    reason = client.publish(f"{long_level}/a", b"x", qos=1)
    assert reason == 0x90  # topic name invalid: it cannot be stored
    assert client.publish("alive/ok", b"fine", qos=1) == 0
    assert [m.payload for m in client.wait_messages(1)] == [b"fine"]


def test_unstorable_topic_fails_alone_in_a_batch(served) -> None:  # type: ignore[no-untyped-def]
    server, bystander = served
    raw = RawClient(server.port("mqtt"))
    raw.connect("batch", username="alice", password=b"secret")
    bad = codec.Publish(topic="y" * 300, payload=b"no", qos=1, packet_id=1)
    good = codec.Publish(topic="alive/batch", payload=b"yes", qos=1, packet_id=2)
    raw.send(codec.encode(bad, 5) + codec.encode(good, 5))  # one read, one batch
    acks = [raw.receive(), raw.receive()]
    assert [(a.packet_id, a.reason) for a in acks if isinstance(a, codec.PubAck)] == [
        (1, 0x90),
        (2, 0x00),
    ]
    bystander.wait(lambda: any(m.payload == b"yes" for m in bystander.messages), "stored")
