"""The commit log's fsync thread (storage/engine/fsync_thread.py): groups are written
on the loop while an fsync runs, what was asked meanwhile shares the next fsync, a
durable record is reported only after its fsync, and a failed fsync fails the log.

Each test holds ``os.fdatasync`` in the fsync thread to look at what happens
meanwhile; waits are bounded by ``WAIT_S``, never timed."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.config import Durability
from polymq.storage.errors import StorageFailed
from tests.held_fsync import HeldFsync

WAIT_S = 30.0  # a bound on waiting for a condition, never a measured time


@contextlib.asynccontextmanager
async def _log(tmp_path: Path, *, visible_before_fsync: bool = True) -> AsyncIterator[CommitLog]:
    log = CommitLog(
        tmp_path / "log",
        segment_bytes=1 << 20,
        durability=Durability.SYNC,
        flush_interval_ms=600_000,  # no timer's fsync within a test
        visible_before_fsync=visible_before_fsync,
    )
    log.open()
    for _ in log.recover(0):
        pass
    log.start_flushing()
    try:
        yield log
    finally:
        await log.close()


def _note(order: list[str], name: str) -> Callable[[], None]:
    return lambda: order.append(name)


async def test_a_durable_record_is_reported_only_after_its_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``visible_before_fsync`` off."""
    async with _log(tmp_path, visible_before_fsync=False) as log:
        fsync = HeldFsync(monkeypatch)
        order: list[str] = []
        log.reserve(b"d", _note(order, "d"))
        end = log.end
        durable = asyncio.create_task(log.wait_durable(end))
        await fsync.wait_entered()
        await asyncio.wait_for(log.wait_written(end), WAIT_S)  # in the file already
        await asyncio.sleep(0)
        assert not durable.done() and order == [] and log.durable_end < end
        fsync.released.set()
        await asyncio.wait_for(durable, WAIT_S)
        assert order == ["d"] and log.durable_end >= end


async def test_written_only_records_are_written_while_an_fsync_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-out or an ack (written only) does not wait behind a publish's fsync;
    its callback still runs after the durable record's before it (log order), which
    with ``visible_before_fsync`` off waits for that fsync."""
    async with _log(tmp_path, visible_before_fsync=False) as log:
        fsync = HeldFsync(monkeypatch)
        order: list[str] = []
        log.reserve(b"durable", _note(order, "durable"))
        await fsync.wait_entered()
        log.reserve(b"hand-out", _note(order, "hand-out"), durable=False)
        await asyncio.wait_for(log.wait_written(), WAIT_S)  # while the fsync is held
        reported = asyncio.create_task(log.wait_reported())
        await asyncio.sleep(0)
        assert order == [] and not reported.done()  # not before the durable one
        fsync.released.set()
        await asyncio.wait_for(reported, WAIT_S)
        assert order == ["durable", "hand-out"]


async def test_a_durable_record_is_visible_before_its_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``visible_before_fsync`` (the default): a durable record's callback (what
    makes a message readable) and a written-only record's after it run while the
    fsync is held, in log order; only the durable waiter waits for the fsync."""
    async with _log(tmp_path) as log:
        fsync = HeldFsync(monkeypatch)
        order: list[str] = []
        log.reserve(b"d", _note(order, "d"))
        end = log.end
        durable = asyncio.create_task(log.wait_durable(end))
        await fsync.wait_entered()
        log.reserve(b"hand-out", _note(order, "hand-out"), durable=False)
        await asyncio.wait_for(log.wait_reported(), WAIT_S)  # while the fsync is held
        assert order == ["d", "hand-out"]
        await asyncio.sleep(0)
        assert not durable.done() and log.durable_end < end
        assert log.stats.commit.snapshot().count == 0  # a commit ends at its fsync
        fsync.released.set()
        await asyncio.wait_for(durable, WAIT_S)
        assert log.durable_end >= end
        assert log.stats.commit.snapshot().count == 1


async def test_what_is_asked_during_an_fsync_shares_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _log(tmp_path) as log:
        fsync = HeldFsync(monkeypatch)
        log.reserve(b"first")
        first = asyncio.create_task(log.wait_durable())
        await fsync.wait_entered()
        waits = []
        for i in range(5):  # five groups, each written and asked for on its own
            log.reserve(b"later %d" % i)
            await asyncio.wait_for(log.wait_written(), WAIT_S)
            waits.append(asyncio.create_task(log.wait_durable()))
        fsync.released.set()
        await asyncio.wait_for(asyncio.gather(first, *waits), WAIT_S)
        assert fsync.calls == 2  # the held one, then one for all five


async def test_a_failed_fsync_fails_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _log(tmp_path) as log:

        def broken(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", broken)
        log.reserve(b"lost")
        with pytest.raises(StorageFailed):
            await asyncio.wait_for(log.wait_durable(), WAIT_S)
        with pytest.raises(StorageFailed):
            log.reserve(b"refused")
