"""One process's connection to the replicated pool: the NATS cluster, its lease and
checkpoint buckets, and claiming a shard (what a shard's log awaits at its start)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.js.errors import APIError

from polymq.storage.errors import StorageError
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.config import ReplicationConfig
from polymq.storage.replicated.keeper import LeaseKeeper
from polymq.storage.replicated.leases import LeaseStore
from polymq.storage.replicated.log import Claim
from polymq.storage.replicated.stats import ReplicationStats
from polymq.storage.replicated.stream import ShardStream

__all__ = ["Held", "NatsPool", "PoolError"]

log = logging.getLogger(__name__)
_FIRST_CONNECT_S = 10.0
_JETSTREAM_READY_S = 30.0


class PoolError(StorageError, code="replication_misconfigured"):
    """The replicated pool cannot be used as configured (said at start-up)."""


@dataclass(slots=True)
class Held:
    """A shard this process owns: what its log writes with, and who renews it."""

    claim: Claim
    keeper: LeaseKeeper


class NatsPool:
    def __init__(self, config: ReplicationConfig, owner: str) -> None:
        if config.replicas not in (1, 3, 5):
            raise PoolError(f"replication.replicas must be 1, 3 or 5, not {config.replicas}")
        self.config = config
        self.owner = owner
        self._nc: Client | None = None
        self._leases: LeaseStore | None = None
        self._checkpoints: CheckpointStore | None = None
        # This process's publish, lease and takeover figures, for /metrics.
        self.stats = ReplicationStats()

    @property
    def leases(self) -> LeaseStore:
        assert self._leases is not None, "NatsPool.connect() first"
        return self._leases

    async def connect(self) -> None:
        servers = self.config.servers()
        try:
            # Reconnects never stop once connected; the first connect waits a while
            # (NATS may be starting beside us), then says what is wrong.
            async with asyncio.timeout(_FIRST_CONNECT_S):
                self._nc = await nats.connect(
                    servers,
                    name=f"polymq {self.owner}",
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    error_cb=_log_error,
                    disconnected_cb=_log_disconnected,
                    reconnected_cb=_log_reconnected,
                )
        except Exception as exc:
            raise PoolError(
                f"cannot reach NATS at {', '.join(servers)} within {_FIRST_CONNECT_S:.0f} s: "
                f"{exc!r}"
            ) from exc
        js = self._nc.jetstream(timeout=5)
        replicas = self.config.replicas
        self._leases = LeaseStore(js, ttl_s=self.config.lease_ms / 1000, replicas=replicas)
        try:
            await self._open_buckets()
        except APIError as exc:
            await self.close()
            raise PoolError(
                f"JetStream refused {replicas} replicas: {exc.description} "
                f"(replicas {replicas} needs a NATS cluster of at least {replicas} "
                "servers with JetStream)"
            ) from exc
        self._checkpoints = CheckpointStore(js, replicas=replicas)

    async def _open_buckets(self) -> None:
        """Retried while JetStream is not ready yet (a cluster that just started
        elects its meta leader first); refused placement is an answer, not a wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _JETSTREAM_READY_S
        while True:
            try:
                await self.leases.open()
                return
            except APIError as exc:
                text = (exc.description or "").lower()
                if any(word in text for word in ("replica", "insufficient", "peers")):
                    raise
                if loop.time() > deadline:
                    raise
                error: Exception = exc
            except Exception as exc:  # a timeout: no JetStream answer yet
                if loop.time() > deadline:
                    raise PoolError(f"JetStream did not answer: {exc!r}") from exc
                error = exc
            log.info("waiting for JetStream: %r", error)
            await asyncio.sleep(0.25)

    def stream(self, shard: str) -> ShardStream:
        assert self._nc is not None, "NatsPool.connect() first"
        return ShardStream(
            self._nc.jetstream(timeout=5),
            shard,
            replicas=self.config.replicas,
            chunk_bytes=self.config.chunk_bytes,
            stats=self.stats,
        )

    async def try_claim(self, shard: str) -> Held | None:
        """The shard's lease if nobody holds it (not yet renewing: see
        :meth:`LeaseKeeper.start`)."""
        lease = await self.leases.acquire(shard, self.owner)
        if lease is None:
            return None
        assert self._checkpoints is not None
        stream = self.stream(shard)
        try:
            await stream.ensure()
        except BaseException:
            await self.leases.release(lease)
            raise
        claim = Claim(stream=stream, checkpoints=self._checkpoints, epoch=lease.epoch)
        return Held(claim, LeaseKeeper(self.leases, lease, lambda exc: None, self.stats))

    async def wait_claim(self, shard: str) -> Held:
        """Wait until the shard is free and take it (a standby's start)."""
        waiting = False
        while True:
            held = await self.try_claim(shard)
            if held is not None:
                return held
            if not waiting:
                log.info(
                    "shard %s is owned by %s: standing by to take over",
                    shard,
                    await self.leases.owner(shard),
                )
                waiting = True
            await asyncio.sleep(self.config.lease_ms / 4000)

    async def close(self) -> None:
        if self._nc is not None:
            nc, self._nc = self._nc, None
            try:
                await nc.drain()
            except Exception:
                await nc.close()


async def _log_error(exc: Exception) -> None:
    log.warning("NATS: %r", exc)


async def _log_disconnected() -> None:
    log.warning("NATS: disconnected, reconnecting")


async def _log_reconnected() -> None:
    log.info("NATS: reconnected")
