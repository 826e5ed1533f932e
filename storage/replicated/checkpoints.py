"""A shard's latest checkpoint, replicated in JetStream's object store.

The engine's checkpoint is a few files in its data directory (the snapshot, the lists
it names, the queue indexes). The owner sends them as one tar object after each
checkpoint, before the stream may be purged below it; a node taking the shard over
unpacks it and replays the stream from the checkpoint's position, as a restart would.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore

__all__ = ["CheckpointStore"]

BUCKET = "polymq-checkpoints"
_META = "polymq-checkpoint.json"


class CheckpointStore:
    def __init__(self, js: JetStreamContext, *, replicas: int) -> None:
        self._js = js
        self.replicas = replicas
        self._store: ObjectStore | None = None

    async def _bucket(self) -> ObjectStore:
        if self._store is None:
            try:
                self._store = await self._js.object_store(BUCKET)
            except BucketNotFoundError:
                self._store = await self._js.create_object_store(
                    BUCKET, replicas=self.replicas, storage=StorageType.FILE
                )
        return self._store

    async def put(
        self, shard: str, directory: Path, names: list[str], meta: dict[str, int]
    ) -> None:
        """Send the files ``names`` of ``directory`` with ``meta`` (position, seq)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            _add_bytes(tar, _META, json.dumps(meta).encode())
            for name in names:
                path = directory / name
                if path.exists():
                    tar.add(path, arcname=name, recursive=False)
        store = await self._bucket()
        await store.put(shard, buffer.getvalue())

    async def get(self, shard: str, directory: Path) -> dict[str, int] | None:
        """Unpack the latest checkpoint of ``shard`` into ``directory``; its meta, or
        ``None`` if the shard never took one."""
        store = await self._bucket()
        try:
            result = await store.get(shard)
        except NotFoundError:
            return None
        data = result.data
        if not data:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            member = tar.extractfile(_META)
            assert member is not None
            meta: dict[str, int] = json.loads(member.read())
            for info in tar.getmembers():
                if info.name != _META:
                    tar.extract(info, directory, filter="data")
        return meta

    async def delete(self, shard: str) -> None:
        store = await self._bucket()
        with contextlib.suppress(NotFoundError):
            await store.delete(shard)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
