"""MQTT keeps serving while a storage node is down (issue 22, item 4).

A persistent QoS 1 subscriber whose session queue is on storage node A, another whose
queue is on node B, and publishers (MQTT 3.1.1 and 5) to a topic stored on node B.
Node A is SIGKILLed: every publish to B's topic still gets its PUBACK (reason 0), no
publisher is disconnected, and B's subscriber keeps receiving. Node A restarts: A's
subscriber gets every message that was acknowledged, those of the outage included.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.nameserver.client import NameserverClient
from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.mqtt.model import SESSION_PREFIX, SHARED_PREFIX, queue_topic
from polymq.protocols.mqtt.peers import EVENTS_TOPIC
from polymq.storage.errors import StorageUnavailable
from polymq.storage.routes import RouteTable
from tests.cluster.fast_failure import cluster_env
from tests.mqtt.helpers import TIMEOUT, Paho

ONE_FORM = True  # the separated form as processes, built here
# Six processes started, one killed and restarted, on a machine shared with others.
pytestmark = pytest.mark.timeout(420)
_NAMESPACE = "default"
_BEFORE, _DURING, _AFTER = 10, 20, 10
_AFTER_MOST = 2_000  # publishes per publisher while the owed copies are made


@pytest.mark.parametrize("gateways", [1, 2])
async def test_publishes_to_a_live_node_keep_their_acks_while_a_session_node_is_down(
    tmp_path: Path, gateways: int
) -> None:
    """With two gateways the subscribers are on the first, the publishers on the
    second (which routes to the sessions through what the first announced)."""
    async with _cluster(tmp_path, gateways) as cluster:
        subscribers = cluster.address("gateway-1", "mqtt")[1]
        publishers = cluster.address(f"gateway-{gateways}", "mqtt")[1]
        setup = await asyncio.to_thread(_placed, cluster, subscribers, publishers)
        acked = await asyncio.to_thread(_publish, setup, "before", _BEFORE)
        await asyncio.to_thread(_received_by, setup.on_a, acked, "A's subscriber, before")
        await asyncio.to_thread(_received_by, setup.on_b, acked, "B's subscriber, before")
        await cluster.kill(setup.storage_a)
        during = await asyncio.to_thread(_publish, setup, "during", _DURING)
        await asyncio.to_thread(_received_by, setup.on_b, during, "B's subscriber, A down")
        await cluster.start(setup.storage_a)
        # Publishing on while the owed copies are made: each publisher's messages
        # must still reach A's queue in the order they were published.
        after = await asyncio.to_thread(
            _publish, setup, "after", _AFTER_MOST, until=lambda: _has(setup.on_a, during)
        )
        owed = acked | during | after
        await asyncio.to_thread(_received_by, setup.on_a, owed, "A's subscriber", 120.0)
        await asyncio.to_thread(_received_by, setup.on_b, owed, "B's subscriber")
        for client in (*setup.publishers, setup.on_a, setup.on_b):
            assert client.disconnects == [], f"{client.client_id} was disconnected"
        for subscriber in (setup.on_a, setup.on_b):
            late = _out_of_order(subscriber, setup.sent)
            assert not late, f"{subscriber.client_id} got, first after a later one: {late[:5]}"
        # Only the publish that found node A away first (its append wrote node B's
        # share before failing, and it was stored again owing) may be there twice.
        twice = _stored_twice(setup.on_b)
        assert len(twice) <= 1, f"stored twice: {sorted(twice)}"
        setup.close()


def _out_of_order(subscriber: Paho, sent: dict[str, list[bytes]]) -> list[tuple[bytes, bytes]]:
    """(message, the later one of the same publisher it came after) for each message
    the subscriber got first (not a resend, not seen before) after a later one."""
    rank = {
        payload: (client, i)
        for client, payloads in sent.items()
        for i, payload in enumerate(payloads)
    }
    latest: dict[str, tuple[int, bytes]] = {}
    seen: set[bytes] = set()
    late = []
    for message in list(subscriber.messages):
        if message.dup or message.payload in seen or message.payload not in rank:
            continue
        seen.add(message.payload)
        client, i = rank[message.payload]
        last = latest.get(client)
        if last is not None and last[0] > i:
            late.append((message.payload, last[1]))
        else:
            latest[client] = (i, message.payload)
    return late


def _has(subscriber: Paho, payloads: set[bytes]) -> bool:
    return payloads <= {m.payload for m in list(subscriber.messages)}


def _stored_twice(subscriber: Paho) -> set[bytes]:
    """Payloads a subscriber got more than once as new messages (not resent)."""
    seen: set[bytes] = set()
    twice = set()
    for message in list(subscriber.messages):
        if message.dup:
            continue
        if message.payload in seen:
            twice.add(message.payload)
        seen.add(message.payload)
    return twice


async def test_copies_owed_by_a_gateway_killed_during_the_outage_are_made_after_it(
    tmp_path: Path,
) -> None:
    """What the gateway owed when it died is held in storage (the marked publishes
    and its tail's position), not only in its memory: restarted after node A, it makes
    the copies."""
    async with _cluster(tmp_path, 1) as cluster:
        port = cluster.address("gateway-1", "mqtt")[1]
        setup = await asyncio.to_thread(_placed, cluster, port, port)
        acked = await asyncio.to_thread(_publish, setup, "before", _BEFORE)
        await asyncio.to_thread(_received_by, setup.on_a, acked, "A's subscriber, before")
        await cluster.kill(setup.storage_a)
        during = await asyncio.to_thread(_publish, setup, "during", _DURING)
        await cluster.kill("gateway-1")
        await cluster.start(setup.storage_a)
        await cluster.start("gateway-1")
        # paho reconnects by itself, to the same port
        owed = acked | during
        await asyncio.to_thread(_received_by, setup.on_a, owed, "A's subscriber", 120.0)
        setup.close()


async def test_clean_clients_connect_while_the_events_node_is_down(tmp_path: Path) -> None:
    """Two gateways: the node holding ``$mqtt.events`` (maybe the namespace's home
    too) is SIGKILLed; clean-session clients still connect, subscribe and publish to
    a topic on the other node, and a subscriber on one gateway gets what is published
    through the other (its gateway's tail serves it)."""
    async with _cluster(tmp_path, 2) as cluster:
        one, two = (cluster.address(f"gateway-{i}", "mqtt")[1] for i in (1, 2))
        # (each gateway loads the namespace before: loading it follows the events)
        await asyncio.to_thread(lambda: Paho(one).connect().disconnect())
        victim, topic = await asyncio.to_thread(_events_node_and_a_topic_elsewhere, cluster, two)
        await cluster.kill(f"storage-{victim.removeprefix('node-')}")
        payloads = await asyncio.to_thread(_clean_clients_meet, one, two, topic)
        assert len(payloads) == 2 * _DURING


def _events_node_and_a_topic_elsewhere(cluster: LocalCluster, port: int) -> tuple[str, str]:
    probe = Paho(port).connect()
    victim, _ = _node_of(cluster, EVENTS_TOPIC)
    for _ in range(40):
        topic = f"p{uuid.uuid4().hex[:8]}"
        assert probe.publish(f"{topic}/probe", b"probe", qos=1) == 0
        if _node_of(cluster, topic)[0] != victim:
            probe.disconnect()
            return victim, topic
    raise AssertionError(f"no topic placed beside {victim}")


def _clean_clients_meet(subscribers: int, publishers: int, topic: str) -> set[bytes]:
    subscriber = Paho(subscribers, v5=True).connect()
    assert subscriber.connack == (False, 0), subscriber.connack
    assert subscriber.subscribe(f"{topic}/#", qos=1) == [1]
    clients = [Paho(publishers).connect(), Paho(publishers, v5=True).connect()]
    acked = set()
    for client in clients:
        assert client.connack == (False, 0), client.connack
    for i in range(_DURING):
        for client in clients:
            payload = f"{client.client_id}-{i}".encode()
            assert client.publish(f"{topic}/x", payload, qos=1) == 0
            acked.add(payload)
    _received_by(subscriber, acked, "the clean subscriber")
    for client in (subscriber, *clients):
        assert client.disconnects == [], f"{client.client_id} was disconnected"
        client.disconnect()
    return acked


async def test_a_sessions_shared_queue_on_a_live_node_keeps_delivering(tmp_path: Path) -> None:
    """A persistent subscriber whose own queue is on node A and whose shared group's
    queue is on node B: with A down, what the group gets still reaches it."""
    async with _cluster(tmp_path, 1) as cluster:
        port = cluster.address("gateway-1", "mqtt")[1]
        setup = await asyncio.to_thread(_placed, cluster, port, port)
        shared = await asyncio.to_thread(_shared_group_on_b, cluster, setup)
        await cluster.kill(setup.storage_a)
        sent = await asyncio.to_thread(_publish_to, setup, f"{setup.topic}/shared", _DURING)
        await asyncio.to_thread(_received_by, setup.on_a, sent, f"A's subscriber via {shared}")
        setup.close()


def _shared_group_on_b(cluster: LocalCluster, setup: _Setup) -> str:
    node_b = _node_of(cluster, setup.topic)[0]
    for _ in range(40):
        shared = f"$share/g{uuid.uuid4().hex[:6]}/{setup.topic}/shared"
        assert setup.on_a.subscribe(shared, qos=1) == [1]
        if _node_of(cluster, queue_topic(SHARED_PREFIX, shared.removeprefix("$share/")))[0] == (
            node_b
        ):
            return shared
        setup.on_a.client.unsubscribe(shared)
    raise AssertionError("no shared queue placed on node B")


def _publish_to(setup: _Setup, topic: str, count: int) -> set[bytes]:
    acked = set()
    publisher = setup.publishers[0]
    for i in range(count):
        payload = f"{topic}-{i}".encode()
        assert publisher.publish(topic, payload, qos=1) == 0
        acked.add(payload)
    return acked


@asynccontextmanager
async def _cluster(tmp_path: Path, gateways: int) -> AsyncIterator[LocalCluster]:
    specs = layout(storage=2, gateways=gateways, data_dir=tmp_path, port_offset=None)
    cluster = LocalCluster(specs, env=cluster_env())
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()


class _Setup:
    def __init__(
        self, node_a: str, topic: str, on_a: Paho, on_b: Paho, publishers: list[Paho]
    ) -> None:
        self.storage_a = f"storage-{node_a.removeprefix('node-')}"
        self.topic = topic
        self.on_a = on_a
        self.on_b = on_b
        self.publishers = publishers
        self.sent: dict[str, list[bytes]] = {p.client_id: [] for p in publishers}

    def close(self) -> None:
        for client in (self.on_a, self.on_b, *self.publishers):
            client.disconnect()


def _routes(cluster: LocalCluster) -> RouteTable:
    """The nameserver's table (asked again if a call is lost: the machine is shared)."""

    async def status() -> RouteTable:
        client = NameserverClient([cluster.nameserver])
        try:
            return await client.status()
        finally:
            await client.close()

    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return asyncio.run(status())
        except StorageUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _node_of(cluster: LocalCluster, topic: str) -> tuple[str, RouteTable]:
    deadline = time.monotonic() + TIMEOUT
    while True:
        routes = _routes(cluster)
        node = routes.topics.get((_NAMESPACE, topic))
        if node is not None and _NAMESPACE in routes.homes:
            return node, routes
        assert time.monotonic() < deadline, f"{topic} never showed in the routes"
        time.sleep(0.1)


def _session_on(cluster: LocalCluster, port: int, wanted: str | None) -> tuple[Paho, str, str]:
    """A persistent subscriber whose session queue is on node ``wanted`` (any node if
    None); returns it, its node and the namespace's home node."""
    for _ in range(40):
        client = Paho(port, clean=False).connect()
        assert client.connack == (False, 0)
        node, routes = _node_of(cluster, SESSION_PREFIX + client.client_id)
        if wanted is None or node == wanted:
            return client, node, routes.homes[_NAMESPACE]
        client.disconnect()
    raise AssertionError(f"no session queue placed on {wanted}")


def _placed(cluster: LocalCluster, subscribers: int, publishers: int) -> _Setup:
    """Node B: the namespace's home (its metadata, the sessions' records, stays up:
    losing it is another subject, docs/cluster.md); node A: the other one."""
    probe, _, home = _session_on(cluster, subscribers, None)
    probe.disconnect()
    nodes = {node.node_id for node in _routes(cluster).nodes}
    assert len(nodes) == 2, nodes
    node_a = next(n for n in nodes if n != home)
    on_a, _, _ = _session_on(cluster, subscribers, node_a)
    on_b, _, _ = _session_on(cluster, subscribers, home)
    publisher3 = Paho(publishers).connect()
    publisher5 = Paho(publishers, v5=True).connect()
    for _ in range(40):
        topic = f"p{uuid.uuid4().hex[:8]}"
        if not _copied_by(cluster, topic, subscribers):
            continue
        assert publisher3.publish(f"{topic}/probe", b"probe", qos=1) == 0
        if _node_of(cluster, topic)[0] == home:
            break
    else:
        raise AssertionError("no topic placed on the home node")
    for subscriber in (on_a, on_b):
        assert subscriber.subscribe(f"{topic}/#", qos=1) == [1]
    return _Setup(node_a, topic, on_a, on_b, [publisher3, publisher5])


def _copied_by(cluster: LocalCluster, topic: str, port: int) -> bool:
    """Whether the gateway serving MQTT on ``port`` is ``topic``'s owner, whose tail
    makes the topic's owed copies (peers.Peers.owns). With two gateways the
    publishers' gateway is then not the owner, and the order across the outage
    depends on the copies it makes itself."""
    gateways = []
    for name in cluster.children:
        if name.startswith("gateway-"):
            host, gateway_port = cluster.address(name, "mqtt")
            gateways.append(GatewayEndpoint(gateway_id=name, host=host, port=gateway_port))
    owner = owner_of(topic, gateways)
    return owner is not None and owner.port == port


def _publish(
    setup: _Setup, phase: str, count: int, until: Callable[[], bool] | None = None
) -> set[bytes]:
    """``count`` QoS 1 publishes from each publisher (fewer once ``until()``), each
    acknowledged with reason 0 before the next."""
    acked = set()
    for i in range(count):
        for publisher in setup.publishers:
            payload = f"{phase}-{publisher.client_id}-{i}".encode()
            reason = publisher.publish(f"{setup.topic}/{phase}", payload, qos=1)
            assert reason == 0, f"{payload!r} acknowledged with reason {reason:#x}"
            assert publisher.disconnects == [], f"{publisher.client_id} was disconnected"
            setup.sent[publisher.client_id].append(payload)
            acked.add(payload)
        if until is not None and until():
            break
    return acked


def _received_by(
    subscriber: Paho, payloads: set[bytes], what: str, timeout: float = TIMEOUT * 2
) -> None:
    subscriber.wait(
        lambda: _has(subscriber, payloads), f"every acknowledged message at {what}", timeout=timeout
    )
