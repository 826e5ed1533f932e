"""MQTT QoS 1 into a persistent session while the shards of its queue and of the
topic are taken over and handed back, again and again (the replicated chaos run of
issue 16 lost acknowledged publishes during a hand-back): a subscriber that stays
connected the whole time gets every acknowledged message.

The publisher is on one gateway, the subscriber on the other, so the session's copies
are made by the publishing gateway (or owed, and made by a topic tail, while the
queue's shard is away)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from tests.replicated import clients
from tests.replicated.clients import parse
from tests.replicated.conftest import ReplicatedPool
from tests.replicated.test_replicated_clients_kill import (
    NAMESPACE,
    WAIT_S,
    acknowledged,
    gateways,
    routes,
    server_of,
    until,
)

ONE_FORM = True
pytestmark = pytest.mark.timeout(400)

RATE = 25.0
AFTER = 10  # acknowledged after each kill, and after each hand-back
CYCLES = 4  # kills: the session queue's shard and the topic's, in turn


async def test_a_persistent_session_gets_every_acknowledged_publish_through_hand_backs(
    pool: ReplicatedPool,
) -> None:
    for i in (1, 2, 3):  # at start a process may hold another's shard for a moment

        async def settled(shard: str = f"shard-{i}", name: str = f"storage-{i}") -> bool:
            return await server_of(pool, shard) == name

        await until(settled, f"shard-{i} served by storage-{i}", pool)
    at = gateways(pool)
    name = f"h{uuid.uuid4().hex[:10]}"
    subscriber = clients.MqttSubscriber(at.consuming["mqtt"], f"sub-{name}", {f"{name}/t": 1})
    await asyncio.to_thread(subscriber.connect)
    await asyncio.to_thread(subscriber.subscribe, [(f"{name}/t", 1)])
    producer = clients.MqttProducer(
        "mqtt", RATE, at.producing["mqtt"], f"{name}/t", 1, f"pub-{name}"
    )
    producer.start()
    try:
        await acknowledged(pool, [producer], AFTER, 0.0, "at first")
        table = await routes(pool)
        queue_shard = table.topics[(NAMESPACE, f"$mqtt.session.sub-{name}")]
        topic_shard = table.topics[(NAMESPACE, name)]
        print(f"\nsession queue on {queue_shard}, topic on {topic_shard}")
        for cycle in range(CYCLES):
            shard = queue_shard if cycle % 2 == 0 else topic_shard
            victim = await server_of(pool, shard)
            assert victim is not None
            await pool.cluster.kill(victim)
            killed_at = time.monotonic()

            async def taken_over(shard: str = shard, victim: str = victim) -> bool:
                return (await server_of(pool, shard)) not in (None, victim)

            await until(taken_over, f"another process serving {shard}", pool)
            await acknowledged(pool, [producer], AFTER, killed_at, f"after kill {cycle}")
            await pool.cluster.start(victim)

            async def handed_back(shard: str = shard, victim: str = victim) -> bool:
                return await server_of(pool, shard) == victim

            await until(handed_back, f"{shard} handed back to {victim}", pool)
            back_at = time.monotonic()
            await acknowledged(pool, [producer], AFTER, back_at, f"after hand-back {cycle}")
    finally:
        await asyncio.to_thread(producer.stop)

    wanted = {(producer.tag, ack.seq) for ack in producer.acked()}

    def got() -> set[tuple[str, int]]:
        with subscriber.lock:
            return {i for d in subscriber.deliveries if (i := parse(d.raw)) is not None}

    deadline = time.monotonic() + WAIT_S
    while not wanted <= got() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    subscriber.client.disconnect()
    subscriber.client.loop_stop()
    missing = sorted(seq for _, seq in wanted - got())
    assert not missing, f"{len(missing)} of {len(wanted)} acknowledged never delivered: {missing}"
