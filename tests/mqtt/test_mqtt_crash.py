"""A server killed (SIGKILL) in the middle of a QoS 2 flow: exactly once still holds,
since a QoS 2 PUBLISH is appended with a dedup key that the storage engine records
with the message (protocols/mqtt/sessions.py, ``Sessions.qos2_dedup_key``)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from polymq.protocols.mqtt import codec
from tests.crash_server import crash_server, free_port
from tests.mqtt.helpers import RawClient

_P = TypeVar("_P")


def _expect(client: RawClient, kind: type[_P]) -> _P:
    packet = client.receive()
    assert isinstance(packet, kind), packet
    return packet


def _persistent(port: int, client_id: str) -> tuple[RawClient, codec.ConnAck]:
    client = RawClient(port)
    ack = client.connect(client_id, clean_start=False, properties={codec.SESSION_EXPIRY: 600})
    return client, ack


def test_qos2_resend_after_a_crash_is_stored_once(tmp_path: Path) -> None:
    port = free_port()  # the same port across the crash: the client comes back to it
    with crash_server(tmp_path, "mqtt", port=port):
        watcher, _ = _persistent(port, "watcher")
        watcher.subscribe("crash/#", qos=1)
        watcher.send(codec.Disconnect())
        watcher.close()
        publisher, _ = _persistent(port, "publisher")
        publish = codec.Publish(topic="crash/a", payload=b"once", qos=2, packet_id=7)
        publisher.send(publish)
        _expect(publisher, codec.PubRec)
        # killed here: PUBREC sent, PUBREL not received
    publisher.close()
    with crash_server(tmp_path, "mqtt", port=port):
        publisher, ack = _persistent(port, "publisher")
        assert ack.session_present
        publish.dup = True
        publisher.send(publish)  # the client resends what got no PUBCOMP (v5 4.4)
        _expect(publisher, codec.PubRec)
        publisher.send(codec.PubRel(packet_id=7))
        assert _expect(publisher, codec.PubComp).reason in (0x00, 0x92)
        # the packet id reused after PUBCOMP, same payload: a new message
        publisher.send(codec.Publish(topic="crash/a", payload=b"once", qos=2, packet_id=7))
        _expect(publisher, codec.PubRec)
        publisher.send(codec.PubRel(packet_id=7))
        _expect(publisher, codec.PubComp)
        publisher.send(codec.Publish(topic="crash/a", payload=b"end", qos=1, packet_id=8))
        _expect(publisher, codec.PubAck)
        watcher, ack = _persistent(port, "watcher")
        assert ack.session_present
        payloads: list[bytes] = []
        while not payloads or payloads[-1] != b"end":
            packet = _expect(watcher, codec.Publish)
            payloads.append(packet.payload)
            watcher.send(codec.PubAck(packet_id=packet.packet_id))
        assert payloads == [b"once", b"once", b"end"]
        publisher.close()
        watcher.close()
