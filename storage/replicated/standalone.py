"""The merged form over the replicated log (``polymq run --storage nats://…``): one
engine, one shard, whose data survives losing the machine. A second server started
with the same URL waits in :meth:`Engine.start` as a standby until the lease is free
(the first one died, or stopped), then takes over from the stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from polymq.storage.clock import Clock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.replicated.config import ReplicationConfig
from polymq.storage.replicated.log import Claim, ReplicatedLog
from polymq.storage.replicated.pool import Held, NatsPool

__all__ = ["standalone_engine"]


def standalone_engine(
    replication: ReplicationConfig,
    shard: str,
    config: EngineConfig,
    *,
    owner: str,
    clock: Clock | None = None,
    on_lost: Callable[[BaseException], None] | None = None,
) -> Engine:
    """An engine (not started) whose log is ``shard``'s stream; ``config.data_dir`` is
    only its local cache. ``on_lost`` runs once the lease is lost (the server then
    has nothing left to serve: the composition root stops it)."""
    pool = NatsPool(replication, owner)
    held: list[Held] = []
    logs: list[ReplicatedLog] = []

    async def claim() -> Claim:
        await pool.connect()
        taken = await pool.wait_claim(shard)

        def lost(error: BaseException) -> None:
            logs[0].lose(error)
            if on_lost is not None:
                on_lost(error)

        taken.keeper.on_lost = lost
        taken.keeper.start()
        held.append(taken)
        return taken.claim

    async def release() -> None:
        if held:
            await held[0].keeper.stop(release=True)
        await pool.close()

    def make_log(directory: Path) -> CommitLog:
        log = ReplicatedLog(
            directory,
            claim=claim,
            segment_bytes=config.segment_bytes,
            flush_interval_ms=config.flush_interval_ms,
            on_close=release,
        )
        logs.append(log)
        return log

    return Engine(config, clock=clock, log=make_log)
