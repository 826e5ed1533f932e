"""Takeover time in the separated form with ``--replicas 3``: how long a paced producer
goes without an acknowledged append once the storage process serving its queue's shard
is SIGKILLed.

The producer sends MNS messages (httpx, one request at a time, at a steady rate) and
does the kill itself, between two requests, when the bench asks for it: so no request
is in flight at the kill, and the first acknowledgement after it is an append the new
owner made (the old one is dead), never a late answer of the old one. The figure is
from the kill to that acknowledgement. Then the killed process is restarted and the
bench waits for the hand-back (the shard's owner is the process that prefers it again)
before the next kill. At the end the queue is drained: every acknowledged message must
be there.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from bench.replication_forms import Form
from polymq.nameserver.client import NameserverClient
from polymq.storage.routes import NodeStatus, RouteTable

__all__ = ["Takeovers", "measure_takeovers"]

_JSON = {"Accept": "application/json", "Content-Type": "application/json"}
_T = TypeVar("_T")
_HOME_WAIT_S = 20.0  # for a shard to be on the process preferring it before a kill
_WAIT_S = 90.0  # for a takeover, a restart's hand-back, a route: generous, never asserted


@dataclass
class Takeovers:
    """Seconds from each kill to the first acknowledged append after it, and from each
    restart to the hand-back; what the producer sent and what the queue held."""

    rate: int
    takeover_s: list[float] = field(default_factory=list)
    handback_s: list[float] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)
    away: list[str] = field(default_factory=list)  # killed while serving a shard it does
    # not prefer: no hand-back to wait for (the shard went to the process preferring it)
    acknowledged: int = 0
    failed: int = 0  # answered with an error or not at all (maybe stored: at least once)
    received: int = 0
    lost: int = 0  # acknowledged and not in the queue at the end


class _Producer:
    """One MNS producer, paced at ``rate`` requests/s (no catching up after a slow
    answer), that SIGKILLs ``kill_pid`` at its next gap between requests."""

    def __init__(self, client: httpx.AsyncClient, queue: str, rate: int) -> None:
        self.client = client
        self.queue = queue
        self.rate = rate
        self.acked: list[str] = []
        self.ack_times: list[float] = []  # monotonic time of each answer, ascending
        self.failed = 0
        self.kill_pid: int | None = None
        self.killed_at = 0.0
        self.killed = asyncio.Event()
        self.stopping = False

    async def run(self) -> None:
        due = time.monotonic()
        sent = 0
        while not self.stopping:
            due = max(due + 1 / self.rate, time.monotonic())
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self.kill_pid is not None:
                os.kill(self.kill_pid, signal.SIGKILL)
                self.killed_at = time.monotonic()
                self.kill_pid = None
                self.killed.set()
            body = f"{self.queue}-{sent}"
            sent += 1
            try:
                reply = await self.client.post(
                    f"/queues/{self.queue}/messages", json={"MessageBody": body}
                )
            except httpx.HTTPError:
                self.failed += 1
                continue
            if reply.status_code == 201:
                self.ack_times.append(time.monotonic())
                self.acked.append(body)
            else:
                self.failed += 1

    async def acked_after(self, moment: float) -> float:
        """The time of the first acknowledgement after ``moment``."""
        deadline = time.monotonic() + _WAIT_S
        while True:
            times = self.ack_times
            index = bisect.bisect_right(times, moment)
            if index < len(times):
                return times[index]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no acknowledged append within {_WAIT_S:.0f} s")
            await asyncio.sleep(0.02)


async def _routes(nameserver: str) -> RouteTable:
    client = NameserverClient([nameserver])
    try:
        return await client.status()
    finally:
        await client.close()


async def _serving(nameserver: str, queue: str) -> tuple[str, NodeStatus] | None:
    """The queue's shard and the live node serving it (the newest epoch), if known."""
    table = await _routes(nameserver)
    shard = table.topics.get(("default", queue))
    nodes = [n for n in table.nodes if n.node_id == shard and n.alive and n.owner]
    if shard is None or not nodes:
        return None
    return shard, max(nodes, key=lambda n: n.epoch)


async def _home(nameserver: str, queue: str) -> tuple[str, NodeStatus] | None:
    """The queue's shard and its node if the process preferring it (node-i for
    shard-i, as ``layout(..., replicas=3)`` has them) serves it."""
    served = await _serving(nameserver, queue)
    if served is None or served[1].owner != "node-" + served[0].removeprefix("shard-"):
        return None
    return served


async def _until(
    what: str, check: Callable[[], Awaitable[_T | None]], wait_s: float = _WAIT_S
) -> _T:
    deadline = time.monotonic() + wait_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _drain(client: httpx.AsyncClient, queue: str) -> list[str]:
    """Every message left in the queue (received and deleted, 16 at a time)."""
    bodies: list[str] = []
    idle_until = time.monotonic() + 5.0
    while time.monotonic() < idle_until:
        reply = await client.get(
            f"/queues/{queue}/messages", params={"numOfMessages": 16, "waitseconds": 1}
        )
        if reply.status_code == 503:
            await asyncio.sleep(0.1)
            continue
        if reply.status_code == 404:  # none visible now
            await asyncio.sleep(0.2)
            continue
        reply.raise_for_status()
        for message in reply.json()["Messages"]:
            bodies.append(message["MessageBody"])
            gone = await client.delete(
                f"/queues/{queue}/messages", params={"ReceiptHandle": message["ReceiptHandle"]}
            )
            gone.raise_for_status()
        idle_until = time.monotonic() + 5.0
    return bodies


async def measure_takeovers(form: Form, kills: int, rate: int, settle_s: float) -> Takeovers:
    """``kills`` SIGKILLs of the process serving a fresh queue's shard, each followed by
    its restart and hand-back; ``settle_s`` of steady sending between them."""
    host, port = form.address("http")
    nameserver = form.cluster.nameserver
    result = Takeovers(rate=rate)
    queue = f"takeover{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(
        base_url=f"http://{host}:{port}", headers=_JSON, timeout=30.0
    ) as client:
        created = await client.put(f"/queues/{queue}")
        assert created.status_code == 201, created.text
        await _until("the queue's route", lambda: _serving(nameserver, queue))
        producer = _Producer(client, queue, rate)
        task = asyncio.create_task(producer.run())
        try:
            await producer.acked_after(time.monotonic())
            for _ in range(kills):
                await asyncio.sleep(settle_s)
                # The process that prefers the shard, serving it, if it does so within
                # a while (a start side by side can leave a shard elsewhere); else
                # whichever serves it, whose restart is then no hand-back.
                shard, node = await _until("the queue's shard", lambda: _serving(nameserver, queue))
                with contextlib.suppress(TimeoutError):
                    shard, node = await _until(
                        "the shard at home", lambda: _home(nameserver, queue), _HOME_WAIT_S
                    )
                home = node.owner == "node-" + shard.removeprefix("shard-")
                victim = node.owner.replace("node-", "storage-", 1)
                process = form.cluster.children[victim].process
                assert process is not None
                producer.killed.clear()
                producer.kill_pid = process.pid
                await producer.killed.wait()
                await form.cluster.kill(victim)  # reaped (the signal was sent already)
                first = await producer.acked_after(producer.killed_at)
                result.takeover_s.append(first - producer.killed_at)
                result.victims.append(victim)
                restarted = time.monotonic()
                await form.cluster.start(victim)
                if home:
                    await _until(f"{shard} back to {victim}", lambda: _home(nameserver, queue))
                    result.handback_s.append(time.monotonic() - restarted)
                else:
                    result.away.append(f"{shard} on {victim}")
                await producer.acked_after(time.monotonic())
            await asyncio.sleep(settle_s)
        finally:
            producer.stopping = True
            with contextlib.suppress(Exception):
                await task
        received = set(await _drain(client, queue))
    acknowledged = set(producer.acked)
    result.acknowledged = len(acknowledged)
    result.failed = producer.failed
    result.received = len(received)
    result.lost = len(acknowledged - received)
    return result
