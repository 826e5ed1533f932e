"""Holding one shard's lease: acquiring it (or waiting for it, as a standby does),
renewing it, and telling the shard's log the moment it is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from polymq.storage.errors import ShardMoved
from polymq.storage.lifecycle import stop_task
from polymq.storage.replicated.leases import Lease, LeaseStore
from polymq.storage.replicated.stats import ReplicationStats

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews ``lease`` five times per time to live until :meth:`stop`; calls
    ``on_lost`` once a renewal is refused (the owner was stopped, or cut off from NATS,
    for longer than the lease, and the key expired or was taken)."""

    def __init__(
        self,
        store: LeaseStore,
        lease: Lease,
        on_lost: Callable[[BaseException], None],
        stats: ReplicationStats | None = None,
    ) -> None:
        self.store = store
        self._stats = stats  # failed renewals and lost leases, for /metrics
        self.lease = lease
        self.on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self.lost = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._renew_loop(), name=f"polymq-lease-{self.lease.shard}"
        )

    async def _renew_loop(self) -> None:
        # Overdue by our own clock is not lost: only a refused renewal is (the key
        # expired on the server, or another node created it). A slow NATS or a busy
        # loop must not give up a shard nobody else took; a deposed owner cannot write
        # anyway (the stream fences it) and stops at its first refused renewal.
        ttl = self.lease.ttl_s
        while True:
            await asyncio.sleep(ttl / 5)
            try:
                async with asyncio.timeout(ttl / 2):
                    renewed = await self.store.renew(self.lease)
            except Exception as exc:  # NATS unreachable right now: try again
                log.warning("shard %s: lease renewal failed: %r", self.lease.shard, exc)
                if self._stats is not None:
                    self._stats.renewals_failed[self.lease.shard] += 1
                continue
            if not renewed:
                self._lose("another node holds its lease, or it expired")
                return

    def _lose(self, why: str) -> None:
        self.lost = True
        if self._stats is not None:
            self._stats.leases_lost[self.lease.shard] += 1
        error = ShardMoved(f"shard {self.lease.shard} lost: {why}")
        log.error("%s", error)
        self.on_lost(error)

    async def stop(self, *, release: bool) -> None:
        """Stop renewing; ``release``: give the lease up now (a clean hand-over)
        rather than let it expire."""
        if self._task is not None:
            await stop_task(self._task)  # a renewal may swallow one cancel: see there
        if release and not self.lost:
            with contextlib.suppress(Exception):
                await self.store.release(self.lease)
