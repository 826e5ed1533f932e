"""What an operator asks of the replicated pool: for each shard's stream, which NATS
server leads it and whether each replica is current (``polymq cluster status``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import nats

from polymq.storage.replicated.stream import stream_name

__all__ = ["replica_health"]


async def replica_health(servers: Sequence[str], shards: Sequence[str]) -> dict[str, str]:
    """Shard -> "leader n2; n1 current, n3 lag 12" (or why it cannot be told)."""
    urls = [s if "://" in s else f"nats://{s}" for s in servers]
    try:
        async with asyncio.timeout(5):
            nc = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=1)
    except Exception as exc:
        return {shard: f"NATS unreachable ({exc.__class__.__name__})" for shard in shards}
    health: dict[str, str] = {}
    try:
        js = nc.jetstream(timeout=3)
        for shard in shards:
            try:
                info = await js.stream_info(stream_name(shard))
            except Exception as exc:
                health[shard] = f"no stream ({exc.__class__.__name__})"
                continue
            cluster = info.cluster
            if cluster is None:
                health[shard] = f"{info.state.messages} messages, 1 replica"
                continue
            replicas = ", ".join(
                f"{r.name} {'current' if r.current else 'behind'}"
                + (f" lag {r.lag}" if r.lag else "")
                for r in cluster.replicas or []
            )
            health[shard] = f"leader {cluster.leader or 'NONE'}; {replicas}"
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return health
