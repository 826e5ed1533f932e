"""The tails skip this gateway's own publishes unread (protocols/mqtt/own_appends.py):
what other protocols store between them still reaches MQTT subscribers, exactly once
and in order, and the tail reads far fewer messages than MQTT stored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polymq.gateway.processor import Caller
from polymq.protocols.mqtt import topic_tail
from polymq.protocols.mqtt.own_appends import OwnAppends
from polymq.protocols.mqtt.services import serving
from polymq.storage.model import AppendRequest, Message, QueueRef
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, mqtt_server

QUEUE = QueueRef("default", "mix", 0)


def test_ranges_merge_and_skip() -> None:
    own = OwnAppends()
    for offset in (0, 1, 2, 5, 4, 3, 8):  # 3 and 4 answered late: one range 0-6
        ticket = own.begin()
        own.end(ticket, [(QUEUE, offset)])
    assert own.skip(QUEUE, 0) == (6, 8)  # past 0-5; 6 and 7 are not ours
    assert own.skip(QUEUE, 7) == (7, 8)
    assert own.skip(QUEUE, 8) == (9, None)
    assert own.skip(QueueRef("default", "other", 0), 3) == (3, None)
    own.forget(QUEUE)
    ticket = own.begin()
    own.end(ticket, [(QUEUE, 20)])
    assert own.skip(QUEUE, 10) == (10, 20)


def test_settled_waits_for_appends_begun_before() -> None:
    async def run() -> None:
        own = OwnAppends()
        first = own.begin()
        upto = own.issued
        later = own.begin()  # begun after: not waited for
        waiter = asyncio.ensure_future(own.settled(upto, 30.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        own.end(first, [(QUEUE, 0)])
        await asyncio.wait_for(waiter, 30.0)
        await own.settled(own.issued, 0.01)  # ``later`` never ends: the timeout
        own.end(later)

    asyncio.run(run())


def _append_foreign(server: LiveServer, bodies: list[bytes], queue: QueueRef = QUEUE) -> None:
    """As another protocol stores: no ``mqtt.topic`` property."""

    async def append() -> None:
        services = serving(server.gateway.processor)
        assert services is not None
        broker = await services.brokers.get("default")
        caller = Caller(principal=broker.caller.principal, namespace="default", protocol="kafka")
        requests = [AppendRequest(entry=Message(body=b), queues=(queue,)) for b in bodies]
        await server.gateway.processor.append(caller, requests)

    server.call(append)


def _tail_read(server: LiveServer, topic: str = "mix") -> int:
    async def read() -> int:
        services = serving(server.gateway.processor)
        assert services is not None
        broker = await services.brokers.get("default")
        return broker.tail_messages_read(topic)

    return server.call(read)


def test_foreign_messages_between_own_publishes_arrive_and_own_ones_are_skipped(
    tmp_path: Path,
) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        pub = Paho(port).connect()
        pub.publish("mix/start", b"s", qos=1)  # the storage topic exists before the tail
        sub = Paho(port).connect()
        sub.subscribe("mix/#", qos=1)
        own_count = 0
        for round_ in range(5):
            for i in range(60):
                pub.client.publish("mix/a", b"m%d-%d" % (round_, i), qos=1)
            own_count += 60
            _append_foreign(server, [b"f%d-%d" % (round_, i) for i in range(3)])
        got = sub.wait_messages(own_count + 15)
        payloads = [m.payload for m in got]
        foreign = [p for p in payloads if p.startswith(b"f")]
        mine = [p for p in payloads if p.startswith(b"m")]
        assert foreign == [b"f%d-%d" % (r, i) for r in range(5) for i in range(3)]
        assert mine == [b"m%d-%d" % (r, i) for r in range(5) for i in range(60)]
        # Each wait of the tail reads one message; a run of own publishes is skipped.
        read = _tail_read(server)
        assert read < own_count // 2, f"the tail read {read} of {own_count} own publishes"


def test_a_steady_publisher_does_not_wake_the_tail_for_each_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One publish at a time (each its own append, as at everyday rates): the tail,
    woken by one of them, looks again only after its pace, and a message from another
    protocol still arrives. The pace is made long here so that how fast the machine
    publishes does not matter: 40 publishes take far less than 40 paces."""
    monkeypatch.setattr(topic_tail, "_OWN_PACE_S", 0.5)
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        pub = Paho(port).connect()
        pub.publish("pace/start", b"s", qos=1)  # the storage topic exists before the tail
        sub = Paho(port).connect()
        sub.subscribe("pace/#", qos=1)
        count = 40
        for i in range(count):
            pub.publish("pace/a", b"m%d" % i, qos=1)  # waits for its PUBACK
        _append_foreign(server, [b"f"], QueueRef("default", "pace", 0))
        got = [m.payload for m in sub.wait_messages(count + 1)]
        assert got == [b"m%d" % i for i in range(count)] + [b"f"]
        read = _tail_read(server, "pace")
        assert read <= count // 4, f"the tail read {read} of {count} publishes made one by one"


def test_a_flood_of_publishes_in_flight_is_not_read_back(tmp_path: Path) -> None:
    """Publishes stored but not yet answered when the tail looks are the router's own
    too: once it found one of them, it reads one message at a time (each then skipped
    with all that settled meanwhile), not a batch of them to drop."""
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        pub = Paho(port).connect()
        pub.publish("flood/start", b"s", qos=1)  # the storage topic exists before the tail
        sub = Paho(port).connect()
        sub.subscribe("flood/#", qos=0)
        count = 2000
        for i in range(count):
            pub.client.publish("flood/a", b"m%d" % i, qos=0)
        got = sub.wait_messages(count)
        assert [m.payload for m in got] == [b"m%d" % i for i in range(count)]
        read = _tail_read(server, "flood")
        assert read <= count // 10, f"the tail read {read} of {count} publishes"
