"""A shard: one engine whose commit log is the shard's JetStream stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nats.js import JetStreamContext

from polymq.storage.clock import Clock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.log import ReplicatedLog
from polymq.storage.replicated.stream import DEFAULT_CHUNK_BYTES, ShardStream

__all__ = ["shard_engine"]


async def shard_engine(
    js: JetStreamContext,
    shard: str,
    config: EngineConfig,
    *,
    replicas: int,
    epoch: int,
    clock: Clock | None = None,
    on_lost: Callable[[BaseException], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Engine:
    """The engine of ``shard`` for the owner of lease ``epoch`` (not started: its start
    rebuilds ``config.data_dir`` from the stream and seals the stream)."""
    stream = ShardStream(js, shard, replicas=replicas, chunk_bytes=chunk_bytes)
    await stream.ensure()
    checkpoints = CheckpointStore(js, replicas=replicas)

    def make_log(directory: Path) -> CommitLog:
        return ReplicatedLog(
            directory,
            stream=stream,
            checkpoints=checkpoints,
            epoch=epoch,
            segment_bytes=config.segment_bytes,
            flush_interval_ms=config.flush_interval_ms,
            on_lost=on_lost,
        )

    return Engine(config, clock=clock, log=make_log)
