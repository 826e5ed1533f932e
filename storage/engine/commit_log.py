"""The commit log: segment files of framed records, appended with group commit.

A record on disk is ``u32 length | u32 crc32c(payload) | payload``. Positions are
global byte offsets: segment files are named by the position of their first byte and
follow each other without gaps, so a position finds its segment by bisection.

Group commit: callers reserve records (a position is assigned at once, on the event
loop), and one flusher task writes everything reserved so far with a single ``pwrite``
per segment, on the loop, and asks the fsync thread (fsync_thread.py) to make it
durable. While one fsync runs, the next groups are written and their requests gather
into the next fsync, which starts as soon as the running one ends; a group is never
held back to wait for company, so a lone record is flushed at once. The loop hears
once per completed fsync, runs the callbacks of what it covers and reports the new
durable position. With ``async`` durability the flusher writes without fsync and a
timer fsyncs.

A record reserved with ``durable=False`` (a transient message, a hand-out nobody
waits on) does not ask for an fsync: a group made only of such records is written,
reported (its callbacks run, so readers see it) and fsynced by the next group that
needs one or by a timer ``flush_interval_ms`` later. The log stays a prefix: an fsync
covers every byte written before it, so a crash of the machine can only take back a
tail of records nobody was promised durability for, and a crash of the process none.

With ``visible_before_fsync`` (the default) a durable record is reported once written
too: its callbacks run (a consumer may get the message) while its fsync runs, and only
:meth:`wait_durable` - the publisher's confirm, the producer's answer - waits for the
fsync, as RabbitMQ's classic queues do. The fsync's latency and its stalls then leave
the consumer's path. A power loss may take back a message a consumer already got,
but only with everything after it in the log (its hand-out and ack records), and never
one whose append was answered. Off, a durable record is reported once fsynced.

Recovery scans from a known-good position and cuts the log at the first record whose
frame or CRC is wrong: a torn tail from a crash is removed, never surfaced.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import logging
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import crc32c

from polymq.storage.engine.config import Durability
from polymq.storage.engine.files import fsync_directory
from polymq.storage.engine.fsync_thread import FsyncThread
from polymq.storage.engine.stats import LogStats
from polymq.storage.errors import StorageClosed, StorageError, StorageFailed, StorageUnavailable
from polymq.storage.lifecycle import stop_task

__all__ = ["HEADER_SIZE", "CommitLog"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
HEADER_SIZE = _HEADER.size
_NAME_DIGITS = 20


class _Segment:
    __slots__ = ("base", "fd", "path", "size")

    def __init__(self, base: int, path: Path, fd: int, size: int) -> None:
        self.base = base
        self.path = path
        self.fd = fd
        self.size = size

    @property
    def end(self) -> int:
        return self.base + self.size


_Batch = list[tuple[_Segment, bytes, Callable[[], None] | None]]


class _Group:
    """A written group of records whose callbacks have not run yet."""

    __slots__ = ("batch", "end", "fsync", "since")

    def __init__(self, end: int, batch: _Batch, fsync: bool, since: float) -> None:
        self.end = end
        self.batch = batch
        self.fsync = fsync  # reported once durable (else once written)
        self.since = since  # when its first record was reserved (stats.commit)


class CommitLog:
    """Append-only log with group commit. Not thread-safe: call from the event loop."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int,
        durability: Durability,
        flush_interval_ms: int,
        visible_before_fsync: bool = True,
    ) -> None:
        self._dir = directory
        # Durable records reported (readable) once written, not once fsynced.
        self._visible_before_fsync = visible_before_fsync
        # Durable groups reported before their fsync: (end, since), for stats.commit.
        self._awaiting_fsync: deque[tuple[int, float]] = deque()
        self._segment_bytes = segment_bytes
        self._durability = durability
        self._flush_interval_ms = flush_interval_ms
        self._segments: list[_Segment] = []
        self._bases: list[int] = []
        self._reserved_end = 0  # next position to hand out
        self._durable_end = 0  # what callers were told is safe
        self._written_end = 0  # written to the file (page cache), maybe not yet fsynced
        self._written_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._reported_end = 0  # written and its callbacks run: readers see it
        self._reported_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._pending: _Batch = []
        self._unreported: deque[_Group] = deque()  # written, callbacks not run yet
        self._requested_end = 0  # asked of the fsync thread
        self._pending_durable = False  # a pending record asked for an fsync
        self._sync_due = False  # the timer for written-only records fired
        self._sync_timer: asyncio.TimerHandle | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._sync = durability is Durability.SYNC
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start_flushing
        # A log that replicates nothing flushes from a loop callback (_flush_now);
        # one that does needs a task (_flush_loop) to await each group's copy.
        self._inline = type(self)._replicate is CommitLog._replicate
        self._flush_handle: asyncio.Handle | None = None  # _flush_now, when scheduled
        self._flusher_stopped = False
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._fsyncer: FsyncThread[_Segment] | None = None
        self._synced_generation = 0
        self._generation_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._failed: BaseException | None = None
        self._failure: StorageError | None = None  # what callers get once failed
        self._closed = False
        self._dir_dirty = False
        self._unsynced: set[_Segment] = set()  # async durability: written, not fsynced
        # For /metrics (stats.py): observed per group and per fsync, never per append.
        self.stats = LogStats()
        self._group_since = 0.0  # when the first record of the pending group was queued

    # -- opening and recovery -----------------------------------------------------

    def open(self) -> None:
        """Open the segment files (reads work from here on; appends after recover())."""
        self._dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self._dir.glob("*.log")):
            base = int(path.stem)
            fd = os.open(path, os.O_RDWR)
            self._add_segment(_Segment(base, path, fd, os.fstat(fd).st_size))
        # Segments must follow each other; anything after a gap is unreachable.
        for i in range(1, len(self._segments)):
            if self._segments[i].base != self._segments[i - 1].end:
                log.error(
                    "commit log gap before %s: dropping it and later segments",
                    self._segments[i].path,
                )
                self._drop_segments_from(i)
                break

    def recover(self, start: int) -> Iterator[tuple[int, bytes]]:
        """Yield ``(position, payload)`` for every valid record at or after ``start``
        and cut the log after the last valid one."""
        end = self._segments[-1].end if self._segments else start
        if self._segments and start < self._segments[0].base:
            start = self._segments[0].base
        if start > end:
            log.error("checkpoint position %d is past the log end %d", start, end)
            start = end
        good_end = start
        index = self._segment_index(start) if self._segments else -1
        while 0 <= index < len(self._segments):
            segment = self._segments[index]
            local = max(start, segment.base) - segment.base
            torn_at: int | None = None
            if segment.size > local:
                with mmap.mmap(segment.fd, segment.size, access=mmap.ACCESS_READ) as view:
                    buf = memoryview(view)
                    try:
                        while local < segment.size:
                            payload = _frame_at(buf, local, segment.size)
                            if payload is None:
                                torn_at = local
                                break
                            size = len(payload)
                            # A copy: a view would pin the mapping past its close.
                            yield segment.base + local, bytes(payload)
                            local += HEADER_SIZE + size
                            del payload
                    finally:
                        buf.release()
            if torn_at is not None:
                log.warning(
                    "commit log: cutting torn tail of %s at byte %d (%d bytes dropped)",
                    segment.path.name,
                    torn_at,
                    segment.size - torn_at,
                )
                os.ftruncate(segment.fd, torn_at)
                os.fsync(segment.fd)
                segment.size = torn_at
                self._drop_segments_from(index + 1)
                good_end = segment.end
                break
            good_end = segment.end
            index += 1
        if not self._segments:
            self._create_segment(good_end)
        self._reserved_end = self._durable_end = self._written_end = good_end
        self._requested_end = good_end
        self._reported_end = good_end

    def _segment_index(self, position: int) -> int:
        return max(0, bisect.bisect_right(self._bases, position) - 1)

    def _add_segment(self, segment: _Segment) -> None:
        self._segments.append(segment)
        self._bases.append(segment.base)

    def _drop_segments_from(self, index: int) -> None:
        for segment in self._segments[index:]:
            os.close(segment.fd)
            segment.path.unlink(missing_ok=True)
        del self._segments[index:]
        del self._bases[index:]
        self._fsync_dir()

    def _segment_path(self, base: int) -> Path:
        """Segment files are named by the position of their first byte."""
        return self._dir / f"{base:0{_NAME_DIGITS}d}.log"

    def _create_segment(self, base: int) -> _Segment:
        path = self._segment_path(base)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        segment = _Segment(base, path, fd, 0)
        self._add_segment(segment)
        self._dir_dirty = True
        return segment

    def _fsync_dir(self) -> None:
        fsync_directory(self._dir)

    # -- positions ----------------------------------------------------------------

    @property
    def start(self) -> int:
        return self._segments[0].base

    @property
    def end(self) -> int:
        """Next position to be reserved."""
        return self._reserved_end

    @property
    def durable_end(self) -> int:
        return self._durable_end

    @property
    def failed(self) -> bool:
        """Stopped after a write error (or, replicated, a lost shard): no more writes."""
        return self._failure is not None

    # -- appending ----------------------------------------------------------------

    # -- the hooks of a replicated log (storage.replicated.log), no-ops here --------

    async def prepare(self) -> None:
        """Before :meth:`open`: make the directory hold the log to recover (a
        replicated log fetches its copy)."""

    async def seal(self) -> None:
        """After recovery, before the first append: claim the log for this writer."""

    async def _replicate(self, start: int, frames: list[bytes]) -> None:
        """Make the records written at ``start`` durable elsewhere too; a record is
        reported durable only once this returned."""

    async def checkpointed(self, directory: Path, names: list[str], position: int) -> None:
        """A checkpoint at ``position`` was written: ``names`` (relative to
        ``directory``) are its files."""

    def start_flushing(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._fsyncer = FsyncThread(loop, self._sync_segments, self._synced)
        if not self._inline:
            self._flusher = loop.create_task(self._flush_loop(), name="polymq-commit-log-flusher")
        if self._pending:  # reserved before the flusher ran
            self._kick()
        if self._durability is Durability.ASYNC:
            self._syncer = loop.create_task(self._sync_loop(), name="polymq-commit-log-syncer")

    def reserve(
        self,
        payload: bytes,
        on_durable: Callable[[], None] | None = None,
        *,
        durable: bool = True,
    ) -> int:
        """Queue one record; return its position. ``on_durable`` runs (on the loop, in
        log order) once the record is durable, before any waiter is woken; for a record
        reserved with ``durable=False``, or for any record when the log was opened with
        ``visible_before_fsync``, once it is written and every record before it was
        reported (it is fsynced with the next durable group or within
        ``flush_interval_ms``; a durable record's waiters still wait for that fsync)."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StorageClosed("storage is closed")
        size = HEADER_SIZE + len(payload)
        segment = self._segments[-1]
        position = self._reserved_end
        if position > segment.base and position - segment.base + size > self._segment_bytes:
            segment = self._create_segment(position)
        frame = _HEADER.pack(len(payload), crc32c.crc32c(payload)) + payload
        if not self._pending:  # the first of a group: when its wait starts (stats.commit)
            self._group_since = time.perf_counter()
        self._pending.append((segment, frame, on_durable))
        if durable:
            self._pending_durable = True
        self._reserved_end = position + size
        self._kick()
        return position

    async def wait_durable(self, end: int | None = None) -> None:
        """Wait until everything reserved before ``end`` (default: now) is durable."""
        target = self._reserved_end if end is None else end
        if self._durable_end >= target:
            return
        if self._failure is not None:
            raise self._failure
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        if self._durability is Durability.SYNC and target > self._requested_end:
            self._sync_due = True  # written-only records below ``target``: fsync now
            self._kick()
        await future

    async def wait_written(self, end: int | None = None) -> None:
        """Wait until everything reserved before ``end`` (default: now) is written to
        its file: it survives a crash of the process, and of the machine only once
        durable (with the group commit that follows). Without fsync (``async``
        durability) written and durable are the same."""
        target = self._reserved_end if end is None else end
        if self._durability is not Durability.SYNC:
            await self.wait_durable(target)
            return
        if self._written_end >= target or self._durable_end >= target:
            return
        if self._failure is not None:
            raise self._failure
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._written_waiters.append((target, future))
        await future

    async def wait_reported(self, end: int | None = None) -> None:
        """Wait until everything reserved before ``end`` (default: now) is written
        and its ``on_durable`` callbacks ran (a message is readable): what a
        ``durable=False`` append waits for. Never before those callbacks, unlike
        :meth:`wait_written`, which may return between the write and the fsync."""
        target = self._reserved_end if end is None else end
        if self._reported_end >= target:
            return
        if self._flush_handle is not None:
            # The group is written now rather than by the callback an iteration later:
            # the caller (a transient publish waiting to confirm) goes on without a
            # suspension, and the loop without the iteration that would resume it.
            self._flush_handle.cancel()
            self._flush_now()
            if self._reported_end >= target:
                return
        if self._failure is not None:
            raise self._failure
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reported_waiters.append((target, future))
        await future

    def _mark_written(self, end: int) -> None:
        """Everything before ``end`` is in its file: wake who waits for that."""
        self._written_end = max(self._written_end, end)
        if self._written_waiters:
            self._written_waiters = _wake(self._written_waiters, self._written_end)

    def _kick(self) -> None:
        """Have the flusher look at the pending records in this loop iteration."""
        if self._loop is None or not self._inline:
            self._wakeup.set()
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        """The flusher of a log that replicates nothing: a callback scheduled once
        per loop iteration that has pending records (cheaper than waking a task for
        every group: no event future, no task step)."""
        self._flush_handle = None
        if self._failure is not None or self._flusher_stopped:
            return
        while self._pending or (self._sync and self._sync_due):
            group = self._take_group()
            try:
                if group[0]:
                    self._write(group[0])
            except BaseException as exc:  # a disk error: stop, never acknowledge
                log.critical("commit log write failed, refusing further writes: %r", exc)
                self._fail(exc)
                return
            self._written(*group)

    async def _flush_loop(self) -> None:
        """The flusher of a log that replicates (``_replicate`` overridden): a task,
        since each group awaits its replication before it is reported."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending or (self._sync and self._sync_due):
                group = self._take_group()
                batch = group[0]
                try:
                    if batch:
                        start = self._written_end
                        self._write(batch)
                        await self._replicate(start, [frame for _, frame, _ in batch])
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # a disk error: stop, never acknowledge
                    log.critical("commit log write failed, refusing further writes: %r", exc)
                    self._fail(exc)
                    return
                self._written(*group)

    def _take_group(self) -> tuple[_Batch, float, int, bool]:
        """The pending records as one group: (batch, since, end, durable)."""
        batch, self._pending = self._pending, []
        durable, self._pending_durable = self._pending_durable, False
        return batch, self._group_since, self._reserved_end, durable

    def _written(self, batch: _Batch, since: float, end: int, durable: bool) -> None:
        """A group was written (and replicated): report it (``async`` durability, or
        a group nobody needs fsynced) or ask the fsync thread to make it durable.
        Groups are written while an earlier group's fsync runs, so a hand-out or an
        ack (written only) never waits behind a publish's fsync; callbacks still run
        in log order (:meth:`_report`)."""
        self.stats.records += len(batch)
        self._mark_written(end)
        if not self._sync:  # written is durable here (fsynced by the interval)
            if batch:
                self._unreported.append(_Group(end, batch, False, since))
            self._durable_end = end
            self._report()
            self._wake_waiters()
            return
        # Records nobody waits to be fsynced: written now, fsynced later.
        fsync = durable or self._sync_due
        if batch:
            if fsync and self._visible_before_fsync:
                # Readable now; wait_durable still waits for the fsync asked below.
                self._unreported.append(_Group(end, batch, False, since))
                self._awaiting_fsync.append((end, since))
            else:
                self._unreported.append(_Group(end, batch, fsync, since))
        if fsync:
            self._request_sync(end)
        elif self._sync_timer is None and end > self._requested_end:
            assert self._loop is not None
            self._sync_timer = self._loop.call_later(
                self._flush_interval_ms / 1000, self._sync_later
            )
        self._report()

    def _request_sync(self, end: int) -> None:
        """Ask the fsync thread for everything written so far (``end``), with every
        segment written since the last fsync, so an fsync covers every byte before it
        and the log stays a prefix."""
        self._sync_due = False
        if self._sync_timer is not None:
            self._sync_timer.cancel()
            self._sync_timer = None
        if end <= self._requested_end and not self._dir_dirty:
            return  # an fsync asked for already covers it
        self._requested_end = max(self._requested_end, end)
        new_dir_entry, self._dir_dirty = self._dir_dirty, False
        assert self._fsyncer is not None
        self._fsyncer.request(self._take_unsynced(), new_dir_entry, end)

    def _synced(self, generation: int, end: int, error: BaseException | None) -> None:
        """On the loop, once per completed fsync: ``end`` is durable."""
        if error is not None:
            if self._failure is None:
                log.critical("commit log fsync failed, refusing further writes: %r", error)
                self._fail(error)
            return
        self._synced_generation = generation
        if self._durability is Durability.SYNC and end > self._durable_end:
            self._durable_end = end
            if self._awaiting_fsync:
                self._observe_commits(end)
            self._report()  # callbacks first: a waiter woken sees its records
            self._wake_waiters()
        if self._generation_waiters:
            self._generation_waiters = _wake(self._generation_waiters, generation)

    def _observe_commits(self, durable_end: int) -> None:
        """Durable groups reported before their fsync: their commit time ends now."""
        awaiting = self._awaiting_fsync
        now = time.perf_counter()
        while awaiting and awaiting[0][0] <= durable_end:
            self.stats.commit.observe(now - awaiting.popleft()[1])

    def _report(self) -> None:
        """Run the callbacks of the written groups that may be reported, in log
        order: a group that asked for an fsync once it is durable, one that did not
        once every group before it was reported."""
        unreported = self._unreported
        durable_end = self._durable_end
        stats = self.stats
        while unreported:
            group = unreported[0]
            if group.fsync and group.end > durable_end:
                break
            unreported.popleft()
            for _, _, callback in group.batch:
                if callback is not None:
                    try:
                        callback()
                    except Exception:  # our bug: keep acknowledging the others
                        log.exception("commit log: a durability callback failed")
            self._reported_end = group.end
            if group.fsync or self._durability is not Durability.SYNC:
                stats.commit.observe(time.perf_counter() - group.since)
        if self._reported_waiters:
            self._reported_waiters = _wake(self._reported_waiters, self._reported_end)

    def _sync_later(self) -> None:
        """The timer of written-only records: fsync them now."""
        self._sync_timer = None
        self._sync_due = True
        self._kick()

    def _write(self, batch: list[tuple[_Segment, bytes, Callable[[], None] | None]]) -> None:
        """Write ``batch`` (on the loop); its segments wait for the next fsync."""
        chunks: list[bytes] = []
        current: _Segment | None = None
        for segment, frame, _ in batch:
            if segment is not current:
                if current is not None:
                    self._write_chunks(current, chunks)
                current, chunks = segment, []
            chunks.append(frame)
        if current is not None:
            self._write_chunks(current, chunks)

    def _sync_segments(self, segments: list[_Segment], directory: bool) -> None:
        """In the fsync thread: fsync ``segments`` and, for a new segment's name, the
        directory. A segment deleted by retention meanwhile is skipped."""
        for segment in segments:
            fd = segment.fd
            if fd < 0:
                continue
            try:
                self._fdatasync(fd)
            except OSError as exc:
                if exc.errno == errno.EBADF and segment.fd < 0:
                    continue  # closed by retention while queued: nothing to keep
                raise
        if directory:
            self._fsync_dir()

    def _fdatasync(self, fd: int) -> None:
        """``fdatasync``, timed (in the fsync thread, the only one that fsyncs)."""
        began = time.perf_counter()
        os.fdatasync(fd)
        self.stats.fsync.observe(time.perf_counter() - began)

    def _write_chunks(self, segment: _Segment, chunks: list[bytes]) -> None:
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.stats.bytes += len(data)
        self._unsynced.add(segment)
        written = os.pwrite(segment.fd, data, segment.size)
        segment.size += written
        if written < len(data):  # short write (rare): write the rest
            view = memoryview(data)[written:]
            while view:
                written = os.pwrite(segment.fd, view, segment.size)
                segment.size += written
                view = view[written:]

    async def _sync_loop(self) -> None:
        """``async`` durability: fsync what was written, every interval."""
        while True:
            await asyncio.sleep(self._flush_interval_ms / 1000)
            with contextlib.suppress(StorageError):  # failed: _synced logged it
                await self._sync_all()

    async def _sync_all(self) -> None:
        """Fsync every segment written so far and the directory, in the thread."""
        if self._failure is not None:
            raise self._failure
        if self._fsyncer is None:  # never started: nothing runs beside us
            self._sync_segments(self._take_unsynced(), True)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._dir_dirty = False
        end = self._written_end
        self._requested_end = max(self._requested_end, end)
        generation = self._fsyncer.request(self._take_unsynced(), True, end)
        self._generation_waiters.append((generation, future))
        await future

    def _take_unsynced(self) -> list[_Segment]:
        """Segments written since the last fsync (taken on the loop, synced in a thread)."""
        segments = list(self._unsynced)
        self._unsynced.clear()
        return segments

    async def fsync(self) -> None:
        """Force everything written so far to disk (used before a checkpoint)."""
        await self.wait_durable()
        await self._sync_all()

    def _wake_waiters(self) -> None:
        self._waiters = _wake(self._waiters, self._durable_end)

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        # A lost shard is retryable elsewhere; a disk error is not.
        error: StorageError = (
            exc
            if isinstance(exc, StorageUnavailable)
            else StorageFailed(f"commit log write failed: {exc!r}")
        )
        self._failure = error
        waiting = (
            *self._waiters,
            *self._written_waiters,
            *self._reported_waiters,
            *self._generation_waiters,
        )
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)
        self._waiters = []
        self._generation_waiters = []
        self._written_waiters = []
        self._reported_waiters = []

    # -- reading ------------------------------------------------------------------

    def read(self, position: int, size: int) -> bytes:
        """The payload of the record at ``position`` whose framed size is ``size``."""
        segment = self._segments[self._segment_index(position)]
        if position < segment.base or position + size > segment.end:
            raise ValueError(f"position {position} is not in the log")
        data = os.pread(segment.fd, size, position - segment.base)
        return data[HEADER_SIZE:]

    def read_many(self, records: list[tuple[int, int]], *, max_gap: int = 4096) -> list[memoryview]:
        """Payloads of ``(position, framed size)`` records given in position order.
        Neighbours in one segment (gaps up to ``max_gap``) share one system call."""
        payloads: list[memoryview] = []
        i = 0
        while i < len(records):
            start, size = records[i]
            segment = self._segments[self._segment_index(start)]
            j, end = i + 1, start + size
            while j < len(records):
                position, next_size = records[j]
                if not 0 <= position - end <= max_gap or position + next_size > segment.end:
                    break
                end = position + next_size
                j += 1
            if start < segment.base or end > segment.end:
                raise ValueError(f"position {start} is not in the log")
            view = memoryview(os.pread(segment.fd, end - start, start - segment.base))
            for position, record_size in records[i:j]:
                local = position - start
                payloads.append(view[local + HEADER_SIZE : local + record_size])
            i = j
        return payloads

    # -- retention ----------------------------------------------------------------

    def segment_stats(self) -> list[tuple[int, int, float]]:
        """``(base, size, mtime)`` of each segment, oldest first."""
        return [(s.base, s.size, os.fstat(s.fd).st_mtime) for s in self._segments]

    def delete_segments_below(self, position: int) -> int:
        """Delete whole segments that end at or before ``position``, never the active
        one. Returns the new log start."""
        count = 0
        while count < len(self._segments) - 1 and self._segments[count].end <= position:
            count += 1
        for segment in self._segments[:count]:
            self._unsynced.discard(segment)
            os.close(segment.fd)
            segment.fd = -1
            segment.path.unlink(missing_ok=True)
            log.info("retention: deleted segment %s", segment.path.name)
        del self._segments[:count]
        del self._bases[:count]
        if count:
            self._fsync_dir()
        return self._segments[0].base

    # -- closing ------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        if self._failed is None:
            with contextlib.suppress(StorageFailed):
                await self.fsync()
        self._closed = True
        self._flusher_stopped = True
        if self._sync_timer is not None:
            self._sync_timer.cancel()
        for task in (self._flusher, self._syncer):
            if task is not None:
                await stop_task(task)  # a replicating flusher may swallow one cancel
        if self._fsyncer is not None:
            self._fsyncer.stop()
        for segment in self._segments:
            os.close(segment.fd)
        self._segments.clear()
        self._bases.clear()


def _wake(
    waiters: list[tuple[int, asyncio.Future[None]]], reached: int
) -> list[tuple[int, asyncio.Future[None]]]:
    """Resolve the waiters whose target position is reached; return the others."""
    remaining = []
    for target, future in waiters:
        if target <= reached:
            if not future.done():
                future.set_result(None)
        else:
            remaining.append((target, future))
    return remaining


def _frame_at(buf: memoryview, local: int, limit: int) -> memoryview | None:
    """The payload framed at ``local``, or ``None`` if the frame is torn or corrupt."""
    if local + HEADER_SIZE > limit:
        return None
    length, crc = _HEADER.unpack_from(buf, local)
    start = local + HEADER_SIZE
    if length == 0 or start + length > limit:
        return None
    payload = buf[start : start + length]
    if crc32c.crc32c(payload) != crc:
        return None
    return payload
