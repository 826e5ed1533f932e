"""SIGKILL a storage node of the separated form (real processes: nameserver,
navigation, two storage nodes, two gateways) under pika clients with publisher
confirms and consumers on durable queues, one queue on each node.

Only what needs the dead node fails, with the channel error docs/cluster.md names
(404, as RabbitMQ answers for a queue whose node is down): the channels publishing to
and consuming from its queue are closed, while the same connection's channel on the
other node's queue keeps publishing and consuming, and its consumers can be
cancelled and started anew (their registration for other gateways waits for the
namespace's home if that is the node that died). A new connection opens while the
node is down, also when it is the namespace's home (which holds the vhost's
definitions) and the gateway never loaded the vhost before. Once the node is back,
its queue works through both gateways again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import AMQPChannelError, ChannelClosedByBroker

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.nameserver.client import NameserverClient
from polymq.protocols.amqp.queues import TOPIC_PREFIX
from polymq.storage.routes import RouteTable
from tests.cluster.fast_failure import cluster_env

_TIMEOUT_S = 60.0
_NOT_FOUND = 404
Address = tuple[str, int]


def _connect(address: Address) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(*address, heartbeat=0))


def _until(check: Callable[[], bool], what: str, pump: Callable[[], None]) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pump()


def _close_code(channel: BlockingChannel) -> int | None:
    """The reply code the broker closed ``channel`` with (pika keeps its reason)."""
    reason = getattr(channel, "_closing_reason", None)
    return reason.reply_code if isinstance(reason, ChannelClosedByBroker) else None


class _Clients:
    """One connection to the first gateway: durable queues on both nodes, and for
    each of the two queues under test a confirming publisher channel and a
    consumer channel (prefetch 5, acking)."""

    def __init__(self, gateway: Address) -> None:
        self.connection = _connect(gateway)
        setup = self.connection.channel()
        self.queues = [f"kill-{uuid.uuid4().hex[:8]}" for _ in range(8)]
        for queue in self.queues:
            setup.queue_declare(queue, durable=True)
        setup.close()
        self.got: dict[str, list[int]] = {}
        self.publishers: dict[str, BlockingChannel] = {}
        self.consumers: dict[str, BlockingChannel] = {}
        self.tags: dict[str, str] = {}

    def start(self, queues: Sequence[str]) -> None:
        for queue in queues:
            self.got[queue] = []
            publisher = self.connection.channel()
            publisher.confirm_delivery()
            consumer = self.connection.channel()
            consumer.basic_qos(prefetch_count=5)
            self.tags[queue] = consumer.basic_consume(queue, self._on_message(queue))
            self.publishers[queue], self.consumers[queue] = publisher, consumer
            self.publish(queue, range(10))
        for queue in queues:
            self.wait_consumed(queue, set(range(10)))

    def _on_message(self, queue: str) -> Callable[..., None]:
        def on_message(channel: Any, method: Any, _properties: Any, body: bytes) -> None:
            self.got[queue].append(int(body))
            channel.basic_ack(method.delivery_tag)

        return on_message

    def publish(self, queue: str, values: range) -> None:
        for i in values:
            self.publishers[queue].basic_publish("", queue, str(i).encode())

    def pump(self) -> None:
        self.connection.process_data_events(time_limit=0.1)

    def wait_consumed(self, queue: str, wanted: set[int]) -> None:
        _until(lambda: wanted <= set(self.got[queue]), f"{queue} to be consumed", self.pump)

    def lose(self, queue: str) -> None:
        """Publish to the dead node's queue until the broker closes the channels
        that need it: both with 404, the connection open."""
        publisher, consumer = self.publishers[queue], self.consumers[queue]
        deadline = time.monotonic() + _TIMEOUT_S
        while publisher.is_open:
            assert time.monotonic() < deadline, "publishing to the dead node's queue went on"
            try:
                self.publish(queue, range(100, 101))
            except AMQPChannelError:
                break
        assert _close_code(publisher) == _NOT_FOUND, getattr(publisher, "_closing_reason", None)
        _until(lambda: consumer.is_closed, "the dead queue's consumer channel to close", self.pump)
        assert _close_code(consumer) == _NOT_FOUND, getattr(consumer, "_closing_reason", None)
        assert self.connection.is_open

    def replace_consumer(self, queue: str, values: range) -> None:
        """Cancel the queue's consumer and close its channel, then consume anew on
        another channel: none of it needs more than the queue's own node."""
        old = self.consumers[queue]
        old.basic_cancel(self.tags[queue])
        old.close()
        consumer = self.connection.channel()
        consumer.basic_qos(prefetch_count=5)
        self.tags[queue] = consumer.basic_consume(queue, self._on_message(queue))
        self.consumers[queue] = consumer
        self.publish(queue, values)
        self.wait_consumed(queue, set(values))
        consumer.close()


async def _routes(cluster: LocalCluster) -> RouteTable:
    client = NameserverClient([cluster.nameserver])
    try:
        return await client.status()
    finally:
        await client.close()


async def _placement(cluster: LocalCluster, queues: Sequence[str]) -> tuple[dict[str, str], str]:
    """Each queue's node, and the namespace's home node."""
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        routes = await _routes(cluster)
        topics = {q: routes.topics.get(("default", TOPIC_PREFIX + q)) for q in queues}
        home = routes.homes.get("default")
        if home is not None and all(topics.values()):
            placed = {q: node for q, node in topics.items() if node is not None}
            assert len(set(placed.values())) == 2, f"queues not on both nodes: {placed}"
            return placed, home
        assert time.monotonic() < deadline, "the nameserver never listed the queues"
        await asyncio.sleep(0.1)


def _fresh_connection(gateway: Address, kept: str, home_alive: bool) -> None:
    """A connection to a gateway that has not served the vhost yet opens; without the
    namespace's home its channels get 404 (the definitions are out of reach), with
    it the live node's queue works."""
    with _connect(gateway) as connection:
        channel = connection.channel()
        if not home_alive:
            with pytest.raises(ChannelClosedByBroker) as closed:
                channel.queue_declare(kept, passive=True)
            assert closed.value.reply_code == _NOT_FOUND
            assert connection.is_open
            return
        channel.confirm_delivery()
        channel.queue_declare(kept, passive=True)
        channel.basic_publish("", kept, b"from a new connection")


def _succeeds(call: Callable[[], object]) -> bool:
    """Whether ``call`` got through, or the broker closed its channel with 404 (a
    gateway learns of a node's return at its next route refresh)."""
    try:
        call()
    except ChannelClosedByBroker as e:
        assert e.reply_code == _NOT_FOUND, e
        return False
    return True


def _after_restart(first: Address, second: Address, lost: str) -> None:
    """The node is back: its queue works through both gateways again, and the second
    gateway (which may have loaded the vhost without its change log, or not at all)
    follows what the first declares."""
    with _connect(first) as one, _connect(second) as two:

        def publish() -> None:
            channel = two.channel()
            channel.confirm_delivery()
            channel.queue_declare(lost, passive=True)
            channel.basic_publish("", lost, b"after the restart")

        _until(lambda: _succeeds(publish), "the restarted node's queue", lambda: None)
        late = f"late-{uuid.uuid4().hex[:8]}"

        def declare() -> None:
            one.channel().queue_declare(late, durable=True)

        def seen() -> None:
            two.channel().queue_declare(late, passive=True)

        _until(lambda: _succeeds(declare), "a declare on the first gateway", lambda: None)
        _until(lambda: _succeeds(seen), "the second gateway to see a new queue", lambda: None)
        got: list[bytes] = []

        def take() -> None:
            method, _properties, body = one.channel().basic_get(lost, auto_ack=True)
            if method is not None:
                got.append(body)

        _until(lambda: b"after the restart" in got, "the message published after it", take)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["other", "home"])
async def test_a_dead_storage_node_closes_only_the_channels_that_need_it(
    tmp_path: Path, victim: str
) -> None:
    specs = layout(storage=2, gateways=2, data_dir=tmp_path, port_offset=None)
    cluster = LocalCluster(specs, env=cluster_env())
    try:
        await cluster.start()
        first, second = (cluster.address(g, "amqp") for g in ("gateway-1", "gateway-2"))
        clients = await asyncio.to_thread(_Clients, first)
        placed, home = await _placement(cluster, clients.queues)
        dead = home if victim == "home" else next(n for n in placed.values() if n != home)
        lost = next(q for q, node in placed.items() if node == dead)
        kept = next(q for q, node in placed.items() if node != dead)
        await asyncio.to_thread(clients.start, [lost, kept])

        await cluster.kill(f"storage-{dead.removeprefix('node-')}")

        await asyncio.to_thread(clients.lose, lost)
        await asyncio.to_thread(clients.publish, kept, range(10, 30))
        await asyncio.to_thread(clients.wait_consumed, kept, set(range(30)))
        await asyncio.to_thread(clients.replace_consumer, kept, range(30, 40))
        await asyncio.to_thread(_fresh_connection, second, kept, victim != "home")
        assert clients.connection.is_open
        await asyncio.to_thread(clients.connection.close)

        await cluster.start(f"storage-{dead.removeprefix('node-')}")
        await asyncio.to_thread(_after_restart, first, second, lost)
    finally:
        await cluster.stop()
