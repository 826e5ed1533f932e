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
from collections.abc import Callable
from pathlib import Path

from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.config import Durability
from polymq.storage.errors import ShardMoved
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.stream import ShardStream

__all__ = ["ReplicatedLog"]

log = logging.getLogger(__name__)
_NAME_DIGITS = 20
# Purge points are kept about this far apart (at most, and a quarter segment at most):
# a purge keeps up to this much more than retention asked, and the list stays short
# however many batches are published.
_PURGE_STEP_BYTES = 1 << 20


class ReplicatedLog(CommitLog):
    def __init__(
        self,
        directory: Path,
        *,
        stream: ShardStream,
        checkpoints: CheckpointStore,
        epoch: int,
        segment_bytes: int,
        flush_interval_ms: int,
        on_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        # Local writes need no fsync: the stream is the durable copy.
        super().__init__(
            directory,
            segment_bytes=segment_bytes,
            durability=Durability.ASYNC,
            flush_interval_ms=flush_interval_ms,
        )
        self.stream = stream
        self.checkpoints = checkpoints
        self.epoch = epoch
        self._on_lost = on_lost
        # (position, seq) of each message that starts at a record: where a purge may cut
        self._starts: list[tuple[int, int]] = []
        self._purges: set[asyncio.Task[None]] = set()
        self._purge_step = min(_PURGE_STEP_BYTES, max(1, segment_bytes // 4))

    @property
    def shard(self) -> str:
        return self.stream.shard

    # -- taking the shard ---------------------------------------------------------

    async def prepare(self) -> None:
        """Rebuild the data directory (the parent of the log's) from the stream."""
        data_dir = self._dir.parent
        if data_dir.exists():
            shutil.rmtree(data_dir)
        data_dir.mkdir(parents=True)
        meta = await self.checkpoints.get(self.shard, data_dir)
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

    def _segment_path(self, base: int) -> Path:
        return self._dir / f"{base:0{_NAME_DIGITS}d}.log"

    async def seal(self) -> None:
        await self.stream.seal(self.end, self.epoch)

    # -- appending ----------------------------------------------------------------

    async def _replicate(self, start: int, frames: list[bytes]) -> None:
        try:
            sent = await self.stream.publish(start, b"".join(frames))
        except ShardMoved as exc:
            log.error("%s", exc)
            if self._on_lost is not None:
                self._on_lost(exc)
            raise
        for position, seq, continued in sent:
            if not continued:
                self._note_start(position, seq)

    def _note_start(self, position: int, seq: int) -> None:
        if not self._starts or position - self._starts[-1][0] >= self._purge_step:
            self._starts.append((position, seq))

    # -- checkpoints and retention ------------------------------------------------

    async def checkpointed(self, directory: Path, names: list[str], position: int) -> None:
        await self.checkpoints.put(
            self.shard, directory, names, {"position": position, "seq": self.stream.last_seq}
        )

    def delete_segments_below(self, position: int) -> int:
        start = super().delete_segments_below(position)
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


def _node_id(shard: str) -> str:
    """The shard's node id (part of its message ids): the same on every owner."""
    return hashlib.sha256(shard.encode()).digest()[:6].hex()
