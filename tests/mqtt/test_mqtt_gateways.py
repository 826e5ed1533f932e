"""MQTT over two gateways on one storage behaves as one broker (EMQX's cluster): a
publish through one reaches subscribers on the other exactly once, persistent
sessions move between gateways with their queued messages, a client connecting to
one gateway takes its session over from the other, and sessions survive the gateways
restarting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.gateway.processor import Caller
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.mapping import storage_topic
from polymq.protocols.mqtt.services import serving
from polymq.storage.model import AppendRequest, Message, QueueRef
from tests.cluster.fast_failure import cluster_env
from tests.live_server import LiveServer, live_gateways, server_config

from .helpers import TIMEOUT, Paho, RawClient, wait_until

_TAKEN_OVER = 0x8E


@contextmanager
def two_gateways(tmp_path: Path) -> Iterator[list[LiveServer]]:
    config = server_config(tmp_path, ("mqtt",))
    with live_gateways(tmp_path, ("mqtt",), 2, config=config) as servers:
        yield servers


def follows(server: LiveServer, client_id: str, topic_filter: str) -> bool:
    """Whether ``server`` routes publishes to that subscription (it learned of it)."""

    async def check() -> bool:
        services = serving(server.gateway.processor)
        if services is None:
            return False
        broker = await services.brokers.get("default")
        return broker.follows(client_id, topic_filter)

    return server.call(check)


def wait_follows(server: LiveServer, client_id: str, topic_filter: str) -> None:
    wait_until(
        lambda: follows(server, client_id, topic_filter),
        what=f"{client_id}'s {topic_filter} known to the other gateway",
    )


def append_foreign(server: LiveServer, topic: str, bodies: list[bytes]) -> None:
    """What another protocol (Kafka, AMQP, MNS) stores under ``topic``: no
    ``mqtt.topic``."""

    async def append() -> None:
        processor = server.gateway.processor
        services = serving(processor)
        assert services is not None
        broker = await services.brokers.get("default")
        await broker.ensure_topic(topic)
        caller = Caller(principal=broker.caller.principal, namespace="default", protocol="kafka")
        requests = [
            AppendRequest(entry=Message(body=body), queues=(QueueRef("default", topic, 0),))
            for body in bodies
        ]
        await processor.append(caller, requests)

    server.call(append)


def payloads(client: Paho) -> list[bytes]:
    with client.lock:
        return [m.payload for m in client.messages]


def fence(publisher: Paho, subscriber: Paho, topic: str) -> None:
    """Publish a last QoS 1 message and wait for it: whatever was to arrive before it
    (duplicates included) has arrived."""
    publisher.publish(topic, b"fence", qos=1)
    subscriber.wait(lambda: b"fence" in [m.payload for m in subscriber.messages], "the fence")


def test_publish_through_one_gateway_reaches_subscribers_on_the_other(tmp_path: Path) -> None:
    with two_gateways(tmp_path) as (a, b):
        clean = Paho(b.port("mqtt")).connect()
        clean.subscribe("x/#", qos=2)
        persistent = Paho(b.port("mqtt"), v5=True, clean=False, session_expiry=300).connect()
        persistent.subscribe("x/#", qos=2)
        wait_follows(a, persistent.client_id, "x/#")
        publisher = Paho(a.port("mqtt"), v5=True).connect()
        sent = []
        for i in range(30):
            qos = i % 3
            body = f"m{i}-q{qos}".encode()
            publisher.publish(f"x/{qos}", body, qos=qos)
            sent.append(body)
        publisher.publish("x/fence", b"fence", qos=1)
        for subscriber in (clean, persistent):
            subscriber.wait_messages(31)  # QoS 0 from memory may come after the fence
            got = payloads(subscriber)
            assert sorted(got) == sorted([*sent, b"fence"]), f"lost or duplicated: {got}"
            for qos in (0, 1, 2):  # in order per QoS (a persistent session's QoS 0
                # come from memory, its QoS 1 and 2 from its queue, as in one gateway)
                assert [p for p in got if p.endswith(b"q%d" % qos)] == sent[qos::3]
            qos_seen = {m.payload: m.qos for m in subscriber.messages}
            assert [qos_seen[body] for body in sent] == [i % 3 for i in range(30)]
        for client in (publisher, clean, persistent):
            client.disconnect()


def test_a_publish_through_a_gateway_not_yet_told_of_a_subscription_is_queued(
    tmp_path: Path,
) -> None:
    """A gateway routes a publish with the subscriptions it knows; one made on the
    other gateway a moment ago (here: while gateway A's reading of ``$mqtt.events``
    is held) is served by the gateway it was made on, from the publish's stamp."""
    with two_gateways(tmp_path) as (a, b):
        publisher = Paho(a.port("mqtt")).connect()
        publisher.publish("now/warm", b"warm", qos=1)  # the storage topic exists
        for round_ in range(3):
            hold_events(a, True)
            session = Paho(b.port("mqtt"), clean=False).connect()
            session.subscribe("now/#", qos=1)
            session.disconnect()
            body = f"unknown-to-a-{round_}".encode()
            publisher.publish("now/x", body, qos=1)
            hold_events(a, False)
            again = Paho(a.port("mqtt"), client_id=session.client_id, clean=False).connect()
            again.wait_messages(1)
            fence(publisher, again, "now/fence")
            assert payloads(again) == [body, b"fence"], "lost, or queued twice"
            again.disconnect()
        publisher.disconnect()


def hold_events(server: LiveServer, hold: bool) -> None:
    """Stop (or restart) ``server`` reading ``$mqtt.events``: a gateway slow to
    learn what the others did."""

    async def toggle() -> None:
        services = serving(server.gateway.processor)
        assert services is not None
        broker = await services.brokers.get("default")
        events = broker.peer_events
        assert events is not None
        if hold and events.task is not None:
            await events.close()
        elif not hold and events.task is None:
            events.follow(broker.core.applied)

    server.call(toggle)


async def test_gmqtt_subscriber_on_the_other_gateway(tmp_path: Path) -> None:
    from gmqtt import Client
    from gmqtt.mqtt.constants import MQTTv50

    with two_gateways(tmp_path) as (a, b):
        received: asyncio.Queue[tuple[str, bytes, int]] = asyncio.Queue()

        def on_message(client: object, topic: str, payload: bytes, qos: int, props: Any) -> int:
            received.put_nowait((topic, payload, qos))
            return 0

        subscribed = asyncio.Event()
        sub = Client("g-sub")
        sub.on_message = on_message
        sub.on_subscribe = lambda *args: subscribed.set()
        await sub.connect("127.0.0.1", b.port("mqtt"), version=MQTTv50)
        sub.subscribe("g/#", qos=2)
        await asyncio.wait_for(subscribed.wait(), TIMEOUT)
        pub = Client("g-pub")
        await pub.connect("127.0.0.1", a.port("mqtt"), version=MQTTv50)
        for qos in (0, 1, 2):
            pub.publish(f"g/{qos}", f"m{qos}".encode(), qos=qos)
        got = [await asyncio.wait_for(received.get(), TIMEOUT) for _ in range(3)]
        assert sorted(got) == [("g/0", b"m0", 0), ("g/1", b"m1", 1), ("g/2", b"m2", 2)]
        await pub.disconnect()
        await sub.disconnect()


def test_persistent_session_gets_offline_messages_through_either_gateway(tmp_path: Path) -> None:
    with two_gateways(tmp_path) as (a, b):
        session = Paho(b.port("mqtt"), clean=False)
        session.connect()
        session.subscribe("off/#", qos=1)
        session.disconnect()
        wait_follows(a, session.client_id, "off/#")
        publisher = Paho(a.port("mqtt")).connect()
        for i in range(10):
            publisher.publish(f"off/{i}", f"a{i}".encode(), qos=1)
        append_foreign(a, storage_topic("off/x"), [f"k{i}".encode() for i in range(5)])
        publisher.disconnect()
        # Back through the other gateway than the one it subscribed on.
        again = Paho(a.port("mqtt"), client_id=session.client_id, clean=False).connect()
        assert again.connack == (True, 0)
        again.wait_messages(15)
        fence(Paho(b.port("mqtt")).connect(), again, "off/fence")
        got = payloads(again)
        assert sorted(got[:15]) == sorted(
            [f"a{i}".encode() for i in range(10)] + [f"k{i}".encode() for i in range(5)]
        )
        assert [p for p in got[:15] if p.startswith(b"a")] == [f"a{i}".encode() for i in range(10)]
        assert got[15:] == [b"fence"], "a message came twice"
        again.disconnect()
        # And once more, offline messages from the gateway it last used.
        publisher = Paho(b.port("mqtt")).connect()
        for i in range(5):
            publisher.publish(f"off/{i}", f"b{i}".encode(), qos=1)
        third = Paho(b.port("mqtt"), client_id=session.client_id, clean=False).connect()
        third.wait_messages(5)
        fence(publisher, third, "off/fence")
        assert payloads(third) == [f"b{i}".encode() for i in range(5)] + [b"fence"]
        third.disconnect()
        publisher.disconnect()


def test_taking_a_session_over_from_the_other_gateway_v5(tmp_path: Path) -> None:
    with two_gateways(tmp_path) as (a, b):
        first = Paho(a.port("mqtt"), v5=True, clean=False, session_expiry=300).connect()
        first.subscribe("take/#", qos=1)
        second = Paho(
            b.port("mqtt"), v5=True, client_id=first.client_id, clean=False, session_expiry=300
        ).connect()
        assert second.connack == (True, 0), "the session did not move with the client"
        first.wait(lambda: bool(first.disconnects), "the old connection to close")
        assert first.disconnects[0] == _TAKEN_OVER
        # The session (its subscription) continues on the new gateway, fed by both.
        publisher_a = Paho(a.port("mqtt")).connect()
        publisher_b = Paho(b.port("mqtt")).connect()
        wait_follows(a, first.client_id, "take/#")
        publisher_a.publish("take/a", b"via-a", qos=1)
        publisher_b.publish("take/b", b"via-b", qos=1)
        second.wait_messages(2)
        fence(publisher_a, second, "take/fence")
        assert sorted(payloads(second)) == [b"fence", b"via-a", b"via-b"]
        assert not payloads(first)
        for client in (publisher_a, publisher_b, second):
            client.disconnect()


def test_taking_a_session_over_from_the_other_gateway_v311(tmp_path: Path) -> None:
    """The session moves with what it owes: a message delivered to the old connection
    and never acknowledged comes again, marked DUP (3.1.1 4.4), before the new ones.
    (A client that acknowledged it just before the takeover may or may not get it
    again, depending on whether its PUBACK was read first: so the old connection here
    never acknowledges.)"""
    with two_gateways(tmp_path) as (a, b):
        first = RawClient(b.port("mqtt"), level=codec.LEVEL_311)
        first.connect("taken3", clean_start=False)
        first.subscribe("take3/#", qos=1)
        publisher = Paho(a.port("mqtt")).connect()
        wait_follows(a, "taken3", "take3/#")
        publisher.publish("take3/1", b"before", qos=1)
        delivered = first.receive()
        assert isinstance(delivered, codec.Publish) and delivered.payload == b"before"
        second = Paho(a.port("mqtt"), client_id="taken3", clean=False).connect()
        assert second.connack == (True, 0)
        assert first.closed() == [], "the old connection was not closed"
        publisher.publish("take3/2", b"after", qos=1)
        fence(publisher, second, "take3/fence")
        with second.lock:
            got = [(m.payload, m.dup) for m in second.messages]
        assert got == [(b"before", True), (b"after", False), (b"fence", False)]
        # A clean session's client id is taken over across gateways too.
        plain = Paho(a.port("mqtt")).connect()
        other = Paho(b.port("mqtt"), client_id=plain.client_id).connect()
        assert other.connack == (False, 0)
        plain.wait(lambda: bool(plain.disconnects), "the clean connection to close")
        for client in (publisher, second, other):
            client.disconnect()


def test_shared_subscription_members_on_both_gateways_share_once(tmp_path: Path) -> None:
    with two_gateways(tmp_path) as (a, b):
        members = [Paho(server.port("mqtt"), v5=True).connect() for server in (a, b)]
        for member in members:
            member.subscribe("$share/workers/jobs/#", qos=1)
        for member in members:
            wait_follows(a, member.client_id, "$share/workers/jobs/#")
            wait_follows(b, member.client_id, "$share/workers/jobs/#")
        publishers = [Paho(server.port("mqtt")).connect() for server in (a, b)]
        sent = []
        for i in range(20):
            body = f"job{i}".encode()
            publishers[i % 2].publish(f"jobs/{i}", body, qos=1)
            sent.append(body)

        def shared_out() -> list[bytes]:
            return [p for member in members for p in payloads(member)]

        wait_until(lambda: len(shared_out()) >= 20, what="20 jobs shared out")
        # A last job, and every member idle again: nothing more is on its way.
        publishers[0].publish("jobs/last", b"last", qos=1)
        wait_until(lambda: b"last" in shared_out(), what="the last job")
        assert sorted(shared_out()) == sorted([*sent, b"last"]), "a job lost or given twice"
        for client in (*members, *publishers):
            client.disconnect()


def test_will_and_retained_messages_cross_gateways(tmp_path: Path) -> None:
    with two_gateways(tmp_path) as (a, b):
        watcher = Paho(b.port("mqtt")).connect()
        watcher.subscribe("wills/#", qos=1)
        dying = Paho(a.port("mqtt"), will=("wills/d", b"gone", 1, True)).connect()
        dying.kill()
        watcher.wait_messages(1, "the will")
        assert payloads(watcher) == [b"gone"]
        late = Paho(a.port("mqtt")).connect()
        late.subscribe("wills/#", qos=1)
        late.wait_messages(1, "the retained will")
        assert late.messages[0].retain and late.messages[0].payload == b"gone"
        watcher.disconnect()
        late.disconnect()


def test_sessions_survive_both_gateways_restarting(tmp_path: Path) -> None:
    topic_filter = "rs/#"
    with two_gateways(tmp_path) as (a, b):
        session = Paho(a.port("mqtt"), v5=True, clean=False, session_expiry=600).connect()
        session.subscribe(topic_filter, qos=1)
        session.disconnect()
        wait_follows(b, session.client_id, topic_filter)
        publisher = Paho(b.port("mqtt")).connect()
        for i in range(5):
            publisher.publish(f"rs/{i}", f"before{i}".encode(), qos=1)
        publisher.disconnect()
    with two_gateways(tmp_path) as (a, b):
        back = Paho(
            b.port("mqtt"), v5=True, client_id=session.client_id, clean=False, session_expiry=600
        ).connect()
        assert back.connack == (True, 0)
        back.wait_messages(5)
        # The other restarted gateway knows the session from storage: it routes to it.
        wait_follows(a, session.client_id, topic_filter)
        publisher = Paho(a.port("mqtt")).connect()
        for i in range(5):
            publisher.publish(f"rs/{i}", f"after{i}".encode(), qos=1)
        back.wait_messages(10)
        fence(publisher, back, "rs/fence")
        assert payloads(back) == [f"before{i}".encode() for i in range(5)] + [
            f"after{i}".encode() for i in range(5)
        ] + [b"fence"]
        back.disconnect()
        publisher.disconnect()


async def test_a_killed_gateways_subscribers_move_without_losing_acknowledged_messages(
    tmp_path: Path, server_form: str
) -> None:
    """The separated form as processes: a persistent subscriber on gateway-1, QoS 1
    publishers on both; gateway-1 is SIGKILLed; the subscriber reconnects to
    gateway-2 and gets every message a publisher had an ack for (those in flight at
    the kill once their invisibility ends)."""
    if server_form == "cluster":
        pytest.skip("separated form already: runs once, as processes")
    specs = layout(storage=2, gateways=2, data_dir=tmp_path, port_offset=None)
    cluster = LocalCluster(specs, env=cluster_env())
    await cluster.start()
    try:
        one, two = (cluster.address(f"gateway-{i}", "mqtt")[1] for i in (1, 2))
        before = await asyncio.to_thread(_before_the_kill, one, two)
        await cluster.kill("gateway-1")
        await asyncio.to_thread(_after_the_kill, two, *before)
    finally:
        await cluster.stop()


def _before_the_kill(one: int, two: int) -> tuple[Paho, Paho, list[bytes]]:
    subscriber = Paho(one, clean=False).connect()
    subscriber.subscribe("kill/#", qos=1)
    publisher_two = Paho(two).connect()
    # Until gateway-2 routes to the subscription (it learns of it through storage).
    deadline = time.monotonic() + TIMEOUT
    while not any(m.payload == b"probe" for m in list(subscriber.messages)):
        assert time.monotonic() < deadline, "gateway-2 never routed to the subscriber"
        publisher_two.publish("kill/probe", b"probe", qos=1)
        time.sleep(0.1)
    publisher_one = Paho(one).connect()
    acked = []
    for i in range(20):
        assert publisher_one.publish(f"kill/a{i}", f"a{i}".encode(), qos=1) == 0
        assert publisher_two.publish(f"kill/b{i}", f"b{i}".encode(), qos=1) == 0
        acked += [f"a{i}".encode(), f"b{i}".encode()]
    subscriber.wait(lambda: b"a0" in [m.payload for m in subscriber.messages], "a first message")
    return subscriber, publisher_two, acked


def _after_the_kill(two: int, subscriber: Paho, publisher_two: Paho, acked: list[bytes]) -> None:
    subscriber.kill()
    moved = Paho(two, client_id=subscriber.client_id, clean=False).connect()
    assert moved.connack == (True, 0), "the session did not survive its gateway"
    for i in range(20):
        assert publisher_two.publish(f"kill/c{i}", f"c{i}".encode(), qos=1) == 0
        acked.append(f"c{i}".encode())

    def received() -> set[bytes]:
        return {m.payload for m in list(subscriber.messages) + list(moved.messages)}

    moved.wait(lambda: set(acked) <= received(), "every acknowledged message", timeout=90)
    moved.disconnect()
    publisher_two.disconnect()
