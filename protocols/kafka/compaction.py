"""Log compaction for `cleanup.policy=compact` topics, as far as the adapter can go
without an engine change.

Kafka keeps, per key, the latest record, and drops a tombstone (null value) once it has
been kept for `delete.retention.ms`. Dropping records in the middle of a queue needs
the engine (see docs/kafka.md, "Compaction"); what the adapter can do safely today is
move the queue's log start offset past the longest prefix whose records are *all*
removable: every record there has a later record with the same key, or is an expired
tombstone. Consumers then see what a Kafka consumer sees after a cleaning: the log start
offset moved, and every key's latest value still readable. The engine's retention
reclaims the space once no queue needs a segment.

The plan (:func:`keep_offsets`) is pure and is what an engine-side `compact` would take.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.processor import Caller, Processor
from protocols.kafka.records import BATCH_FORMAT, CorruptBatch, iter_records, parse_header
from storage.model import QueueRef, StoredBatch

__all__ = [
    "Compactor",
    "Entry",
    "compact_partition",
    "entries_of",
    "is_compacted",
    "keep_offsets",
]

DEFAULT_DELETE_RETENTION_MS = 86_400_000  # Kafka's delete.retention.ms
_READ_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    """One offset of a partition as compaction sees it."""

    offset: int
    key: bytes | None
    tombstone: bool
    timestamp_ms: int
    control: bool = False  # a transaction marker: kept, so it is never cleaned past


def is_compacted(policy: str | None) -> bool:
    return policy is not None and "compact" in {p.strip() for p in policy.split(",")}


def entries_of(batch: StoredBatch) -> Iterator[Entry]:
    """Kafka batches record by record (a null value is a tombstone); messages from
    other protocols by their key, never tombstones. A batch that does not parse is kept
    whole (keyless entries), so compaction cannot lose data it cannot read."""
    if batch.format == BATCH_FORMAT and batch.raw is not None:
        try:
            header = parse_header(batch.raw, check_crc=False)
            records = list(iter_records(batch.raw))
        except CorruptBatch:
            header, records = None, []
        if header is not None and len(records) == batch.count:
            for record in records:
                yield Entry(
                    offset=batch.base_offset + record.offset_delta,
                    key=None if header.control else record.key,
                    tombstone=record.value is None,
                    timestamp_ms=record.timestamp_ms,
                    control=header.control,
                )
            return
        for i in range(batch.count):
            yield Entry(batch.base_offset + i, None, False, batch.store_timestamp_ms)
        return
    for stored in batch.messages:
        message = stored.message
        yield Entry(
            offset=stored.offset,
            key=message.key,
            tombstone=False,
            timestamp_ms=message.born_timestamp_ms or stored.store_timestamp_ms,
        )


def keep_offsets(entries: Iterable[Entry], *, now_ms: int, delete_retention_ms: int) -> set[int]:
    """The offsets Kafka's cleaner would keep: each key's latest record, unless that is
    a tombstone older than ``delete_retention_ms`` (Kafka counts from the cleaning that
    first kept it; the record's timestamp is the closest we know); keyless records and
    markers always; and the partition's last record, as Kafka never cleans the active
    segment."""
    listed = list(entries)
    latest: dict[bytes, int] = {}
    for entry in listed:
        if entry.key is not None:
            latest[entry.key] = entry.offset
    keep: set[int] = set()
    for entry in listed:
        if entry.key is None or (
            latest[entry.key] == entry.offset
            and not (entry.tombstone and entry.timestamp_ms + delete_retention_ms <= now_ms)
        ):
            keep.add(entry.offset)
    if listed:
        keep.add(listed[-1].offset)
    return keep


async def compact_partition(
    processor: Processor,
    caller: Caller,
    queue: QueueRef,
    *,
    delete_retention_ms: int = DEFAULT_DELETE_RETENTION_MS,
    now_ms: int | None = None,
) -> int:
    """Move the queue's log start past its removable prefix; the new log start."""
    offsets = await processor.queue_offsets(caller, queue)
    entries: list[Entry] = []
    offset = offsets.earliest
    while offset < offsets.latest:
        batches = await processor.read_batches(
            caller, queue, offset, max_bytes=_READ_BYTES, metered=False
        )
        if not batches:
            break
        for batch in batches:
            entries.extend(e for e in entries_of(batch) if e.offset >= offset)
        offset = max(offset, batches[-1].base_offset + batches[-1].count)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    keep = keep_offsets(entries, now_ms=now, delete_retention_ms=delete_retention_ms)
    start = min(keep, default=offsets.earliest)
    if start > offsets.earliest:
        await processor.delete_records(caller, queue, start)
        return start
    return offsets.earliest


class Compactor:
    """Cleans a compacted partition in the background after produces to it: at most
    one cleaning per ``interval_s`` per partition, and a produce during the wait is
    covered by the cleaning already scheduled (never on the produce path itself)."""

    def __init__(self, processor: Processor, interval_s: float = 5.0) -> None:
        self._processor = processor
        self.interval_s = interval_s
        self._last: dict[QueueRef, float] = {}
        self._scheduled: set[QueueRef] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # (namespace, topic) -> delete.retention.ms, None if not compacted (a cache)
        self.policies: dict[tuple[str, str], int | None] = {}

    def poke(self, caller: Caller, queue: QueueRef, delete_retention_ms: int) -> None:
        if queue in self._scheduled:
            return
        self._scheduled.add(queue)
        last = self._last.get(queue)
        delay = 0.0 if last is None else max(0.0, last + self.interval_s - time.monotonic())
        task = asyncio.get_running_loop().create_task(
            self._run(caller, queue, delete_retention_ms, delay)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, caller: Caller, queue: QueueRef, delete_retention_ms: int, delay: float
    ) -> None:
        await asyncio.sleep(delay)
        self._scheduled.discard(queue)
        self._last[queue] = time.monotonic()
        with contextlib.suppress(Exception):  # a failed cleaning is retried on a later poke
            await compact_partition(
                self._processor, caller, queue, delete_retention_ms=delete_retention_ms
            )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
