"""A shard's latest checkpoint, replicated in JetStream's object store.

The engine's checkpoint is a few files in its data directory (the snapshot, the lists
it names, the queue indexes). The owner sends them as one tar object after each
checkpoint, before the stream may be purged below it; a node taking the shard over
unpacks it and replays the stream from the checkpoint's position, as a restart would.

Which object is the latest is a key of the shard in a key-value bucket, moved with a
compare-and-set and only forward in epochs: an object store has no compare-and-set,
so a deposed owner that has not noticed yet could still send an object, but it cannot
point the shard at it over its successor's (a higher epoch's). Objects are named by
shard and epoch; the one a pointer leaves is deleted. Every call is bounded in time, so
a slow NATS delays a checkpoint (the next one tries again), never a hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tarfile
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

__all__ = ["CheckpointStore"]

BUCKET = "polymq-checkpoints"
POINTERS = "polymq-checkpoint-pointers"
_META = "polymq-checkpoint.json"
_TIMEOUT_S = 30.0


class CheckpointStore:
    def __init__(self, js: JetStreamContext, *, replicas: int) -> None:
        self._js = js
        self.replicas = replicas
        self._store: ObjectStore | None = None
        self._pointers: KeyValue | None = None

    async def _buckets(self) -> tuple[ObjectStore, KeyValue]:
        if self._store is None:
            try:
                self._store = await self._js.object_store(BUCKET)
            except BucketNotFoundError:
                self._store = await self._js.create_object_store(
                    BUCKET, replicas=self.replicas, storage=StorageType.FILE
                )
        if self._pointers is None:
            try:
                self._pointers = await self._js.key_value(POINTERS)
            except BucketNotFoundError:
                self._pointers = await self._js.create_key_value(
                    bucket=POINTERS, history=1, replicas=self.replicas, storage=StorageType.FILE
                )
        return self._store, self._pointers

    async def put(
        self, shard: str, epoch: int, directory: Path, names: list[str], meta: dict[str, int]
    ) -> None:
        """Send the files ``names`` of ``directory`` with ``meta`` (position, seq)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            _add_bytes(tar, _META, json.dumps(meta).encode())
            for name in names:
                path = directory / name
                if path.exists():
                    tar.add(path, arcname=name, recursive=False)
        async with asyncio.timeout(_TIMEOUT_S):
            store, pointers = await self._buckets()
            name = _name(shard, epoch)
            await store.put(name, buffer.getvalue())
            previous = await self._point(pointers, shard, epoch, name)
            if previous is not None and previous != name:
                with contextlib.suppress(NotFoundError):
                    await store.delete(previous)

    async def _point(self, pointers: KeyValue, shard: str, epoch: int, name: str) -> str | None:
        """Point ``shard`` at ``name`` unless a later epoch's object is pointed at
        already; the object pointed at before."""
        value = json.dumps({"object": name, "epoch": epoch}).encode()
        while True:
            try:
                entry = await pointers.get(shard)
            except KeyNotFoundError:
                try:
                    await pointers.create(shard, value)
                    return None
                except KeyWrongLastSequenceError:
                    continue  # created meanwhile: read it
            current = json.loads(entry.value or b"{}")
            if int(current.get("epoch", 0)) > epoch:
                return name  # deposed: ours is not the latest, delete it
            try:
                await pointers.update(shard, value, last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return str(current.get("object")) if current.get("object") else None

    async def get(self, shard: str, directory: Path) -> dict[str, int] | None:
        """Unpack the latest checkpoint of ``shard`` into ``directory``; its meta, or
        ``None`` if the shard never took one."""
        async with asyncio.timeout(_TIMEOUT_S):
            store, pointers = await self._buckets()
            try:
                entry = await pointers.get(shard)
            except KeyNotFoundError:
                return None
            name = json.loads(entry.value or b"{}").get("object")
            if not name:
                return None
            result = await store.get(name)
        data = result.data
        if not data:
            raise RuntimeError(f"shard {shard}: checkpoint object {name} is empty")
        directory.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            member = tar.extractfile(_META)
            assert member is not None
            meta: dict[str, int] = json.loads(member.read())
            for info in tar.getmembers():
                if info.name != _META:
                    tar.extract(info, directory, filter="data")
        return meta


def _name(shard: str, epoch: int) -> str:
    return f"{shard}.{epoch:015d}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
