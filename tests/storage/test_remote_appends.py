"""Appends merged by RemoteStorage (storage/remote_appends.py), against a real
StorageNode over loopback: appends made in one loop iteration go to the node in two calls,
in the order made, each caller with its own answer or error, nothing stored twice,
a transient message never in a call with a durable one, a cancelled queued append
never sent. The node's request counter says how many calls it got."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from polymq.storage import errors
from polymq.storage.model import AppendRequest, AppendResult, Message, QueueRef
from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from tests.storage.conftest import EngineFactory

NS = "default"
BURST = 40


def q(topic: str = "t") -> QueueRef:
    return QueueRef(NS, topic, 0)


def request(body: bytes, topic: str = "t", *, durable: bool = True) -> list[AppendRequest]:
    return [AppendRequest(entry=Message(body=body), queues=(q(topic),), durable=durable)]


@pytest.fixture
async def node(make_engine: EngineFactory) -> AsyncIterator[StorageNode]:
    node = StorageNode(make_engine(), "node-a")
    await node.start()
    try:
        yield node
    finally:
        await node.close()


@pytest.fixture
async def remote(node: StorageNode) -> AsyncIterator[RemoteStorage]:
    remote = RemoteStorage(*node.address)
    await remote.create_topic(NS, "t")
    try:
        yield remote
    finally:
        await remote.close()


async def stored_bodies(remote: RemoteStorage, topic: str = "t") -> list[bytes]:
    read = await remote.read(q(topic), 0, max_messages=10 * BURST, wait_ms=0)
    return [m.message.body for m in read.messages]


async def test_a_burst_goes_as_two_calls_in_order(node: StorageNode, remote: RemoteStorage) -> None:
    """Of appends made in one loop iteration (a gather) the first goes alone, the
    others as one call."""
    before = node.requests_served
    bodies = [b"m%d" % i for i in range(BURST)]
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(remote.append(request(b)) for b in bodies))
    assert node.requests_served - before == 2
    assert [r[0].placements[0].offset for r in results] == list(range(BURST))
    assert await stored_bodies(remote) == bodies


async def test_one_callers_error_is_its_own(node: StorageNode, remote: RemoteStorage) -> None:
    """A request to a missing topic merged with valid ones: it alone fails, each valid
    message is stored once, in the order made."""
    calls = [request(b"first")]
    calls += [request(b"m%d" % i) for i in range(5)]
    calls.append(request(b"lost", topic="missing"))
    calls += [request(b"n%d" % i) for i in range(5)]
    async with asyncio.timeout(30):
        answers = await asyncio.gather(*(remote.append(c) for c in calls), return_exceptions=True)
    assert isinstance(answers[6], errors.TopicNotFound)
    assert all(
        isinstance(a, list) and isinstance(a[0], AppendResult)
        for i, a in enumerate(answers)
        if i != 6
    )
    expected = [c[0].entry.body for i, c in enumerate(calls) if i != 6]  # type: ignore[union-attr]
    assert await stored_bodies(remote) == expected


async def test_transient_and_durable_appends_go_in_separate_calls(
    node: StorageNode, remote: RemoteStorage
) -> None:
    """Durable, durable, durable, transient, transient, durable made together: the first
    alone, then three calls (a transient message does not wait for a durable one's
    fsync)."""
    kinds = [True, True, True, False, False, True]
    before = node.requests_served
    async with asyncio.timeout(30):
        await asyncio.gather(
            *(remote.append(request(b"m%d" % i, durable=d)) for i, d in enumerate(kinds))
        )
    assert node.requests_served - before == 4
    assert await stored_bodies(remote) == [b"m%d" % i for i in range(len(kinds))]


async def test_a_cancelled_queued_append_is_not_stored(remote: RemoteStorage) -> None:
    first = asyncio.ensure_future(remote.append(request(b"first")))
    queued = asyncio.ensure_future(remote.append(request(b"cancelled")))
    await asyncio.sleep(0)  # both made in this iteration: the first sent, the other queued
    queued.cancel()
    async with asyncio.timeout(30):
        await first
        with pytest.raises(asyncio.CancelledError):
            await queued
        await remote.append(request(b"after"))
    assert await stored_bodies(remote) == [b"first", b"after"]


async def test_a_node_lost_fails_every_queued_caller(
    node: StorageNode, remote: RemoteStorage
) -> None:
    """Merged callers whose node goes away get StorageUnavailable, none hangs."""
    await remote.append(request(b"warm"))  # connected
    calls = [asyncio.ensure_future(remote.append(request(b"m%d" % i))) for i in range(10)]
    await asyncio.sleep(0)
    await node.close()
    async with asyncio.timeout(30):
        answers = await asyncio.gather(*calls, return_exceptions=True)
    for answer in answers:
        assert isinstance(answer, list | errors.StorageUnavailable)
    assert any(isinstance(a, errors.StorageUnavailable) for a in answers)
