"""Shard ownership as leases in JetStream's key-value store.

A lease is the shard's key, created only if absent (compare-and-set on revision 0) and
renewed by its owner with a compare-and-set on the revision it holds. The bucket's
time to live is the lease time: an owner that stops renewing (killed, stopped, cut
off) loses the key when it ages out, and another node creates it anew. The revision
of the creation is the owner's epoch: JetStream's sequences only grow, so a later
owner always has a higher one.

A lease only says who should write; the fence is the stream's expected sequence
(:mod:`storage.replicated.stream`): an owner that did not notice it lost the lease
still cannot append once its successor sealed the stream, and it stops serving the
shard at its first refused renewal.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

__all__ = ["Lease", "LeaseStore"]

LEASE_BUCKET = "polymq-leases"
NODE_BUCKET = "polymq-nodes"


@dataclass(slots=True)
class Lease:
    shard: str
    owner: str
    epoch: int
    revision: int
    ttl_s: float


class LeaseStore:
    """Leases of shards and the presence of nodes, both expiring after ``ttl_s``."""

    def __init__(self, js: JetStreamContext, *, ttl_s: float, replicas: int) -> None:
        self._js = js
        self.ttl_s = ttl_s
        self.replicas = replicas
        self._leases: KeyValue | None = None
        self._nodes: KeyValue | None = None

    async def open(self) -> None:
        self._leases = await self._bucket(LEASE_BUCKET)
        self._nodes = await self._bucket(NODE_BUCKET)

    async def _bucket(self, name: str) -> KeyValue:
        try:
            return await self._js.key_value(name)
        except BucketNotFoundError:
            return await self._js.create_key_value(
                bucket=name,
                history=1,
                ttl=self.ttl_s,
                replicas=self.replicas,
                storage=StorageType.FILE,
            )

    @property
    def leases(self) -> KeyValue:
        assert self._leases is not None, "LeaseStore.open() first"
        return self._leases

    @property
    def nodes(self) -> KeyValue:
        assert self._nodes is not None, "LeaseStore.open() first"
        return self._nodes

    async def acquire(self, shard: str, owner: str) -> Lease | None:
        """The lease of ``shard`` if nobody holds it, else ``None``."""
        value = json.dumps({"owner": owner}).encode()
        try:
            revision = await self.leases.create(shard, value)
        except KeyWrongLastSequenceError:
            return None
        return Lease(shard, owner, revision, revision, self.ttl_s)

    async def renew(self, lease: Lease) -> bool:
        """Extend ``lease``; ``False`` if it was lost (expired, taken)."""
        value = json.dumps({"owner": lease.owner, "epoch": lease.epoch}).encode()
        try:
            lease.revision = await self.leases.update(lease.shard, value, last=lease.revision)
        except KeyWrongLastSequenceError:
            # An earlier renewal may have landed with its answer lost (the stream's
            # leader died): the key then holds our own value, owner and epoch.
            try:
                entry = await self.leases.get(lease.shard)
            except KeyNotFoundError:
                return False
            if entry.value != value or entry.revision is None:
                return False
            lease.revision = entry.revision
        return True

    async def release(self, lease: Lease) -> None:
        """Give the shard up at once (a hand-over), if still ours."""
        with contextlib.suppress(KeyWrongLastSequenceError, KeyNotFoundError):
            await self.leases.delete(lease.shard, last=lease.revision)

    async def owner(self, shard: str) -> str | None:
        try:
            entry = await self.leases.get(shard)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        owner = json.loads(entry.value).get("owner")
        return owner if isinstance(owner, str) else None

    async def announce(self, node: str, prefer: list[str]) -> None:
        """Say that ``node`` is alive and which shards it prefers (expires with the
        ttl)."""
        await self.nodes.put(node, json.dumps({"prefer": prefer}).encode())

    async def preferences(self) -> dict[str, list[str]]:
        """The live nodes and the shards each prefers. The keys come from one stream
        info request (the KV client's key listing waits on a watcher with no bound,
        and a placement step must never hang on it)."""
        info = await self._js.stream_info(
            f"KV_{NODE_BUCKET}", subjects_filter=f"$KV.{NODE_BUCKET}.>"
        )
        found = {}
        for subject in info.state.subjects or {}:
            key = subject.removeprefix(f"$KV.{NODE_BUCKET}.")
            try:
                entry = await self.nodes.get(key)
            except KeyNotFoundError:
                continue
            if entry.value:
                prefer = json.loads(entry.value).get("prefer", [])
                found[key] = [str(shard) for shard in prefer]
        return found
