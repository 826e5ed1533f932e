"""The commit log's records that ask for no fsync (``reserve(durable=False)``): written
and reported at once, fsynced by the flush-interval timer, by the next record that
asks for one, or at once for whoever waits for durability. (What a power loss then
keeps: tests/storage/test_durability_powerloss.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from polymq.storage.engine import Engine
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.config import Durability
from polymq.storage.model import AppendRequest, Message, QueueRef

WAIT_S = 30.0  # a bound on waiting for a condition, never a measured time


@contextlib.asynccontextmanager
async def _log(tmp_path: Path, flush_interval_ms: int) -> AsyncIterator[CommitLog]:
    log = CommitLog(
        tmp_path / "log",
        segment_bytes=1 << 20,
        durability=Durability.SYNC,
        flush_interval_ms=flush_interval_ms,
    )
    log.open()
    for _ in log.recover(0):
        pass
    log.start_flushing()
    try:
        yield log
    finally:
        await log.close()


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.01)


async def test_written_only_record_is_reported_then_fsynced_by_the_timer(
    tmp_path: Path,
) -> None:
    async with _log(tmp_path, flush_interval_ms=50) as log:
        reported: list[int] = []
        log.reserve(b"transient", lambda: reported.append(1), durable=False)
        end = log.end
        await asyncio.wait_for(log.wait_written(), WAIT_S)
        assert reported == [1]  # readable once written
        await _until(lambda: log.durable_end >= end)  # the timer's fsync


async def test_waiting_for_durability_fsyncs_written_records_at_once(tmp_path: Path) -> None:
    async with _log(tmp_path, flush_interval_ms=600_000) as log:
        log.reserve(b"transient", durable=False)
        await asyncio.wait_for(log.wait_written(), WAIT_S)
        assert log.durable_end < log.end  # not fsynced: no timer within the test
        await asyncio.wait_for(log.wait_durable(), WAIT_S)
        assert log.durable_end == log.end


async def test_waiting_for_a_written_only_record_writes_it_without_yielding(
    tmp_path: Path,
) -> None:
    """The waiter writes the group itself: no loop iteration between the reserve and
    the record being readable (a transient publish confirms in the same step)."""
    async with _log(tmp_path, flush_interval_ms=600_000) as log:
        reported: list[int] = []
        turns: list[int] = []
        asyncio.get_running_loop().call_soon(turns.append, 1)  # runs at the next turn
        log.reserve(b"transient", lambda: reported.append(1), durable=False)
        await log.wait_reported()
        assert reported == [1]
        assert turns == []  # the loop never got a turn: nothing was awaited
        await asyncio.sleep(0)  # the flusher's cancelled callback writes nothing twice
        assert turns == [1] and reported == [1]


async def test_a_durable_record_covers_the_written_ones_before_it(tmp_path: Path) -> None:
    async with _log(tmp_path, flush_interval_ms=600_000) as log:
        order: list[str] = []
        log.reserve(b"a", lambda: order.append("a"), durable=False)
        await asyncio.wait_for(log.wait_written(), WAIT_S)
        log.reserve(b"b", lambda: order.append("b"), durable=False)
        log.reserve(b"c", lambda: order.append("c"))
        await asyncio.wait_for(log.wait_durable(), WAIT_S)
        assert order == ["a", "b", "c"]  # reported in log order
        assert log.durable_end == log.end


async def test_a_non_durable_append_returns_readable_beside_a_durable_one(
    storage: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both appends land in one group, which needs an fsync (held here): the
    non-durable one must not return before its message is readable, which is after
    that fsync, even though its bytes were written before it."""
    await storage.create_topic("default", "t")
    ref = QueueRef("default", "t", 0)
    held, real = threading.Event(), os.fdatasync

    def fdatasync(fd: int) -> None:
        held.wait(WAIT_S)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)

    def request(body: bytes, durable: bool) -> list[AppendRequest]:
        return [AppendRequest(entry=Message(body=body), queues=(ref,), durable=durable)]

    durable = asyncio.create_task(storage.append(request(b"d", True)))
    transient = asyncio.create_task(storage.append(request(b"n", False)))
    done, _ = await asyncio.wait([durable, transient], timeout=0.2)
    for task in done:  # returned while the fsync is held: must be readable already
        [result] = await task
        [placement] = result.placements
        read = await storage.read(ref, placement.offset, max_messages=1, wait_ms=0)
        assert [m.offset for m in read.messages] == [placement.offset]
    held.set()
    await asyncio.wait_for(asyncio.gather(durable, transient), WAIT_S)


async def test_a_non_durable_ack_returns_without_waiting_for_an_fsync(
    storage: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AMQP's ``basic.ack`` has no reply: its ack is written, not waited on for its
    fsync (held here until the end), and fsynced with the next group commit."""
    await storage.create_topic("default", "t")
    ref = QueueRef("default", "t", 0)
    await storage.append([AppendRequest(entry=Message(body=b"m"), queues=(ref,))])
    [popped] = await storage.pop("default", "g", [ref], invisible_ms=60_000)
    held, real = threading.Event(), os.fdatasync

    def fdatasync(fd: int) -> None:
        held.wait(WAIT_S)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    try:
        await asyncio.wait_for(
            storage.ack("default", "g", popped.receipt or "", durable=False), WAIT_S / 3
        )
        assert await storage.inflight_count("default", "g", ref) == 0
    finally:
        held.set()
