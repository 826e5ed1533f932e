"""Committed offsets of consumer groups in stream mode (Kafka's consumer offsets).

The engine only stores them: where a group reads next is the client's business, so
nothing here moves or checks an offset against a queue's bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

from polymq.storage.engine import records as rec
from polymq.storage.engine.core import EnginePart
from polymq.storage.errors import InvalidArgument
from polymq.storage.model import CommittedOffset, QueueRef
from polymq.storage.names import check_name

__all__ = ["Offsets"]


class Offsets(EnginePart):
    """The committed offsets of one engine's groups."""

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str
    ) -> None:
        check_name("group", group)
        await self._core.writable()
        tid, qid = self._core.queue_key(namespace, queue)
        if offset < 0:
            raise InvalidArgument(f"offset must not be negative, got {offset}")
        record = rec.OffsetCommit(group, tid, qid, offset, metadata, self._core.now())
        self._state.apply_offset_commit(record)
        self._core.record(record)
        await self._log.wait_durable()

    def fetch_offset(self, namespace: str, group: str, queue: QueueRef) -> CommittedOffset | None:
        self._core.check_open()
        key = self._core.queue_key(namespace, queue)
        return self._state.offsets.get((namespace, group), {}).get(key)

    def list_group_offsets(self, namespace: str, group: str) -> dict[QueueRef, CommittedOffset]:
        self._core.check_open()
        return {
            self._state.ref(k): v
            for k, v in self._state.offsets.get((namespace, group), {}).items()
        }

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None
    ) -> None:
        await self._core.writable()
        keys = (
            None if queues is None else [list(self._core.queue_key(namespace, q)) for q in queues]
        )
        await self._log.wait_durable(
            self._core.meta(op="offsets_delete", ns=namespace, group=group, queues=keys)
        )

    def list_groups(self, namespace: str) -> list[str]:
        """Every group that committed an offset, popped, or has a configuration."""
        self._core.check_open()
        names = {
            g
            for source in (self._state.offsets, self._state.cursors, self._state.group_configs)
            for ns, g in source
            if ns == namespace
        }
        return sorted(names)
