"""A shard's latest checkpoint, replicated in JetStream's object store.

The engine's checkpoint is a few files in its data directory (the snapshot, the lists
it names, the queue indexes). The owner sends them as one tar object after each
checkpoint, before the stream may be purged below it; a node taking the shard over
unpacks it and replays the stream from the checkpoint's position, as a restart would.

Objects are named by shard and owner epoch, and a reader takes the highest epoch's:
an object store has no compare-and-set, so a deposed owner that has not noticed yet
could still send one, but only under its own, lower epoch. Its checkpoint is then
consistent (taken at records the stream has) and simply older than the new owner's
first one, which supersedes it; older epochs' objects are deleted after that.
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
        store = await self._bucket()
        name = _name(shard, epoch)
        await store.put(name, buffer.getvalue())
        for older in await self._names(shard):
            if older < name:
                with contextlib.suppress(NotFoundError):
                    await store.delete(older)

    async def _names(self, shard: str) -> list[str]:
        store = await self._bucket()
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:  # an empty store
            return []
        prefix = shard + "."
        return sorted(i.name for i in infos if i.name.startswith(prefix) and not i.deleted)

    async def get(self, shard: str, directory: Path) -> dict[str, int] | None:
        """Unpack the latest checkpoint of ``shard`` into ``directory``; its meta, or
        ``None`` if the shard never took one."""
        names = await self._names(shard)
        if not names:
            return None
        store = await self._bucket()
        try:
            result = await store.get(names[-1])
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
        for name in await self._names(shard):
            with contextlib.suppress(NotFoundError):
                await store.delete(name)


def _name(shard: str, epoch: int) -> str:
    return f"{shard}.{epoch:015d}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
