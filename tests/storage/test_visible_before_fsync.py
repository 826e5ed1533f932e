"""Durable messages readable once written (``EngineConfig.visible_before_fsync``, the
default): a consumer gets a durable message while its append still waits for the
fsync, and a power loss (the log cut back to what was fsynced) takes such a message
back only together with every record after it - its hand-out and its ack - never a
message whose append was answered.

The fsync thread's ``fdatasync`` is held to look at the engine meanwhile; waits are
bounded by ``WAIT_S``, never timed. (The same with a real server and real clients:
tests/storage/test_durability_powerloss.py.)"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from polymq.storage.engine import Engine
from polymq.storage.model import AppendRequest, AppendResult, Message, QueueRef, StoredMessage
from tests.held_fsync import HeldFsync

from .conftest import EngineFactory

WAIT_S = 30.0  # a bound on waiting for a condition, never a measured time
NS = "default"
GROUP = "g"


def _append(ref: QueueRef, body: bytes) -> list[AppendRequest]:
    return [AppendRequest(entry=Message(body=body), queues=(ref,))]


async def _pop(engine: Engine, ref: QueueRef, wait_ms: int) -> list[StoredMessage]:
    """What an AMQP consumer does: a hand-out nobody waits to be fsynced."""
    return await engine.pop(
        NS, GROUP, [ref], max_messages=10, invisible_ms=600_000, wait_ms=wait_ms, durable=False
    )


async def _start_held_append(
    engine: Engine, ref: QueueRef, held_fsync: HeldFsync
) -> asyncio.Task[list[AppendResult]]:
    """'first' appended and answered (fsynced), then 'second' whose fsync is held."""
    await engine.append(_append(ref, b"first"))
    held_fsync.armed.set()
    second = asyncio.create_task(engine.append(_append(ref, b"second")))
    await held_fsync.wait_entered()
    return second


async def test_a_consumer_gets_a_durable_message_before_its_fsync(
    make_engine: EngineFactory, held_fsync: HeldFsync
) -> None:
    async with make_engine() as engine:
        await engine.create_topic(NS, "t")
        ref = QueueRef(NS, "t", 0)
        second = await _start_held_append(engine, ref, held_fsync)
        got = await asyncio.wait_for(_pop(engine, ref, wait_ms=0), WAIT_S)
        assert [m.message.body for m in got] == [b"first", b"second"]
        assert not second.done()  # the publisher's confirm still waits for the fsync
        held_fsync.released.set()
        await asyncio.wait_for(second, WAIT_S)


async def test_with_the_option_off_a_durable_message_waits_for_its_fsync(
    make_engine: EngineFactory, held_fsync: HeldFsync
) -> None:
    async with make_engine(visible_before_fsync=False) as engine:
        await engine.create_topic(NS, "t")
        ref = QueueRef(NS, "t", 0)
        second = await _start_held_append(engine, ref, held_fsync)
        got = await asyncio.wait_for(_pop(engine, ref, wait_ms=0), WAIT_S)
        assert [m.message.body for m in got] == [b"first"]
        waiting = asyncio.create_task(_pop(engine, ref, wait_ms=int(WAIT_S * 1000)))
        held_fsync.released.set()  # the fsync ends: the message becomes readable
        await asyncio.wait_for(second, WAIT_S)
        later = await asyncio.wait_for(waiting, WAIT_S)
        assert [m.message.body for m in later] == [b"second"]


def _power_loss(data_dir: Path, durable_end: int, copy: Path) -> None:
    """A copy of ``data_dir`` as a power loss could leave it: every commit-log
    segment cut back to the fsynced position (the worst case: nothing unfsynced
    reached the disk)."""
    shutil.copytree(data_dir, copy)
    for segment in (copy / "commitlog").glob("*.log"):
        base = int(segment.stem)
        keep = max(0, durable_end - base)
        if segment.stat().st_size > keep:
            os.truncate(segment, keep)


async def test_a_power_loss_takes_back_a_consumed_unanswered_message_with_its_ack(
    make_engine: EngineFactory, held_fsync: HeldFsync, tmp_path: Path
) -> None:
    """'first' is answered; 'second' is handed out and acked (both written only)
    while its own append waits for the held fsync. Cut back to the fsynced prefix:
    'first' is there (handed out again: its ack was after the cut too), 'second',
    never answered, is gone with its hand-out and ack, and its offset is free for
    the next message, which a consumer gets (no stale ack of that offset survived)."""
    copy = tmp_path / "after-power-loss"
    async with make_engine() as engine:
        await engine.create_topic(NS, "t")
        ref = QueueRef(NS, "t", 0)
        second = await _start_held_append(engine, ref, held_fsync)
        got = await asyncio.wait_for(_pop(engine, ref, wait_ms=0), WAIT_S)
        assert [m.message.body for m in got] == [b"first", b"second"]
        receipts = [m.receipt or "" for m in got]
        assert await engine.ack_many(NS, GROUP, receipts, durable=False) == [None, None]
        assert not second.done()
        durable_end = engine._log.durable_end  # 'first' and before: fsynced
        assert durable_end < engine._log.end
        _power_loss(engine.config.data_dir, durable_end, copy)
        held_fsync.released.set()
        await asyncio.wait_for(second, WAIT_S)

    async with make_engine(data_dir=copy) as engine:
        ref = QueueRef(NS, "t", 0)
        offsets = await engine.queue_offsets(ref)
        assert offsets.latest == 1  # 'first' only
        again = await asyncio.wait_for(_pop(engine, ref, wait_ms=0), WAIT_S)
        assert [(m.offset, m.message.body) for m in again] == [(0, b"first")]
        [result] = await engine.append(_append(ref, b"third"))
        assert [p.offset for p in result.placements] == [1]  # 'second''s offset, reused
        third = await asyncio.wait_for(_pop(engine, ref, wait_ms=0), WAIT_S)
        assert [(m.offset, m.message.body) for m in third] == [(1, b"third")]
