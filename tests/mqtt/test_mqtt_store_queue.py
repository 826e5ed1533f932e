"""A connection goes on reading and delivering while its publishes wait for the disk
(protocols/mqtt/store_queue.py): with the commit log's fsync held, PUBLISHes read
after one waiting for it still reach an online subscriber, and every PUBACK waits
for the fsync and then goes out in publish order."""

from __future__ import annotations

import select
from pathlib import Path

from polymq.protocols.mqtt import codec
from tests.held_fsync import HeldFsync
from tests.mqtt.helpers import Paho, RawClient, mqtt_server

WAIT_S = 30.0  # a bound on waiting for a condition, never a measured time


def _publish(raw: RawClient, packet_id: int, body: bytes) -> None:
    publish = codec.Publish(topic="held/x", payload=body, qos=1, packet_id=packet_id)
    raw.send(codec.encode(publish, 4))


def test_publishes_flow_while_an_earlier_one_waits_for_the_fsync(
    tmp_path: Path, held_fsync: HeldFsync
) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port).connect()
        watcher.subscribe("held/#", qos=1)
        raw = RawClient(port, level=4)
        raw.connect("publisher")
        _publish(raw, 1, b"first")  # the storage topic exists before the fsync is held
        assert raw.receive() == codec.PubAck(packet_id=1)
        held_fsync.armed.set()
        _publish(raw, 2, b"held")
        assert held_fsync.entered.wait(WAIT_S), "no fsync was asked for"
        _publish(raw, 3, b"after")
        _publish(raw, 4, b"and after")
        received = watcher.wait_messages(4, "the publishes read behind the held one")
        assert [m.payload for m in received] == [b"first", b"held", b"after", b"and after"]
        readable, _, _ = select.select([raw.sock], [], [], 0)
        assert not readable and not raw.pending, "a PUBACK went out before its fsync"
        held_fsync.released.set()
        acks = [raw.receive() for _ in range(3)]
        assert acks == [codec.PubAck(packet_id=i) for i in (2, 3, 4)]
        raw.close()


def test_nothing_follows_the_servers_disconnect_while_earlier_publishes_are_stored(
    tmp_path: Path, held_fsync: HeldFsync
) -> None:
    """v5 3.14.4: after its DISCONNECT the server sends nothing more. A PUBLISH over
    the receive maximum closes the connection while the two before it still wait for
    their fsync; once stored they are recorded, but their PUBRECs stay unsent."""
    with mqtt_server(tmp_path, {"mqtt.receive_maximum": "2"}) as server:
        raw = RawClient(server.port("mqtt"))
        raw.connect("greedy")
        first = codec.Publish(topic="rm", payload=b"x", qos=2, packet_id=1)
        raw.send(first)  # the storage topic exists before the fsync is held
        assert raw.receive() == codec.PubRec(packet_id=1)
        raw.send(codec.PubRel(packet_id=1))
        assert raw.receive() == codec.PubComp(packet_id=1)
        held_fsync.armed.set()
        raw.send(codec.Publish(topic="rm", payload=b"x", qos=2, packet_id=2))
        assert held_fsync.entered.wait(WAIT_S), "no fsync was asked for"
        for pid in (3, 4):  # three unacknowledged with the held one: one too many
            raw.send(codec.Publish(topic="rm", payload=b"x", qos=2, packet_id=pid))
        goodbye = codec.Disconnect(
            reason=0x93, properties={codec.REASON_STRING: "receive maximum exceeded"}
        )
        assert raw.receive() == goodbye
        held_fsync.released.set()
        assert raw.closed() == [], "a packet followed the server's DISCONNECT"


def test_no_delivery_follows_the_servers_disconnect(tmp_path: Path, held_fsync: HeldFsync) -> None:
    """v5 4.13: the server's DISCONNECT is its last packet, also for deliveries. The
    connection it closes waits for its own publish's fsync before it ends; a message
    published meanwhile to a topic it subscribed is not sent after the DISCONNECT."""
    with mqtt_server(tmp_path, {"mqtt.receive_maximum": "1"}) as server:
        port = server.port("mqtt")
        watcher = Paho(port).connect()
        watcher.subscribe("news", qos=0)
        raw = RawClient(port)
        raw.connect("leaving")
        raw.subscribe("news", qos=0)
        publisher = Paho(port).connect()
        publisher.publish("news", b"before", qos=0)  # the storage topics exist before
        assert raw.receive() == codec.Publish(topic="news", payload=b"before")
        raw.send(codec.Publish(topic="own", payload=b"x", qos=1, packet_id=1))
        assert raw.receive() == codec.PubAck(packet_id=1)
        held_fsync.armed.set()
        raw.send(codec.Publish(topic="own", payload=b"x", qos=1, packet_id=2))
        assert held_fsync.entered.wait(WAIT_S), "no fsync was asked for"
        raw.send(codec.Publish(topic="own", payload=b"x", qos=1, packet_id=3))
        goodbye = codec.Disconnect(
            reason=0x93, properties={codec.REASON_STRING: "receive maximum exceeded"}
        )
        assert raw.receive() == goodbye
        publisher.publish("news", b"after the goodbye", qos=0)
        received = watcher.wait_messages(2, "the publish after the goodbye")
        assert [m.payload for m in received] == [b"before", b"after the goodbye"]
        held_fsync.released.set()
        assert raw.closed() == [], "a delivery followed the server's DISCONNECT"
