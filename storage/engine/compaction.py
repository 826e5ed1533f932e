"""Compaction: dropping offsets from a queue and rewriting batch entries in place.

Its own module because it is the one change that rewrites records already stored,
and its crash safety rests on an order of records that nothing else uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from polymq.storage.engine import records as rec
from polymq.storage.engine.commit_log import HEADER_SIZE
from polymq.storage.engine.core import EnginePart
from polymq.storage.engine.queue_index import IndexEntry, QueueIndex
from polymq.storage.engine.state import Topic
from polymq.storage.errors import InvalidArgument
from polymq.storage.model import BatchEntry, QueueRef

__all__ = ["Compaction"]


class Compaction(EnginePart):
    """Compaction of the queues of one engine."""

    async def compact(
        self, queue: QueueRef, drop: Sequence[int], rewrite: Mapping[int, BatchEntry] | None
    ) -> int:
        """See :meth:`storage.api.StorageAPI.compact`.

        Crash safety by ordering: the copies are written first as staged records that
        change nothing by themselves, then one closing "compact" record applies them
        with the gaps. A crash before the closing record is durable leaves the queue
        as it was; after, the replay applies the same change. The old records are then
        referenced by no index entry and go with their segments under retention.

        Positions must stay in offset order along the queue (retention and recovery
        binary-search them), so every entry from the first changed offset to the end
        is copied, and no append may be half-done meanwhile: writers are held at the
        gate while the copies are reserved, as a checkpoint holds them.
        """
        core = self._core
        await core.writable()
        _, index = self._state.queue(queue)
        asked = [*drop, *(rewrite or {})]
        if asked and (max(asked) >= index.end or min(asked) < 0):
            raise InvalidArgument(f"compaction of {queue} names offsets outside [0, {index.end})")
        async with core.maintenance_lock:
            core.gate.clear()
            try:
                await self._log.wait_durable()  # every reserved append is indexed now
                core.check_open()
                topic, index = self._state.queue(queue)  # retention may have trimmed it
                dropped = {o for o in drop if o >= index.base}
                replaced = {o: e for o, e in (rewrite or {}).items() if o >= index.base}
                if not dropped and not replaced:
                    return 0
                end, emptied = self._compact_now(topic, queue.queue_id, index, dropped, replaced)
            finally:
                core.gate.set()
        await self._log.wait_durable(end)
        return emptied

    def _compact_now(
        self,
        topic: Topic,
        queue_id: int,
        index: QueueIndex,
        dropped: set[int],
        rewrite: dict[int, BatchEntry],
    ) -> tuple[int, int]:
        """Reserve the copies and the closing record; returns the log end to wait for
        and how many offsets become gaps. Synchronous: nothing is appended between."""
        first = min(o for o in (*dropped, *rewrite) if o >= index.base)
        first -= index.get(first).batch_index  # from the start of its entry
        first = max(first, index.base)
        copies: list[tuple[int, IndexEntry, bytes | None]] = []  # base, entry, new entry
        gaps: set[int] = set()  # new and earlier ones: all get positions in order again
        emptied = 0
        offset = first
        while offset < index.end:
            entry = index.get(offset)
            if not entry.size:
                gaps.add(offset)
                offset += 1
                continue
            base = offset - entry.batch_index
            span = range(max(base, index.base), base + entry.batch_count)
            present = [o for o in span if index.get(o).size]
            going = [o for o in present if o in dropped]
            replacement = rewrite.pop(base, None)
            if replacement is not None:
                if replacement.size != entry.batch_count:
                    raise InvalidArgument(
                        f"offset {base} of {topic.name}[{queue_id}] starts an entry of "
                        f"{entry.batch_count} offsets, not {replacement.size}"
                    )
                copies.append((base, entry, rec.encode_entry(replacement)))
            elif len(going) < len(present):
                if going:
                    raise InvalidArgument(
                        f"offsets {span.start}-{span.stop - 1} of {topic.name}[{queue_id}] "
                        "are one entry: drop all of them or rewrite it"
                    )
                copies.append((base, entry, None))
            emptied += len(going)
            gaps.update(o for o in span if o in dropped or o not in present)
            offset = span.stop
        if rewrite:
            raise InvalidArgument(f"offsets {sorted(rewrite)} start no entry")
        cid = self._log.end
        spans = [(entry.position, entry.size) for _, entry, new in copies if new is None]
        payloads = iter(self._log.read_many(spans)) if spans else iter(())
        for base, entry, new in copies:
            original = rec.decode_record(next(payloads)) if new is None else None
            assert original is None or isinstance(original, rec.MessageRecord)
            record = rec.MessageRecord(
                flags=rec.MESSAGE_COPY,
                store_ms=entry.store_ms,
                message_id=original.message_id if original else self._message_id_at(entry),
                source=-1,
                count=entry.batch_count,
                due_ms=cid,
                group_hash=entry.group_hash,
                tag_hash=entry.tag_hash,
                dispatches=(rec.Dispatch(topic.id, queue_id, base),),
                aux="",
                entry=original.entry if original else (new or b""),
            )
            payload = rec.encode_record(record)
            position = self._log.reserve(payload)
            self._state.stage_copy(position, HEADER_SIZE + len(payload), record)
        ranges = _ranges(sorted(gaps))
        op = {"op": "compact", "cid": cid, "id": topic.id, "queue": queue_id, "gaps": ranges}
        self._log.reserve(
            rec.encode_record(rec.Meta(op)),
            on_durable=lambda: self._state.apply_compaction(cid, topic.id, queue_id, ranges),
        )
        return self._log.end, emptied

    def _message_id_at(self, entry: IndexEntry) -> str:
        message_id, _ = rec.read_message_entry(self._log.read(entry.position, entry.size))
        return message_id


def _ranges(offsets: Sequence[int]) -> list[list[int]]:
    """Sorted offsets as ``[first, end)`` runs (compact on disk, in the closing record)."""
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1][1] = offset + 1
        else:
            runs.append([offset, offset + 1])
    return runs
