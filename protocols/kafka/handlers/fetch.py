"""Fetch (long polling over many partitions), ListOffsets, DeleteRecords and
OffsetForLeaderEpoch.

Stored Kafka batches go back as produced, their base offset rewritten to the storage
offset (outside the CRC, so nothing is re-encoded); messages stored by other protocols
are framed into well-formed, uncompressed v2 batches on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.gateway.fairness import cooperatively
from polymq.gateway.permissions import Operation
from polymq.protocols.kafka.authz import denied, permitted
from polymq.protocols.kafka.codec import ms
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.kafka.records import (
    BATCH_FORMAT,
    KafkaRecord,
    encode_batch,
    expand_batch,
    message_headers,
    parse_header,
    with_base_offset,
)
from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.transactions import AbortedRange
from polymq.protocols.kafka.txn_log import partition_transactions
from polymq.storage.batch_formats import expand
from polymq.storage.errors import StorageError
from polymq.storage.model import QueueOffsets, QueueRef, StoredBatch, StoredMessage

__all__ = [
    "delete_records",
    "encode_messages",
    "fetch",
    "list_offsets",
    "offset_for_leader_epoch",
    "to_wire",
]

log = logging.getLogger(__name__)

_EARLIEST = -2
_LATEST = -1
_MAX_TIMESTAMP = -3
_TIMESTAMP_SCAN_BYTES = 8 << 20
_READ_COMMITTED = 1
_UNSTABLE_POLL_MS = 100


@dataclass(slots=True)
class _Partition:
    topic: str
    index: int
    queue: QueueRef
    offset: int
    max_bytes: int
    committed_only: bool = False  # isolation level read_committed
    error: ErrorCode = ErrorCode.none
    offsets: QueueOffsets | None = None
    last_stable: int = -1
    records: bytes = b""
    aborted: tuple[AbortedRange, ...] = ()


def _record(message: StoredMessage, delta: int) -> KafkaRecord:
    m = message.message
    return KafkaRecord(
        offset_delta=delta,
        timestamp_ms=m.born_timestamp_ms or message.store_timestamp_ms,
        key=m.key,
        value=m.body,
        headers=tuple(message_headers(m)),
    )


def encode_messages(messages: list[StoredMessage]) -> bytes:
    """Single stored messages (in offset order) as record batches, one per run of
    consecutive offsets."""
    out: list[bytes] = []
    start = 0
    for i in range(1, len(messages) + 1):
        if i == len(messages) or messages[i].offset != messages[i - 1].offset + 1:
            run = messages[start:i]
            base = run[0].offset
            out.append(encode_batch(base, [_record(m, m.offset - base) for m in run]))
            start = i
    return b"".join(out)


def to_wire(batches: list[StoredBatch]) -> bytes:
    """Stored entries as the bytes of a fetch response's ``records``: runs of single
    messages become one batch each."""
    out: list[bytes] = []
    run: list[StoredMessage] = []

    def flush() -> None:
        if run:
            out.append(encode_messages(run))
            run.clear()

    for batch in batches:
        if batch.format == BATCH_FORMAT and batch.raw is not None:
            flush()
            out.append(with_base_offset(batch.raw, batch.base_offset))
        elif batch.raw is not None and batch.format is not None:
            flush()  # another protocol's batch: frame its messages anew
            messages = expand(batch.format, batch.raw)
            records = [
                KafkaRecord(
                    offset_delta=i,
                    timestamp_ms=m.born_timestamp_ms or batch.store_timestamp_ms,
                    key=m.key,
                    value=m.body,
                    headers=tuple(message_headers(m)),
                )
                for i, m in enumerate(messages)
            ]
            out.append(encode_batch(batch.base_offset, records))
        else:
            run.extend(batch.messages)
    flush()
    return b"".join(out)


async def _read(session: Session, part: _Partition, wait_ms: int) -> None:
    try:
        part.offsets = await session.processor.queue_offsets(session.caller, part.queue)
        part.last_stable = part.offsets.latest
        if not part.offsets.earliest <= part.offset <= part.offsets.latest:
            part.error = ErrorCode.offset_out_of_range
            return
        if part.offset == part.offsets.latest and wait_ms <= 0:
            return
        batches = await session.processor.read_batches(
            session.caller, part.queue, part.offset, max_bytes=part.max_bytes, wait_ms=wait_ms
        )
        if batches:
            part.offsets = await session.processor.queue_offsets(session.caller, part.queue)
            part.last_stable = part.offsets.latest
        if part.committed_only and _transactional(batches):
            batches = await _stable(session, part, batches)
            if not batches and wait_ms > 0:
                # Nothing stable to read yet; an open transaction ends with EndTxn.
                await asyncio.sleep(min(wait_ms, _UNSTABLE_POLL_MS) / 1000)
    except (StorageError, AuthError) as e:
        part.error = error_code(e)
        return
    part.records = to_wire(batches)


def _transactional(batches: list[StoredBatch]) -> bool:
    """Whether any of ``batches`` is a transaction's (records or a marker)."""
    return any(
        b.format == BATCH_FORMAT
        and b.raw is not None
        and parse_header(b.raw, check_crc=False).transactional
        for b in batches
    )


async def _stable(
    session: Session, part: _Partition, batches: list[StoredBatch]
) -> list[StoredBatch]:
    """read_committed: the batches below the last stable offset, with the aborted
    transactions among them, as the coordinators left them in storage."""
    txns = await partition_transactions(session, part.queue)
    assert part.offsets is not None
    part.last_stable = txns.last_stable(part.offsets.latest)
    batches = [b for b in batches if b.base_offset < part.last_stable]
    if batches:
        end = batches[-1].base_offset + batches[-1].count
        part.aborted = tuple(txns.aborted_in(part.offset, end))
    return batches


async def _wait_for_any(session: Session, parts: list[_Partition], wait_ms: int) -> None:
    """Long poll: return once any partition has data, or after ``wait_ms``. Storage
    wakes the read on the append that makes the data readable, never on a timer."""
    if len(parts) == 1:
        # The usual consumer's fetch: its one read waits in this task. A task per
        # partition and ``asyncio.wait`` over them cost a consumer of one partition
        # two more loop iterations and their allocations per record at a low rate.
        await _read(session, parts[0], wait_ms)
        return
    tasks: dict[asyncio.Future[None], _Partition] = {}
    try:
        # A task's first step runs in the loop iteration after its creation: created
        # in slices, thousands of them do not all run in one iteration.
        async for p in cooperatively(parts):
            tasks[asyncio.ensure_future(_read(session, p, wait_ms))] = p
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # Only the partitions just read can have changed (not all of them again).
            if any(tasks[t].records or tasks[t].error is not ErrorCode.none for t in done):
                break
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def fetch(session: Session, request: Any, version: int) -> dict[str, Any]:
    limit = session.services.limits.max_batch_items
    if sum(len(topic.partitions) for topic in request.topics) > limit:
        log.info("kafka: refused a fetch of more than %d partitions from %s", limit, session.peer)
        return _refused(request)
    parts = [
        _Partition(
            topic=topic.topic,
            index=p.partition,
            queue=session.queue(topic.topic, p.partition),
            offset=p.fetch_offset,
            max_bytes=max(p.partition_max_bytes, 1),
            committed_only=getattr(request, "isolation_level", 0) == _READ_COMMITTED,
        )
        for topic in request.topics
        for p in topic.partitions
    ]
    refused = await denied(session, "topic", (p.topic for p in parts), "read")
    async for part in cooperatively(parts):
        if part.topic in refused:
            part.error = ErrorCode.topic_authorization_failed
            continue
        await _read(session, part, 0)
    total = sum(len(p.records) for p in parts)
    wait_ms = ms(request.max_wait)
    failed = any(p.error is not ErrorCode.none for p in parts)
    if total < max(request.min_bytes, 1) and wait_ms > 0 and parts and not failed:
        await _wait_for_any(session, [p for p in parts if not p.records], wait_ms)
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "session_id": 0,
        "responses": _responses(parts, getattr(request, "max_bytes", 0x7FFFFFFF)),
    }


def _refused(request: Any) -> dict[str, Any]:
    """INVALID_REQUEST for every partition of a fetch asking for too many."""
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "session_id": 0,
        "responses": [
            {
                "topic": topic.topic,
                "partitions": [
                    {
                        "partition_index": p.partition,
                        "error_code": ErrorCode.invalid_request,
                        "high_watermark": -1,
                        "last_stable_offset": -1,
                        "log_start_offset": -1,
                        "preferred_read_replica": -1,
                        "records": b"",
                    }
                    for p in topic.partitions
                ],
            }
            for topic in request.topics
        ],
    }


def _responses(parts: list[_Partition], max_bytes: int) -> list[dict[str, Any]]:
    by_topic: dict[str, list[dict[str, Any]]] = {}
    budget = max_bytes
    for part in parts:
        records = part.records
        if records and budget <= 0:
            records = b""  # over the response's max_bytes: the next fetch gets it
        budget -= len(records)
        offsets = part.offsets or QueueOffsets(-1, -1)
        by_topic.setdefault(part.topic, []).append(
            {
                "partition_index": part.index,
                "error_code": part.error,
                "high_watermark": offsets.latest,
                "last_stable_offset": part.last_stable,
                "log_start_offset": offsets.earliest,
                "aborted_transactions": [
                    {"producer_id": r.producer_id, "first_offset": r.first_offset}
                    for r in part.aborted
                ]
                if part.committed_only
                else None,
                "preferred_read_replica": -1,
                "records": records,
            }
        )
    return [{"topic": topic, "partitions": ps} for topic, ps in by_topic.items()]


PartitionAnswer = Callable[[QueueRef, Any], Awaitable[dict[str, Any]]]


async def _by_partition(
    session: Session,
    topics: Any,
    *,
    topic_field: str,
    index_field: str,
    defaults: dict[str, Any],
    answer: PartitionAnswer,
    operation: Operation,
) -> list[dict[str, Any]]:
    """Answer each partition of a request, a storage error becoming its error code,
    a topic the session may not ``operation`` TOPIC_AUTHORIZATION_FAILED."""
    out = []
    for topic in topics:
        name = getattr(topic, topic_field)
        results = []
        allowed = await permitted(session, "topic", name, operation)
        for p in topic.partitions:
            index = getattr(p, index_field)
            result = {**defaults, index_field: index, "error_code": ErrorCode.none}
            if not allowed:
                result["error_code"] = ErrorCode.topic_authorization_failed
                results.append(result)
                continue
            try:
                result.update(await answer(session.queue(name, index), p))
            except (StorageError, AuthError) as e:
                result["error_code"] = error_code(e)
            results.append(result)
        out.append({topic_field: name, "partitions": results})
    return out


async def list_offsets(session: Session, request: Any, version: int) -> dict[str, Any]:
    committed_only = getattr(request, "isolation_level", 0) == _READ_COMMITTED

    async def answer(queue: QueueRef, p: Any) -> dict[str, Any]:
        if committed_only and p.timestamp == _LATEST:
            # Kafka: a read_committed consumer's end is the last stable offset.
            latest = (await session.processor.queue_offsets(session.caller, queue)).latest
            offset = (await partition_transactions(session, queue)).last_stable(latest)
        else:
            offset = await _offset_at(session, queue, p.timestamp)
        return {"offset": offset, "timestamp": p.timestamp if p.timestamp >= 0 else -1}

    topics = await _by_partition(
        session,
        request.topics,
        topic_field="name",
        index_field="partition_index",
        defaults={"timestamp": -1, "offset": -1, "leader_epoch": 0},
        answer=answer,
        operation="describe",
    )
    return {"throttle_time": 0, "topics": topics}


async def _offset_at(session: Session, queue: QueueRef, timestamp: int) -> int:
    if timestamp == _EARLIEST:
        return (await session.processor.queue_offsets(session.caller, queue)).earliest
    if timestamp in (_LATEST, _MAX_TIMESTAMP):
        latest = (await session.processor.queue_offsets(session.caller, queue)).latest
        return latest if timestamp == _LATEST else max(latest - 1, -1)
    return await _offset_for_timestamp(session, queue, timestamp)


async def _offset_for_timestamp(session: Session, queue: QueueRef, timestamp: int) -> int:
    """Storage indexes store time; Kafka asks by record time (the producer's create
    time, normally at or before store time). So records before the storage's answer
    are older, and the first record at or after ``timestamp`` is found by reading on
    from there (up to a bounded scan). -1 when no record is that recent."""
    offset = await session.processor.offset_for_timestamp(session.caller, queue, timestamp)
    latest = (await session.processor.queue_offsets(session.caller, queue)).latest
    scanned = 0
    while offset < latest and scanned < _TIMESTAMP_SCAN_BYTES:
        batches = await session.processor.read_batches(session.caller, queue, offset)
        if not batches:
            break
        for batch in batches:
            for at, stamp in _timestamps(batch):
                if at >= offset and stamp >= timestamp:
                    return at
            scanned += len(batch.raw or b"") or 1
        offset = batches[-1].base_offset + batches[-1].count
    return offset if offset < latest else -1


def _timestamps(batch: StoredBatch) -> list[tuple[int, int]]:
    if batch.format == BATCH_FORMAT and batch.raw is not None:
        return [
            (batch.base_offset + i, m.born_timestamp_ms or batch.store_timestamp_ms)
            for i, m in enumerate(expand_batch(batch.raw))
        ]
    return [(s.offset, s.message.born_timestamp_ms or s.store_timestamp_ms) for s in batch.messages]


async def delete_records(session: Session, request: Any, version: int) -> dict[str, Any]:
    async def answer(queue: QueueRef, p: Any) -> dict[str, Any]:
        before = p.offset
        if before == -1:  # Kafka: up to the high watermark
            before = (await session.processor.queue_offsets(session.caller, queue)).latest
        offsets = await session.processor.delete_records(session.caller, queue, before)
        return {"low_watermark": offsets.earliest}

    topics = await _by_partition(
        session,
        request.topics,
        topic_field="name",
        index_field="partition_index",
        defaults={"low_watermark": -1},
        answer=answer,
        operation="delete",
    )
    return {"throttle_time": 0, "topics": topics}


async def offset_for_leader_epoch(session: Session, request: Any, version: int) -> dict[str, Any]:
    """One leader, epoch 0, forever: every epoch ends at the high watermark."""

    async def answer(queue: QueueRef, p: Any) -> dict[str, Any]:
        offsets = await session.processor.queue_offsets(session.caller, queue)
        return {"end_offset": offsets.latest}

    topics = await _by_partition(
        session,
        request.topics,
        topic_field="topic",
        index_field="partition",
        defaults={"leader_epoch": 0, "end_offset": -1},
        answer=answer,
        operation="describe",
    )
    return {"throttle_time": 0, "topics": topics}
