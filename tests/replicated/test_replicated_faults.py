"""Faults of the replicated pool, under a real client (the MNS API over httpx), one
pool for the module, each test leaving it whole again:

* the storage process serving a queue's shard SIGKILLed: another takes the shard
  over, nothing acknowledged is lost; restarted, it gets its shard back (hand-back),
  still without loss;
* one NATS server killed, a follower of the shard's stream, then its leader: writes
  continue, nothing is lost;
* the owner SIGSTOPped until its lease is taken, then SIGCONTed: it cannot append (a
  write it receives fails and never reaches the log), and it stops serving the shard.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
import nats
import pytest

from polymq.nameserver.client import NameserverClient
from polymq.storage.errors import StorageError
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.remote import RemoteStorage
from polymq.storage.replicated.stream import stream_name
from polymq.storage.routes import NodeStatus, RouteTable
from tests.replicated.conftest import ReplicatedPool

ONE_FORM = True
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]
_JSON = {"Accept": "application/json", "Content-Type": "application/json"}
_TIMEOUT_S = 60.0


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
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


async def shard_node(pool: ReplicatedPool, shard: str) -> NodeStatus:
    [node] = [n for n in (await routes(pool)).nodes if n.node_id == shard and n.alive]
    return node


def process_at(pool: ReplicatedPool, port: int) -> str:
    """The storage process that logged serving a shard at ``port``."""
    for name in pool.storage:
        if any(line.endswith(f"127.0.0.1:{port}") for line in pool.cluster.children[name].lines):
            return name
    raise AssertionError(f"no storage process serves port {port}")


async def healed(pool: ReplicatedPool) -> None:
    """Every storage process up, and shard-i served by storage-i (its preference)."""

    async def whole() -> bool:
        table = await routes(pool)
        for i, name in enumerate(pool.storage, start=1):
            nodes = [n for n in table.nodes if n.node_id == f"shard-{i}" and n.alive]
            if len(nodes) != 1 or process_at(pool, nodes[0].port) != name:
                return False
        return True

    try:
        await until(whole, "every shard back on the node that prefers it")
    except AssertionError:
        table = await routes(pool)
        for name in pool.storage:
            tail = "\n  ".join(pool.cluster.children[name].lines[-15:])
            print(f"--- {name}:\n  {tail}")
        raise AssertionError(f"not healed: {table.nodes}") from None


def _already_deleted(reply: httpx.Response) -> bool:
    """A DELETE repeated after a 503 whose delete was applied (the ack stored, its
    answer lost while a NATS server was down) finds its receipt stale: the message is
    gone, which is what the first attempt asked for (MNS answers a deleted message's
    receipt the same way). Only after a 503: a first answer like this is a defect."""
    return reply.status_code == 400 and reply.json().get("Code") == "ReceiptHandleError"


class Queue:
    """An MNS queue with the bodies sent (acknowledged) and received so far."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.name = f"q{uuid.uuid4().hex[:8]}"
        self.acknowledged: list[str] = []
        self.unanswered: set[str] = set()  # failed sends: maybe stored, never acknowledged
        self.sent = 0
        self.retried_last = False  # the last retried() request met a 503 first

    async def create(self, pool: ReplicatedPool) -> str:
        # 503 is the retryable answer while the gateway's routes still hold a node the
        # previous test stopped (soft state, refreshed from the nameserver).
        deadline = time.monotonic() + _TIMEOUT_S
        while (reply := await self.client.put(f"/queues/{self.name}")).status_code == 503:
            assert time.monotonic() < deadline, reply.text
            await asyncio.sleep(0.1)
        assert reply.status_code == 201, reply.text

        async def routed() -> bool:
            return ("default", self.name) in (await routes(pool)).topics

        await until(routed, "the queue's route")
        return (await routes(pool)).topics[("default", self.name)]

    async def send(self) -> bool:
        body = f"{self.name}-{self.sent}-" + "x" * (self.sent * 37 % 2000)
        self.sent += 1
        try:
            reply = await self.client.post(
                f"/queues/{self.name}/messages", json={"MessageBody": body}
            )
        except httpx.HTTPError:
            self.unanswered.add(body)
            return False
        if reply.status_code == 201:
            self.acknowledged.append(body)
            return True
        assert reply.status_code in (500, 503), reply.text  # retryable, never a wrong answer
        self.unanswered.add(body)
        return False

    async def send_until(self, count: int, seconds: float = 30.0) -> float | None:
        """Send until ``count`` more are acknowledged; seconds to the first success."""
        started = time.monotonic()
        first = None
        goal = len(self.acknowledged) + count
        while len(self.acknowledged) < goal:
            assert time.monotonic() - started < seconds, "sends did not resume"
            if await self.send():
                first = first if first is not None else time.monotonic() - started
            else:
                await asyncio.sleep(0.05)
        return first

    async def retried(self, method: str, **kwargs: object) -> httpx.Response:
        """A request repeated while the answer is the retryable 503 (a shard moving),
        as an application would; ``self.retried_last`` says whether it was."""
        deadline = time.monotonic() + _TIMEOUT_S
        self.retried_last = False
        while True:
            reply = await self.client.request(method, f"/queues/{self.name}/messages", **kwargs)  # type: ignore[arg-type]
            if reply.status_code != 503 or time.monotonic() > deadline:
                return reply
            self.retried_last = True
            await asyncio.sleep(0.1)

    async def drain(self) -> list[str]:
        bodies: list[str] = []
        while True:
            reply = await self.retried("GET", params={"numOfMessages": 16})
            if reply.status_code == 404:
                return bodies
            assert reply.status_code == 200, reply.text
            for message in reply.json()["Messages"]:
                bodies.append(message["MessageBody"])
                gone = await self.retried(
                    "DELETE", params={"ReceiptHandle": message["ReceiptHandle"]}
                )
                if self.retried_last and _already_deleted(gone):
                    continue  # the 503's delete was done, its answer lost: as MNS
                assert gone.status_code == 204, gone.text

    async def check(self) -> list[str]:
        """Every acknowledged send received once, in order; besides them only sends
        whose answer was an error (stored before the answer was lost: at least once)."""
        received = await self.drain()
        acknowledged = [body for body in received if body not in self.unanswered]
        assert acknowledged == self.acknowledged, (
            f"lost: {sorted(set(self.acknowledged) - set(received))[:5]}, "
            f"unexpected: {sorted(set(acknowledged) - set(self.acknowledged))[:5]}"
        )
        assert len(set(received)) == len(received), "a message delivered twice"
        return received


def http(pool: ReplicatedPool, gateway: str = "gateway-1") -> httpx.AsyncClient:
    host, port = pool.cluster.address(gateway, "http")
    return httpx.AsyncClient(base_url=f"http://{host}:{port}", headers=_JSON, timeout=30.0)


async def test_a_killed_storage_process_is_taken_over_and_gets_its_shard_back(
    module_pool: ReplicatedPool,
) -> None:
    pool = module_pool
    await healed(pool)
    async with http(pool) as client:
        queue = Queue(client)
        shard = await queue.create(pool)
        victim = process_at(pool, (await shard_node(pool, shard)).port)
        await queue.send_until(50)
        await pool.cluster.kill(victim)
        resumed = await queue.send_until(50)
        assert process_at(pool, (await shard_node(pool, shard)).port) != victim
        print(f"takeover: first send acknowledged {resumed:.2f} s after the kill")
        await pool.cluster.start(victim)
        await healed(pool)  # the hand-back: the shard is on its preferred node again
        await queue.send_until(20)
        await queue.check()


async def test_one_nats_server_killed_follower_then_leader(module_pool: ReplicatedPool) -> None:
    pool = module_pool
    await healed(pool)
    nc = await nats.connect(pool.nats.urls)
    try:
        async with http(pool) as client:
            queue = Queue(client)
            shard = await queue.create(pool)
            await queue.send_until(20)
            js = nc.jetstream()
            for role in ("follower", "leader"):
                info = await js.stream_info(stream_name(shard))
                assert info.cluster is not None
                leader = info.cluster.leader
                assert leader is not None
                if role == "leader":
                    victim = leader
                else:
                    victim = next(
                        str(r.name) for r in info.cluster.replicas or [] if r.name != leader
                    )
                index = int(victim.removeprefix("n")) - 1
                await pool.nats.kill(index)
                await queue.send_until(30)
                await pool.nats.restart(index)
                await queue.send_until(10)
            await queue.check()
    finally:
        await nc.close()


async def test_a_stopped_owner_cannot_append_once_its_lease_was_taken(
    module_pool: ReplicatedPool,
) -> None:
    pool = module_pool
    await healed(pool)
    async with http(pool) as client:
        queue = Queue(client)
        shard = await queue.create(pool)
        await queue.send_until(20)
        old = await shard_node(pool, shard)
        victim = process_at(pool, old.port)
        child = pool.cluster.children[victim]
        assert child.process is not None
        direct = RemoteStorage(old.host, old.port)
        ref = QueueRef("default", queue.name, 0)
        child.send(signal.SIGSTOP)
        try:
            # A write already on its way to the stopped owner: it reads it once resumed.
            late = asyncio.create_task(
                direct.append([AppendRequest(entry=Message(body=b"late"), queues=(ref,))])
            )

            async def moved() -> bool:
                table = await routes(pool)
                ports = [n.port for n in table.nodes if n.node_id == shard and n.alive]
                return bool(ports) and ports[0] != old.port

            await until(moved, "the shard's takeover")
            await queue.send_until(20)
        finally:
            child.send(signal.SIGCONT)
        try:
            result = await asyncio.wait_for(late, _TIMEOUT_S)
        except StorageError:
            result = None
        assert result is None, f"the deposed owner acknowledged a write: {result}"

        async def stopped_serving() -> bool:
            return any(f"shard {shard}: no longer served here" in line for line in child.lines)

        await until(stopped_serving, "the deposed owner to drop the shard")
        await direct.close()
        await queue.send_until(10)
        assert "late" not in await queue.check()
    await pool.cluster.kill(victim)
    await pool.cluster.start(victim)
    await healed(pool)
