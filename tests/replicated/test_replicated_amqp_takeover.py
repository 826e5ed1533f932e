"""AMQP while the replicated pool's shards move (the chaos run of issue 16): a pika
consumer on a queue whose shard (also the vhost's home) is taken over keeps its
channel and resumes on the new owner, as a RabbitMQ quorum queue's consumer waits for
a new leader; and connection.open succeeds while no storage process is up at all.

Before, the consumer's channel was closed (404) when its queue's shard went away,
and a consumer that only waits for deliveries (the chaos bench's, most applications')
never looked at it again; connection.open answered 541 ``no live storage node``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pika
import pytest

from polymq.protocols.amqp.queues import TOPIC_PREFIX as AMQP_PREFIX
from tests.replicated import clients
from tests.replicated.clients import MessageId, parse
from tests.replicated.conftest import ReplicatedPool
from tests.replicated.test_replicated_clients_kill import (
    WAIT_S,
    _make_amqp,
    acknowledged,
    gateways,
    home_shard,
    place,
    server_of,
    until,
)

ONE_FORM = True
pytestmark = pytest.mark.timeout(300)

RATE = 20.0
AFTER = 10  # acknowledged after each step


class StayingConsumer(threading.Thread):
    """One connection, one channel, one basic.consume for the whole test: it never
    reopens anything, so it receives only as long as the server keeps its channel."""

    def __init__(self, address: tuple[str, int], queue: str) -> None:
        super().__init__(name="amqp-staying-consumer", daemon=True)
        self.address, self.queue = address, queue
        self.seen: set[MessageId] = set()
        self.closed: str = ""  # why its channel or connection ended, if it did
        self.consuming = threading.Event()
        self.halt = threading.Event()
        self._lock = threading.Lock()

    def _on_message(self, channel: Any, method: Any, _properties: Any, raw: bytes) -> None:
        message_id = parse(raw)
        assert message_id is not None, raw[:40]
        with self._lock:
            self.seen.add(message_id)
        channel.basic_ack(method.delivery_tag)

    def run(self) -> None:
        connection = pika.BlockingConnection(pika.ConnectionParameters(*self.address, heartbeat=0))
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=20)
            channel.basic_consume(self.queue, self._on_message)
            self.consuming.set()
            while not self.halt.is_set() and channel.is_open:
                connection.process_data_events(time_limit=0.1)
            if not channel.is_open:
                self.closed = f"channel closed: {getattr(channel, '_closing_reason', '?')}"
        except Exception as e:  # the connection went: recorded, the test fails on it
            self.closed = f"{type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(Exception):
                connection.close()

    def got(self) -> set[MessageId]:
        with self._lock:
            return set(self.seen)


def _open_and_close(address: tuple[str, int]) -> None:
    """connection.open, a channel, close: raises what pika raised."""
    connection = pika.BlockingConnection(
        pika.ConnectionParameters(*address, heartbeat=0, connection_attempts=1)
    )
    try:
        connection.channel().close()
    finally:
        connection.close()


async def test_a_consumer_stays_through_a_takeover_and_connections_open_without_storage(
    pool: ReplicatedPool,
) -> None:
    # Whichever process serves the shard now is killed: the shards need not be back
    # on the processes preferring them (a hand-back at start may be slow).
    at = gateways(pool)
    shard = await home_shard(pool)
    queue = await place(pool, shard, _make_amqp, lambda name: AMQP_PREFIX + name)

    async def served() -> bool:
        return await server_of(pool, shard) is not None

    await until(served, f"a process serving {shard}", pool)
    victim = await server_of(pool, shard)
    assert victim is not None

    consumer = StayingConsumer(at.consuming["amqp"], queue)
    consumer.start()
    assert await asyncio.to_thread(consumer.consuming.wait, WAIT_S)
    producer = clients.AmqpProducer("amqp", RATE, at.producing["amqp"], queue)
    producer.start()
    try:
        await acknowledged(pool, [producer], AFTER, 0.0, "before the kill")

        # The queue's shard (and the vhost's home) is taken over.
        await pool.cluster.kill(victim)
        killed_at = time.monotonic()

        async def taken_over() -> bool:
            return (await server_of(pool, shard)) not in (None, victim)

        await until(taken_over, f"another process serving {shard}", pool)
        await acknowledged(pool, [producer], AFTER, killed_at, "after the takeover")

        # No storage process at all: connection.open still succeeds.
        for name in pool.storage:
            await pool.cluster.kill(name)
        await asyncio.to_thread(_open_and_close, at.producing["amqp"])
        await asyncio.to_thread(_open_and_close, at.consuming["amqp"])
        for name in pool.storage:
            await pool.cluster.start(name)
        restarted_at = time.monotonic()
        await acknowledged(pool, [producer], AFTER, restarted_at, "after the restart")
    finally:
        await asyncio.to_thread(producer.stop)

    wanted = {(producer.tag, ack.seq) for ack in producer.acked()}
    deadline = time.monotonic() + WAIT_S
    while not wanted <= consumer.got() and not consumer.closed:
        assert time.monotonic() < deadline, (
            f"the consumer lacks {sorted(wanted - consumer.got())[:10]} "
            f"(of {len(wanted)} acknowledged)"
        )
        await asyncio.sleep(0.1)
    consumer.halt.set()
    await asyncio.to_thread(consumer.join, WAIT_S)
    assert not consumer.closed, consumer.closed
    assert wanted <= consumer.got()
