"""A storage process of the replicated pool is SIGKILLed under real clients: another
process takes its shard over (lease, checkpoint, stream replay) and serves it; nothing
acknowledged is lost, and clients resume after the takeover."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx

from polymq.nameserver.client import NameserverClient
from polymq.storage.routes import RouteTable
from tests.replicated.conftest import ReplicatedPool

ONE_FORM = True
_JSON = {"Accept": "application/json", "Content-Type": "application/json"}
_TIMEOUT_S = 60.0


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def routes(pool: ReplicatedPool) -> RouteTable:
    client = NameserverClient([pool.cluster.nameserver])
    try:
        return await client.status()
    finally:
        await client.close()


async def owner_process(pool: ReplicatedPool, shard: str) -> str:
    """The storage process serving ``shard`` now: the one whose port the route names."""
    table = await routes(pool)
    [node] = [n for n in table.nodes if n.node_id == shard and n.alive]
    for name in pool.storage:
        child = pool.cluster.children[name]
        if any(f":{node.port} " in line or line.endswith(f":{node.port}") for line in child.lines):
            return name
    raise AssertionError(f"no storage process logged port {node.port} of {shard}")


def http(pool: ReplicatedPool, gateway: str = "gateway-1") -> httpx.AsyncClient:
    host, port = pool.cluster.address(gateway, "http")
    return httpx.AsyncClient(base_url=f"http://{host}:{port}", headers=_JSON, timeout=30.0)


async def test_mns_queue_survives_the_kill_of_its_shards_process(pool: ReplicatedPool) -> None:
    async with http(pool) as client:
        queue = f"q{uuid.uuid4().hex[:8]}"
        assert (await client.put(f"/queues/{queue}")).status_code == 201

        async def routed() -> bool:
            return ("default", queue) in (await routes(pool)).topics

        await _until(routed, "the queue's route")
        shard = (await routes(pool)).topics[("default", queue)]
        victim = await owner_process(pool, shard)
        acknowledged = []
        for i in range(50):
            reply = await client.post(f"/queues/{queue}/messages", json={"MessageBody": f"m{i}"})
            assert reply.status_code == 201, reply.text
            acknowledged.append(f"m{i}")
        await pool.cluster.kill(victim)
        killed_at = time.monotonic()
        resumed_at: float | None = None
        i = 50
        while time.monotonic() - killed_at < 30 and len(acknowledged) < 150:
            reply: httpx.Response | None
            try:
                reply = await client.post(
                    f"/queues/{queue}/messages", json={"MessageBody": f"m{i}"}
                )
            except httpx.HTTPError:
                reply = None
            if reply is not None and reply.status_code == 201:
                acknowledged.append(f"m{i}")
                resumed_at = resumed_at or time.monotonic()
            else:
                await asyncio.sleep(0.05)
            i += 1
        assert resumed_at is not None, "no send succeeded within 30 s of the kill"
        new_owner = await owner_process(pool, shard)
        assert new_owner != victim
        received = []
        while True:
            reply = await client.get(f"/queues/{queue}/messages", params={"numOfMessages": 16})
            if reply.status_code == 404:
                break
            assert reply.status_code == 200, reply.text
            for message in reply.json()["Messages"]:
                received.append(message["MessageBody"])
                await client.delete(
                    f"/queues/{queue}/messages", params={"ReceiptHandle": message["ReceiptHandle"]}
                )
        assert set(acknowledged) <= set(received), set(acknowledged) - set(received)
        print(f"takeover: first send acknowledged {resumed_at - killed_at:.2f} s after the kill")
