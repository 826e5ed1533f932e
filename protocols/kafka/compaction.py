"""Log compaction for `cleanup.policy=compact` topics.

Kafka keeps, per key, the latest record, and drops a tombstone (null value) once it has
been kept for `delete.retention.ms`. The plan (:func:`keep_offsets`) is pure; the
engine's :meth:`storage.api.StorageAPI.compact` carries it out: a batch whose records
all go is dropped (its offsets become gaps, which fetches skip as Kafka consumers skip
what its cleaner removed), a batch keeping some of its records is re-encoded with only
those (same base offset, offset deltas, last offset delta, producer id, epoch and base
sequence, uncompressed), and everything else stays as it is. Offsets never move.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from crc32c import crc32c

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.kafka.records import (
    BATCH_FORMAT,
    CorruptBatch,
    KafkaRecord,
    encode_batch,
    expand_batch,
    iter_records,
    parse_header,
)
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import BatchEntry, Message, QueueRef, StoredBatch

__all__ = [
    "Compactor",
    "Entry",
    "Plan",
    "compact_partition",
    "entries_of",
    "is_compacted",
    "keep_offsets",
    "plan_partition",
]

DEFAULT_DELETE_RETENTION_MS = 86_400_000  # Kafka's delete.retention.ms
_READ_BYTES = 1 << 20
_COMPRESSION_BITS = 0x07
# Header fields re-encoding must carry over (byte positions in a v2 batch).
_LAST_OFFSET_DELTA_AT = 23
_BASE_SEQUENCE_AT = 53
_CRC_AT, _CRC_FROM = 17, 21


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


def _kafka_records(batch: StoredBatch) -> list[KafkaRecord] | None:
    """The records of a stored Kafka batch, or None if it does not parse (or claims
    offsets outside the stored span): such a batch is kept whole."""
    if batch.format != BATCH_FORMAT or batch.raw is None:
        return None
    try:
        header = parse_header(batch.raw, check_crc=False)
        records = list(iter_records(batch.raw))
    except CorruptBatch:
        return None
    if len(records) != header.record_count or any(
        not 0 <= r.offset_delta < batch.count for r in records
    ):
        return None
    return records


def entries_of(batch: StoredBatch) -> Iterator[Entry]:
    """Kafka batches record by record (a null value is a tombstone; offsets an earlier
    compaction removed are simply absent); messages from other protocols by their key,
    never tombstones. A batch that does not parse is kept whole (keyless entries), so
    compaction cannot lose data it cannot read."""
    if batch.format == BATCH_FORMAT and batch.raw is not None:
        records = _kafka_records(batch)
        if records is not None:
            control = parse_header(batch.raw, check_crc=False).control
            for record in records:
                yield Entry(
                    offset=batch.base_offset + record.offset_delta,
                    key=None if control else record.key,
                    tombstone=record.value is None,
                    timestamp_ms=record.timestamp_ms,
                    control=control,
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


def _rewritten(batch: StoredBatch, kept: list[KafkaRecord]) -> BatchEntry:
    """``batch`` with only ``kept`` records, as Kafka's cleaner writes it: same base
    offset, offset deltas and last offset delta (consumers move past the whole batch),
    producer id, epoch and base sequence, attributes but compression; uncompressed.
    Its messages are given, one per offset of the span, since other protocols read it
    offset by offset (the dropped offsets' are empty and never read: they are gaps)."""
    assert batch.raw is not None
    header = parse_header(batch.raw, check_crc=False)
    raw = bytearray(
        encode_batch(
            batch.base_offset,
            kept,
            attributes=header.attributes & ~_COMPRESSION_BITS,
            producer_id=header.producer_id,
            producer_epoch=header.producer_epoch,
        )
    )
    struct.pack_into(">i", raw, _LAST_OFFSET_DELTA_AT, header.last_offset_delta)
    struct.pack_into(">i", raw, _BASE_SEQUENCE_AT, header.base_sequence)
    struct.pack_into(">I", raw, _CRC_AT, crc32c(bytes(raw[_CRC_FROM:])))
    by_delta = dict(zip((r.offset_delta for r in kept), expand_batch(bytes(raw)), strict=True))
    messages = tuple(by_delta.get(i, Message()) for i in range(batch.count))
    return BatchEntry(format=BATCH_FORMAT, raw=bytes(raw), messages=messages)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one cleaning asks of the engine (``StorageAPI.compact``'s arguments)."""

    drop: list[int]
    rewrite: dict[int, BatchEntry]


def plan_partition(
    batches: Iterable[StoredBatch], *, now_ms: int, delete_retention_ms: int
) -> Plan:
    """The engine call that leaves what :func:`keep_offsets` keeps."""
    listed = list(batches)
    entries = [e for batch in listed for e in entries_of(batch)]
    keep = keep_offsets(entries, now_ms=now_ms, delete_retention_ms=delete_retention_ms)
    drop: list[int] = []
    rewrite: dict[int, BatchEntry] = {}
    for batch in listed:
        present = [e.offset for e in entries_of(batch)]
        going = [o for o in present if o not in keep]
        if not going:
            continue
        drop.extend(going)
        if len(going) < len(present):  # some of a Kafka batch's records stay
            records = _kafka_records(batch)
            assert records is not None  # only Kafka batches hold several entries
            kept = [r for r in records if batch.base_offset + r.offset_delta in keep]
            rewrite[batch.base_offset] = _rewritten(batch, kept)
    return Plan(drop, rewrite)


async def compact_partition(
    processor: Processor,
    caller: Caller,
    queue: QueueRef,
    *,
    delete_retention_ms: int = DEFAULT_DELETE_RETENTION_MS,
    now_ms: int | None = None,
) -> int:
    """Read the partition, plan, and have the engine drop what Kafka would; how many
    offsets were removed."""
    offsets = await processor.queue_offsets(caller, queue)
    batches: list[StoredBatch] = []
    offset = offsets.earliest
    while offset < offsets.latest:
        read = await processor.read_batches(
            caller, queue, offset, max_bytes=_READ_BYTES, metered=False
        )
        read = [b for b in read if b.base_offset + b.count > offset]
        if not read:
            break
        batches.extend(read)
        offset = max(offset, read[-1].base_offset + read[-1].count)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    plan = plan_partition(batches, now_ms=now, delete_retention_ms=delete_retention_ms)
    if not plan.drop:
        return 0
    return await processor.compact(caller, queue, plan.drop, plan.rewrite)


class Compactor:
    """Cleans a compacted partition in the background after produces to it: at most
    one cleaning per ``interval_s`` per partition, and a produce during the wait is
    covered by the cleaning already scheduled (never on the produce path itself)."""

    def __init__(self, processor: Processor, interval_s: float = 5.0) -> None:
        self._processor = processor
        self.interval_s = interval_s
        self._last: dict[QueueRef, float] = {}
        self._scheduled: set[QueueRef] = set()
        self._tasks = TaskSet("kafka compactor")
        # (namespace, topic) -> delete.retention.ms, None if not compacted (a cache)
        self.policies: dict[tuple[str, str], int | None] = {}

    def poke(self, caller: Caller, queue: QueueRef, delete_retention_ms: int) -> None:
        if queue in self._scheduled or self._tasks.closed:
            return  # closed: a produce still finishing as the listener stops cleans nothing
        self._scheduled.add(queue)
        last = self._last.get(queue)
        delay = 0.0 if last is None else max(0.0, last + self.interval_s - time.monotonic())
        self._tasks.spawn(self._run(caller, queue, delete_retention_ms, delay))

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
        await self._tasks.close()
