"""What a queue consumer can ask about a queue's state: how far a pop group has acked
(``consumed_below``) and how many delayed messages wait to enter it
(``delayed_count``), live and after a reopen (from a checkpoint, or from the log as a
crash leaves it)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from polymq.storage import errors
from polymq.storage.clock import ManualClock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.model import AppendRequest, Message, QueueRef, TopicConfig
from tests.storage.conftest import EngineFactory

NS = "default"
Q = QueueRef(NS, "t", 0)


async def put(storage: Engine, *bodies: bytes, queue: QueueRef = Q) -> None:
    await storage.append([AppendRequest(entry=Message(body=b), queues=(queue,)) for b in bodies])


async def put_delayed(storage: Engine, clock: ManualClock, delay_ms: int, *queues: QueueRef) -> str:
    message = Message(body=b"later", delivery_time_ms=clock.now_ms() + delay_ms)
    [result] = await storage.append([AppendRequest(entry=message, queues=queues or (Q,))])
    return result.message_id


async def until_latest(storage: Engine, queue: QueueRef, latest: int) -> None:
    async with asyncio.timeout(10):
        while (await storage.queue_offsets(queue)).latest < latest:
            await asyncio.sleep(0.001)


# -- consumed_below ------------------------------------------------------------------


async def test_consumed_below_follows_the_acked_prefix(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a", b"b", b"c", b"d")
    assert await storage.consumed_below(NS, "g", Q) == 0  # no cursor yet
    popped = await storage.pop(NS, "g", [Q], max_messages=4)
    receipts = {m.offset: m.receipt or "" for m in popped}
    assert await storage.consumed_below(NS, "g", Q) == 0  # in flight is not consumed
    await storage.ack(NS, "g", receipts[1])
    assert await storage.consumed_below(NS, "g", Q) == 0  # a hole at 0
    await storage.ack(NS, "g", receipts[0])
    assert await storage.consumed_below(NS, "g", Q) == 2
    await storage.ack_many(NS, "g", [receipts[3], receipts[2]])
    assert await storage.consumed_below(NS, "g", Q) == 4
    assert await storage.consumed_below(NS, "other", Q) == 0  # per group


async def test_consumed_below_is_at_least_the_queue_start(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a", b"b", b"c")
    await storage.delete_records(Q, 2)
    assert await storage.consumed_below(NS, "g", Q) == 2  # no cursor: the earliest
    [m] = await storage.pop(NS, "g", [Q])
    assert m.offset == 2
    assert await storage.consumed_below(NS, "g", Q) == 2
    await storage.ack(NS, "g", m.receipt or "")
    assert await storage.consumed_below(NS, "g", Q) == 3


async def test_consumed_below_checks_the_queue_and_namespace(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    with pytest.raises(errors.TopicNotFound):
        await storage.consumed_below(NS, "g", QueueRef(NS, "missing", 0))
    with pytest.raises(errors.QueueNotFound):
        await storage.consumed_below(NS, "g", QueueRef(NS, "t", 3))
    with pytest.raises(errors.InvalidArgument):
        await storage.consumed_below("elsewhere", "g", Q)


async def test_consumed_below_survives_reopen_and_crash(
    make_engine: EngineFactory, engine_config: EngineConfig, tmp_path: Path
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await put(storage, b"a", b"b", b"c")
        popped = await storage.pop(NS, "g", [Q], max_messages=3)
        await storage.checkpoint()
        await storage.ack_many(NS, "g", [popped[0].receipt or "", popped[1].receipt or ""])
        # The files as a crash leaves them: the acks are only in the log.
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")
    async with make_engine() as storage:
        assert await storage.consumed_below(NS, "g", Q) == 2
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        assert await storage.consumed_below(NS, "g", Q) == 2


# -- delayed_count -------------------------------------------------------------------


async def test_delayed_count_counts_until_due(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    assert await storage.delayed_count(NS, Q) == 0
    await put_delayed(storage, clock, 5000)
    await put_delayed(storage, clock, 10_000)
    await put(storage, b"now")
    assert await storage.delayed_count(NS, Q) == 2
    clock.advance(5000)
    await until_latest(storage, Q, 2)
    assert await storage.delayed_count(NS, Q) == 1
    clock.advance(5000)
    await until_latest(storage, Q, 3)
    assert await storage.delayed_count(NS, Q) == 0


async def test_delayed_count_per_queue_and_cancel(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t", TopicConfig(queue_count=2))
    other = QueueRef(NS, "t", 1)
    both = await put_delayed(storage, clock, 5000, Q, other)
    await put_delayed(storage, clock, 5000, other)
    assert (await storage.delayed_count(NS, Q), await storage.delayed_count(NS, other)) == (1, 2)
    assert await storage.cancel_delayed(NS, both)
    assert (await storage.delayed_count(NS, Q), await storage.delayed_count(NS, other)) == (0, 1)
    with pytest.raises(errors.InvalidArgument):
        await storage.delayed_count("elsewhere", Q)


async def test_delayed_count_survives_reopen_and_crash(
    make_engine: EngineFactory, engine_config: EngineConfig, tmp_path: Path, clock: ManualClock
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        cancelled = await put_delayed(storage, clock, 5000)
        await put_delayed(storage, clock, 5000)
        await storage.checkpoint()  # both held in the checkpoint
        await put_delayed(storage, clock, 20_000)  # only in the log
        assert await storage.cancel_delayed(NS, cancelled)  # a resolve in the log
        assert await storage.delayed_count(NS, Q) == 2
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")
    async with make_engine() as storage:
        assert await storage.delayed_count(NS, Q) == 2
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        assert await storage.delayed_count(NS, Q) == 2
        clock.advance(5000)
        await until_latest(storage, Q, 1)
        assert await storage.delayed_count(NS, Q) == 1
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        assert await storage.delayed_count(NS, Q) == 1  # the delivery was logged too
