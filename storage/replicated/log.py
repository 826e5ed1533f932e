"""The engine's commit log kept in a JetStream stream (one stream per shard).

The local segment files stay, as the engine's cache of the log: reads go to them by
position, as they do without replication. What changes is when a record is durable:
once JetStream acknowledged the group-commit batch that carries it (a quorum of the
stream's replicas has it), not when the local disk has it. So the local files are
never fsynced for durability, and they are never trusted across an ownership change:
a node that takes a shard (or takes it back) rebuilds its directory from the
replicated checkpoint and the stream, then recovers from it as after a restart.

Fencing: :meth:`seal` claims the stream for the new owner's epoch before it serves;
from then on a deposed owner's appends fail, the log stops (``StorageFailed``), and
``on_lost`` tells the shard's host to stop serving the shard.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.config import Durability
from polymq.storage.errors import ShardMoved
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.stream import ShardStream

__all__ = ["Claim", "ReplicatedLog"]

log = logging.getLogger(__name__)
# Purge points are kept about this far apart (at most, and a quarter segment at most):
# a purge keeps up to this much more than retention asked, and the list stays short
# however many batches are published.
_PURGE_STEP_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Claim:
    """What a writer holds once it owns the shard: its stream, where checkpoints go,
    and the epoch of its lease."""

    stream: ShardStream
    checkpoints: CheckpointStore
    epoch: int


class ReplicatedLog(CommitLog):
    """``claim`` is awaited first thing at start (:meth:`prepare`): it returns once
    this process owns the shard (a standby waits there)."""

    def __init__(
        self,
        directory: Path,
        *,
        claim: Callable[[], Awaitable[Claim]],
        segment_bytes: int,
        flush_interval_ms: int,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # Local writes need no fsync: the stream is the durable copy.
        super().__init__(
            directory,
            segment_bytes=segment_bytes,
            durability=Durability.ASYNC,
            flush_interval_ms=flush_interval_ms,
        )
        self._claim = claim
        self._on_close = on_close
        self._held: Claim | None = None
        # (position, seq) of each message that starts at a record: where a purge may cut
        self._starts: list[tuple[int, int]] = []
        self._purges: set[asyncio.Task[None]] = set()
        self._purge_step = min(_PURGE_STEP_BYTES, max(1, segment_bytes // 4))

    @property
    def claimed(self) -> Claim:
        if self._held is None:
            raise RuntimeError("the replicated log is not started")
        return self._held

    @property
    def stream(self) -> ShardStream:
        return self.claimed.stream

    @property
    def epoch(self) -> int:
        return self.claimed.epoch

    @property
    def shard(self) -> str:
        return self.stream.shard

    def lose(self, reason: BaseException) -> None:
        """The lease is gone (its keeper noticed): refuse every further write."""
        if self._failure is None:
            log.error("shard %s: %s; no longer writing it", self.shard, reason)
            self._fail(reason if isinstance(reason, ShardMoved) else ShardMoved(str(reason)))

    # -- taking the shard ---------------------------------------------------------

    async def prepare(self) -> None:
        """Own the shard, then rebuild the data directory (the log's parent) from
        the replicated checkpoint and the stream."""
        self._held = await self._claim()
        data_dir = self._dir.parent
        if data_dir.exists():
            shutil.rmtree(data_dir)
        data_dir.mkdir(parents=True)
        meta = await self.claimed.checkpoints.get(self.shard, data_dir)
        if meta is None:
            (data_dir / "node_id").write_text(_node_id(self.shard))
        self._dir.mkdir(parents=True, exist_ok=True)
        count = await self._rebuild()
        log.info(
            "shard %s: rebuilt from %s (%d stream messages, checkpoint at %s)",
            self.shard,
            self.stream.name,
            count,
            None if meta is None else meta.get("position"),
        )

    async def _rebuild(self) -> int:
        """Write the stream's bytes into local segments at their positions."""
        segment: tuple[int, Path] | None = None
        handle = None
        size = 0
        count = 0
        try:
            async for message in self.stream.replay():
                count += 1
                if segment is None:
                    if message.continued:
                        continue  # the tail of a record purged below
                    segment = (message.position, self._segment_path(message.position))
                    handle = open(segment[1], "wb")  # noqa: SIM115 (closed in finally)
                    size = 0
                assert handle is not None
                base = segment[0]
                end = base + size
                if message.position < end:  # the unacknowledged chunks of a dead writer
                    if message.position < base:
                        raise RuntimeError(
                            f"shard {self.shard}: stream message {message.seq} goes back "
                            f"to {message.position}, before segment {base}"
                        )
                    handle.truncate(message.position - base)
                    handle.seek(message.position - base)
                    size = message.position - base
                    while self._starts and self._starts[-1][0] >= message.position:
                        self._starts.pop()
                elif message.position > end:
                    raise RuntimeError(
                        f"shard {self.shard}: gap in the stream before message "
                        f"{message.seq} (position {message.position}, expected {end})"
                    )
                if not message.continued and size >= self._segment_bytes and message.data:
                    handle.close()
                    segment = (message.position, self._segment_path(message.position))
                    handle = open(segment[1], "wb")  # noqa: SIM115
                    size = 0
                if message.data:
                    handle.write(message.data)
                    size += len(message.data)
                if not message.continued:
                    self._note_start(message.position, message.seq)
        finally:
            if handle is not None:
                handle.close()
        return count

    async def seal(self) -> None:
        await self.stream.seal(self.end, self.epoch)

    # -- appending ----------------------------------------------------------------

    async def _replicate(self, start: int, frames: list[bytes]) -> None:
        try:
            sent = await self.stream.publish(start, b"".join(frames))
        except ShardMoved as exc:
            log.error("%s", exc)
            raise
        for position, seq, continued in sent:
            if not continued:
                self._note_start(position, seq)

    def _note_start(self, position: int, seq: int) -> None:
        if not self._starts or position - self._starts[-1][0] >= self._purge_step:
            self._starts.append((position, seq))

    # -- checkpoints and retention ------------------------------------------------

    async def checkpointed(self, directory: Path, names: list[str], position: int) -> None:
        if self._failure is not None:  # deposed: the shard's checkpoints are not ours
            return
        await self.claimed.checkpoints.put(
            self.shard,
            self.epoch,
            directory,
            names,
            {"position": position, "seq": self.stream.last_seq},
        )

    def delete_segments_below(self, position: int) -> int:
        start = super().delete_segments_below(position)
        if self._failure is not None:  # deposed: the stream is not ours to purge
            return start
        keep = None
        while len(self._starts) > 1 and self._starts[1][0] <= start:
            self._starts.pop(0)
        if self._starts and self._starts[0][0] <= start:
            keep = self._starts[0][1]
        if keep is not None:
            task = asyncio.get_running_loop().create_task(self._purge(keep))
            self._purges.add(task)
            task.add_done_callback(self._purges.discard)
        return start

    async def _purge(self, seq: int) -> None:
        try:
            await self.stream.purge_below(seq)
        except Exception as exc:  # the next retention pass purges again
            log.warning("shard %s: stream purge below %d failed: %r", self.shard, seq, exc)

    async def close(self) -> None:
        await super().close()
        for task in list(self._purges):
            task.cancel()
        if self._on_close is not None:
            await self._on_close()


def _node_id(shard: str) -> str:
    """The shard's node id (part of its message ids): the same on every owner."""
    return hashlib.sha256(shard.encode()).digest()[:6].hex()
