"""The engine's chores: checkpoints (which bound a restart's replay) and retention
(which bounds the disk).

Both run from one background loop and hold the maintenance lock, so that a checkpoint
never describes segments that retention is deleting, nor a compaction's half-done copies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polymq.storage.engine.config import Durability
from polymq.storage.engine.core import EngineCore, EnginePart
from polymq.storage.engine.files import fsync_directory
from polymq.storage.engine.queue_index import ENTRY_SIZE, QueueIndex, write_index_file
from polymq.storage.engine.snapshot import (
    remove_stale,
    write_json_lines,
    write_lines,
    write_snapshot,
)
from polymq.storage.engine.state import QueueKey
from polymq.storage.lifecycle import end_if_cancelled
from polymq.storage.model import UNLIMITED

__all__ = ["Maintenance", "apply_topic_retention"]

log = logging.getLogger(__name__)

# (queue, path, data, new persisted end, file base, append)
_IndexWrite = tuple[QueueIndex, Path, bytes, int, int, bool]


class Maintenance(EnginePart):
    """Checkpoints and retention of one engine. ``forget_decoded`` is called when
    segments are deleted, since cached decoded records may name their positions."""

    def __init__(self, core: EngineCore, forget_decoded: Callable[[], None]) -> None:
        super().__init__(core)
        self._forget_decoded = forget_decoded

    async def loop(self) -> None:
        config = self._core.config
        interval = 1.0
        since_retention = 0.0
        since_checkpoint = 0.0
        while True:
            end_if_cancelled()  # a checkpoint's NATS call may drop the engine's cancel
            await asyncio.sleep(interval)
            since_retention += interval
            since_checkpoint += interval
            try:
                grown = self._log.end - self._core.checkpoint_position
                if grown > 0 and (
                    since_checkpoint * 1000 >= config.checkpoint_interval_ms
                    or grown >= config.checkpoint_log_bytes
                ):
                    since_checkpoint = 0.0
                    await self.checkpoint()
                if since_retention * 1000 >= config.retention_check_interval_ms:
                    since_retention = 0.0
                    await self.enforce_retention()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("storage maintenance failed; will retry")

    # ------------------------------------------------------------------ checkpoints

    async def checkpoint(self) -> int:
        """Persist indexes and state at the current log end; returns that position."""
        core = self._core
        core.check_open()
        async with core.maintenance_lock:
            # The slow parts, built before writers are held; under the gate only what
            # changed in between is rebuilt.
            self._state.topics_snapshot()
            self._state.cursor_snapshot_lines()
            core.gate.clear()
            try:
                await self._log.wait_durable()
                if core.config.durability is Durability.ASYNC:
                    await self._log.fsync()
                position = self._log.end
                state = self._state.snapshot_state(position)
                topics_version = self._state.topics_version
                topics = None
                if self._state.topics_file != (topics_version, state["topics_file"]):
                    topics = self._state.topics_snapshot()
                cursor_lines = self._state.cursor_snapshot_lines()
                dirty, self._state.dirty_queues = self._state.dirty_queues, set()
                writes = self._index_writes(dirty)
                dead = set(self._state.dead_topic_ids)
            finally:
                core.gate.set()
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(
                    None, self._write_checkpoint, writes, state, dead, topics, cursor_lines
                )
            except BaseException:
                self._state.dirty_queues |= dirty  # the next checkpoint writes them again
                raise
            for queue, end, base in ((w[0], w[3], w[4]) for w in writes):
                queue.persisted_end = max(queue.persisted_end, end)
                queue.file_base = base if queue.file_base is None else queue.file_base
            self._state.dead_topic_ids -= dead
            self._state.topics_file = (topics_version, state["topics_file"])
            names = ["node_id", "checkpoint.json", state["topics_file"], state["cursors_file"]]
            names += sorted(f"index/{path.name}" for path in core.index_dir.glob("*.idx"))
            await self._log.checkpointed(core.dir, names, position)
            core.checkpoint_position = position
            return position

    def _index_writes(self, dirty: set[QueueKey]) -> list[_IndexWrite]:
        """(queue, path, data, new persisted end, file base, append) for the queues
        that got entries (or need their file rewritten) since the last checkpoint."""
        writes = []
        for tid, qid in dirty:
            topic = self._state.topics_by_id.get(tid)
            if topic is None:
                continue  # deleted since
            queue = topic.queues[qid]
            if queue.end == queue.persisted_end and queue.file_base is not None:
                continue
            if queue.end == queue.base and queue.file_base is None:
                continue
            path = self._core.index_dir / f"{topic.id}-{qid}.idx"
            can_append = (
                queue.file_base is not None
                and queue.persisted_end >= queue.base
                and queue.base - queue.file_base < (1 << 20)
            )
            if can_append:
                begin = (queue.persisted_end - queue.base) * ENTRY_SIZE
                data = bytes(queue.entries[begin:])
                writes.append((queue, path, data, queue.end, queue.file_base or 0, True))
            else:
                queue.file_base = None
                writes.append((queue, path, bytes(queue.entries), queue.end, queue.base, False))
        return writes

    def _write_checkpoint(
        self,
        writes: list[_IndexWrite],
        state: dict[str, Any],
        dead_topic_ids: set[int],
        topics: list[Any] | None,
        cursor_lines: list[str],
    ) -> None:
        """Runs in a worker thread: everything the snapshot relies on first."""
        directory, index_dir = self._core.dir, self._core.index_dir
        for _, path, data, _, base, append in writes:
            write_index_file(path, base, data, append=append)
        if writes:  # new and renamed index files must be on disk before the snapshot
            fsync_directory(index_dir)
        if topics is not None:
            write_json_lines(directory, state["topics_file"], topics)
        write_lines(directory, state["cursors_file"], cursor_lines)
        write_snapshot(directory, state)
        remove_stale(directory, "topics-*.jsonl", keep=state["topics_file"])
        remove_stale(directory, "cursors-*.jsonl", keep=state["cursors_file"])
        for tid in dead_topic_ids:
            for path in index_dir.glob(f"{tid}-*.idx"):
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ retention

    async def enforce_retention(self) -> None:
        """Delete whole segments past the retention time or size, never one that
        recovery or a held (delayed, half) message still needs; then move queue starts
        and apply per-topic retention."""
        core = self._core
        config = core.config
        core.check_open()
        async with core.maintenance_lock:
            now_s = core.now() / 1000
            limit = min([core.checkpoint_position, *self._state.held, *self._kept_positions()])
            stats = self._log.segment_stats()
            total = sum(size for _, size, _ in stats)
            delete_below = 0
            for base, size, mtime in stats[:-1]:
                if base + size > limit:
                    break
                too_old = mtime < now_s - config.retention_ms / 1000
                too_big = config.retention_bytes is not None and total > config.retention_bytes
                if not (too_old or too_big):
                    break
                delete_below = base + size
                total -= size
            if delete_below:
                start = self._log.delete_segments_below(delete_below)
                self._forget_decoded()
                for topic in self._state.topics.values():
                    for queue in topic.queues:
                        queue.trim_to(queue.first_offset_where("position", start))
            apply_topic_retention(core)

    def _kept_positions(self) -> Iterator[int]:
        """The first log position each queue of an unlimited-retention topic still needs."""
        for topic in self._state.topics.values():
            if topic.keeps_everything():
                for queue in topic.queues:
                    if queue.earliest < queue.end:
                        yield queue.position(queue.earliest)


def apply_topic_retention(core: EngineCore) -> None:
    """Move each queue's start past what its topic's retention no longer keeps (the
    records themselves go with their segments)."""
    now = core.now()
    for topic in core.state.topics.values():
        retention_ms, retention_bytes = topic.config.retention_ms, topic.config.retention_bytes
        for queue in topic.queues:
            if retention_ms is not None and retention_ms != UNLIMITED:
                first = queue.first_offset_where("store_ms", now - retention_ms)
                queue.earliest = max(queue.earliest, first)
            if retention_bytes is not None and retention_bytes != UNLIMITED:
                queue.earliest = max(queue.earliest, _first_within_bytes(queue, retention_bytes))


def _first_within_bytes(queue: QueueIndex, limit: int) -> int:
    """The first offset such that the records from there to the end fit in ``limit``."""
    total = 0
    offset = queue.end
    last_position = -1
    while offset > queue.earliest:
        entry = queue.get(offset - 1)
        if entry.position != last_position:  # a batch's offsets share one record
            total += entry.size
            last_position = entry.position
        if total > limit:
            return offset
        offset -= 1
    return offset
