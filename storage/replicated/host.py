"""A storage process of the replicated pool (``polymq storage --nats …``): it serves
whichever shards it holds the lease of, each as a storage node of its own.

A shard served here is a :class:`StorageNode` whose node id is the shard's name, on a
port of its own, so nameservers and gateways route to shards exactly as they route to
unreplicated nodes: when a shard moves, its node id reappears at another address with
a higher epoch (the nameserver keeps the newest), and gateways follow the route.

Every quarter of the lease time the host says it is alive (with the shards it
prefers), renews what it holds, hands a shard back to the node that prefers it once
that node is alive again, and takes free shards: its preferred ones at once, others
only when no live node prefers them (their node died, and its lease expired).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from polymq.storage.clock import Clock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.lifecycle import Service
from polymq.storage.node import StorageNode
from polymq.storage.replicated.log import Claim, ReplicatedLog
from polymq.storage.replicated.pool import Held, NatsPool

__all__ = ["ShardHost"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 60.0
# A shard given up in good order lets the calls it is running finish (a JetStream
# publish: milliseconds) and refuses new ones unrun, so no client sees a write that
# took effect fail; long polls are cut at once.
_HAND_OVER_GRACE_S = 2.0
_FIRST_TICK_S = 30.0  # as the pool's wait for JetStream to answer at all
NodeFactory = Callable[[Engine, str, int], StorageNode]  # engine, shard, epoch


@dataclass(slots=True)
class _Served:
    node: StorageNode
    held: Held
    log: ReplicatedLog


class ShardHost(Service):
    def __init__(
        self,
        pool: NatsPool,
        *,
        shards: Sequence[str],
        prefer: Sequence[str],
        engine_config: Callable[[str], EngineConfig],
        node: NodeFactory,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.shards = tuple(shards)
        self.prefer = tuple(prefer)
        self._engine_config = engine_config
        self._node = node
        self._clock = clock
        self.served: dict[str, _Served] = {}
        self._changed = asyncio.Event()
        self._foreign_after = 0.0
        self._closing = False
        pool.stats.shards = len(self.shards)

    @property
    def name(self) -> str:
        return self.pool.owner

    async def start(self) -> None:
        await self.pool.connect()
        # Others' shards only after a lease time: nodes starting side by side first
        # announce themselves, so nobody takes a shard only to hand it back at once.
        self._foreign_after = asyncio.get_running_loop().time() + self.pool.config.lease_ms / 1000
        await self._first_tick()  # its own shards, before saying it is ready
        self.tasks.spawn(self._loop(), name="polymq-shard-host")

    async def _first_tick(self) -> None:
        """The first placement step, retried for a while: the buckets of a pool that
        has just been created answer "no responders" until JetStream has elected
        their leaders, and a storage process that exited then was only restarted
        into the same race (seen when three processes start side by side)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FIRST_TICK_S
        while True:
            try:
                await self._tick()
                return
            except Exception as exc:
                if loop.time() > deadline:
                    raise
                log.info("shard host %s: placement not possible yet: %r", self.name, exc)
            await asyncio.sleep(0.25)

    async def close(self) -> None:
        # The flag, not only the cancel, ends the loop: a placement step's NATS call
        # may swallow the cancel (see lifecycle.stop_task), and the step, which may be
        # handing a shard back, is not cut short again.
        self._closing = True
        await super().close()
        for shard in list(self.served):
            await self._drop(shard, release=True)
        await self.pool.close()

    async def _loop(self) -> None:
        interval = self.pool.config.lease_ms / 4000
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._changed.wait()
            self._changed.clear()
            try:
                await self._tick()
            except Exception:  # NATS unreachable for a moment: the next tick retries
                log.exception("shard host %s: placement step failed", self.name)

    async def _tick(self) -> None:
        leases = self.pool.leases
        await leases.announce(self.name, list(self.prefer))
        for shard, served in list(self.served.items()):
            if served.held.keeper.lost:
                await self._drop(shard, release=False)
            elif served.log.failed:  # JetStream refused or failed a write: start over
                log.warning("shard %s: its log stopped; taking it again from the stream", shard)
                await self._drop(shard, release=True)
        preferences = await leases.preferences()
        preferred_elsewhere = {
            shard for node, shards in preferences.items() if node != self.name for shard in shards
        }
        for shard in list(self.served):
            if shard not in self.prefer and shard in preferred_elsewhere:
                log.info("shard %s: handing it back to the node that prefers it", shard)
                await self._drop(shard, release=True)
        foreign = asyncio.get_running_loop().time() >= self._foreign_after
        order = [*self.prefer, *(s for s in self.shards if s not in self.prefer and foreign)]
        for shard in order:
            if shard in self.served or (shard not in self.prefer and shard in preferred_elsewhere):
                continue
            claiming = time.perf_counter()
            held = await self.pool.try_claim(shard)
            if held is not None:
                await self._serve(shard, held, claiming)

    async def _serve(self, shard: str, held: Held, claiming: float) -> None:
        """Serve ``shard`` (its lease won by a claim begun at ``claiming``)."""
        made: list[ReplicatedLog] = []

        async def claim() -> Claim:
            return held.claim

        def make_log(directory: Path) -> CommitLog:
            config = self._engine_config(shard)
            replicated = ReplicatedLog(
                directory,
                claim=claim,
                segment_bytes=config.segment_bytes,
                flush_interval_ms=config.flush_interval_ms,
            )
            made.append(replicated)
            return replicated

        engine = Engine(self._engine_config(shard), clock=self._clock, log=make_log)
        node = self._node(engine, shard, held.claim.epoch)
        keeper = held.keeper

        def lost(error: BaseException) -> None:
            made[0].lose(error)
            self._changed.set()  # the loop drops it at once

        keeper.on_lost = lost
        keeper.start()
        try:
            await node.start()
        except Exception:
            log.exception("shard %s: could not take it over", shard)
            await keeper.stop(release=True)
            return
        self.served[shard] = _Served(node, held, made[0])
        self.pool.stats.took_over(shard, time.perf_counter() - claiming)
        log.info("shard %s: serving it (epoch %d) at %s:%d", shard, held.claim.epoch, *node.address)

    async def _drop(self, shard: str, *, release: bool) -> None:
        served = self.served.pop(shard)
        self.pool.stats.owned.discard(shard)
        try:
            # Closing checkpoints (bounded calls to NATS); a hand-over must not wait
            # for ever on one, the stream has every acknowledged record anyway.
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await served.node.close(grace=_HAND_OVER_GRACE_S if release else 0.0)
        except TimeoutError:
            log.error("shard %s: closing took over %.0f s; giving it up", shard, _CLOSE_TIMEOUT_S)
            served.log.lose(TimeoutError("closing timed out"))
        except Exception as exc:
            log.exception("shard %s: closing failed; giving it up", shard)
            served.log.lose(exc)
        finally:
            # Whatever the close did: a lease still renewed here would keep the shard
            # from every other node while nobody serves it.
            await served.held.keeper.stop(release=release)
        log.info("shard %s: no longer served here", shard)
