"""``[replication]``: the replicated pool's settings (docs/replication.md), handed to
the storage roles by the composition root."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

__all__ = ["ReplicationConfig", "parse_nats_url"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicationConfig:
    """Empty ``nats``: the unreplicated pool (each node's disk is its topics' copy)."""

    nats: tuple[str, ...] = ()  # "host:port" of the NATS servers (any of them will do)
    replicas: int = 3  # copies of each shard's stream: 1, or 3 on a 3-server cluster
    shards: int = 0  # how many shards the pool has (0: one per storage node named node-i)
    prefer: tuple[str, ...] = ()  # the shards this node takes first (and gets back)
    lease_ms: int = 3000  # an owner silent this long loses its shards
    chunk_bytes: int = 1000 * 1024  # stream message size limit (under NATS max_payload)

    @property
    def enabled(self) -> bool:
        return bool(self.nats)

    def servers(self) -> list[str]:
        return [address if "://" in address else f"nats://{address}" for address in self.nats]


def parse_nats_url(url: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``nats://h1:p1,h2:p2?replicas=3&shard=main``: the servers and the options."""
    parts = urlsplit(url)
    servers = tuple(a for a in parts.netloc.split(",") if a)
    options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    return servers, options
