"""Produce and InitProducerId: each record batch is checked (CRC, shape, producer
sequence) and stored once, raw, as a ``kafka.v2`` batch entry spanning its records'
offsets. All batches of a request share one storage append (one group commit)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.gateway.fairness import cooperatively
from polymq.protocols.kafka.authz import denied, permitted
from polymq.protocols.kafka.errors import coordinator_error, error_code
from polymq.protocols.kafka.handlers.configs import compaction_of
from polymq.protocols.kafka.handlers.transactions import end_transaction
from polymq.protocols.kafka.producers import ProducerRegistry, Verdict
from polymq.protocols.kafka.records import (
    BATCH_FORMAT,
    BatchHeader,
    CorruptBatch,
    check_records,
    parse_header,
)
from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.txn_log import save_transaction, stored_transaction
from polymq.storage.errors import StorageError, StorageUnavailable
from polymq.storage.model import AppendRequest, BatchEntry, QueueRef

__all__ = ["init_producer_id", "produce"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """One partition's part of a produce request."""

    topic: str
    partition: int
    queue: QueueRef
    batches: list[tuple[BatchHeader, bytes]]
    error: ErrorCode = ErrorCode.none
    message: str | None = None
    base_offset: int = -1
    duplicate_offset: int | None = None
    unsettled: bool = False  # storage out of reach: the append may have been stored


def _split(records: bytes | None) -> list[tuple[BatchHeader, bytes]]:
    batches: list[tuple[BatchHeader, bytes]] = []
    view = memoryview(records or b"")
    position = 0
    while position < len(view):
        header = parse_header(view[position:])
        if header.record_count != header.last_offset_delta + 1:
            raise CorruptBatch("record count does not match the last offset delta")
        batch = bytes(view[position : position + header.length])
        check_records(batch)
        batches.append((header, batch))
        position += header.length
    if not batches:
        raise CorruptBatch("no record batch")
    return batches


def _dedup_key(queue: QueueRef, header: BatchHeader) -> str | None:
    if header.producer_id < 0 or header.base_sequence < 0:
        return None
    # The topic is hashed: dedup keys are names, at most 255 bytes; topics reach 249.
    topic = hashlib.blake2b(queue.topic.encode(), digest_size=8).hexdigest()
    return (
        f"kafka:{header.producer_id}:{header.producer_epoch}:"
        f"{topic}:{queue.queue_id}:{header.base_sequence}"
    )


async def produce(session: Session, request: Any, version: int) -> dict[str, Any] | None:
    if request.acks not in (-1, 0, 1):
        return _all_failed(request, ErrorCode.invalid_required_acks)
    limit = session.services.limits.max_batch_items
    if sum(len(t.partition_data) for t in request.topic_data) > limit:
        log.info("kafka: refused a produce of more than %d partitions from %s", limit, session.peer)
        if request.acks == 0:
            return None
        message = f"more than {limit} partitions in one request"
        return _all_failed(request, ErrorCode.invalid_request, message)
    producers = session.services.producers
    pending: list[_Pending] = []
    refused = await denied(session, "topic", (t.name for t in request.topic_data), "write")
    # In slices: checking a partition's batches (CRC over its bytes) is pure CPU, and
    # a request of thousands of partitions must not hold every other connection.
    async for topic, data in cooperatively(
        (t, d) for t in request.topic_data for d in t.partition_data
    ):
        queue = session.queue(topic.name, data.index)
        part = _Pending(topic.name, data.index, queue, [])
        pending.append(part)
        if topic.name in refused:
            part.error = ErrorCode.topic_authorization_failed
            continue
        try:
            part.batches = _split(data.records)
        except CorruptBatch as e:
            part.error, part.message = ErrorCode.corrupt_message, str(e)
            continue
        first = part.batches[0][0]
        if first.producer_id >= 0 and first.base_sequence >= 0:
            count = sum(h.record_count for h, _ in part.batches)
            check = producers.check(
                first.producer_id, first.producer_epoch, queue, first.base_sequence, count
            )
            if check.verdict is Verdict.DUPLICATE:
                part.duplicate_offset = check.offset
            elif check.verdict is Verdict.OUT_OF_ORDER:
                part.error = ErrorCode.out_of_order_sequence_number
            elif check.verdict is Verdict.FENCED:
                part.error = ErrorCode.invalid_producer_epoch
            elif check.verdict is Verdict.UNSETTLED:
                part.error = ErrorCode.kafka_storage_error
                part.message = "an earlier batch of this producer is not settled yet"
    requests: list[AppendRequest] = []
    owners: list[_Pending] = []
    for part in pending:
        if part.error is not ErrorCode.none or part.duplicate_offset is not None:
            continue
        for header, raw in part.batches:
            entry = BatchEntry(format=BATCH_FORMAT, raw=raw, count=header.record_count)
            # acks=all waits for the fsync; acks=0 and acks=1 (the leader's write) do not.
            requests.append(
                AppendRequest(
                    entry=entry,
                    queues=(part.queue,),
                    dedup_key=_dedup_key(part.queue, header),
                    durable=request.acks == -1,
                )
            )
            owners.append(part)
    if requests:
        await _append(session, requests, owners)
    for part in pending:
        _remember(producers, part)
    await _poke_compactor(session, pending)
    if request.acks == 0:
        return None
    return {"responses": _responses(pending), "throttle_time": 0}


def _remember(producers: ProducerRegistry, part: _Pending) -> None:
    """Tell the producer registry how a partition's batches ended."""
    if part.duplicate_offset is not None:
        part.base_offset = part.duplicate_offset
        return
    if not part.batches:
        return
    first = part.batches[0][0]
    if first.producer_id < 0 or first.base_sequence < 0:
        return
    count = sum(h.record_count for h, _ in part.batches)
    if part.error is ErrorCode.none:
        producers.record(
            first.producer_id,
            first.producer_epoch,
            part.queue,
            first.base_sequence,
            count,
            part.base_offset,
        )
    elif part.unsettled:
        producers.unsettle(
            first.producer_id, first.producer_epoch, part.queue, first.base_sequence, count
        )
        # Kafka's "may have been written": clients retry the batch as it was, where
        # KAFKA_STORAGE_ERROR would tell them it was not stored.
        part.error = ErrorCode.request_timed_out


async def _poke_compactor(session: Session, pending: list[_Pending]) -> None:
    async for part in cooperatively(pending):
        if part.error is ErrorCode.none and part.batches:
            retention = await compaction_of(session, part.topic)
            if retention is not None:
                session.services.compactor.poke(session.caller, part.queue, retention)


async def _append(session: Session, requests: list[AppendRequest], owners: list[_Pending]) -> None:
    """Store the batches; durable ones are answered once fsynced, but the connection
    reads and stores its next request meanwhile (``Session.answer_after``)."""
    try:
        results, durable = await session.processor.append_visible(session.caller, requests)
        if durable is not None:
            session.answer_after.append(durable)
    except (StorageError, AuthError) as e:
        # One bad partition (unknown topic, too large) fails the whole call: store
        # each partition alone so the others still get through.
        parts = list({id(o): o for o in owners}.values())
        if len(parts) == 1:
            parts[0].error, parts[0].message = error_code(e), str(e)
            parts[0].unsettled = isinstance(e, StorageUnavailable)
            return
        for part in parts:
            mine = [r for r, o in zip(requests, owners, strict=True) if o is part]
            await _append(session, mine, [part] * len(mine))
        return
    for part, result in zip(owners, results, strict=True):
        if result.placements and part.base_offset < 0:
            part.base_offset = result.placements[0].offset


def _all_failed(request: Any, error: ErrorCode, message: str | None = None) -> dict[str, Any]:
    parts = [
        _Pending(t.name, d.index, QueueRef("", t.name, d.index), [], error, message)
        for t in request.topic_data
        for d in t.partition_data
    ]
    return {"responses": _responses(parts), "throttle_time": 0}


def _responses(pending: list[_Pending]) -> list[dict[str, Any]]:
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for part in pending:
        by_topic.setdefault(part.topic, []).append(
            {
                "index": part.partition,
                "error_code": part.error,
                "error_message": part.message,
                "base_offset": part.base_offset if part.error is ErrorCode.none else -1,
                "log_start_offset": -1,
                "record_errors": [],
            }
        )
    return [{"name": name, "partition_responses": parts} for name, parts in by_topic.items()]


async def init_producer_id(session: Session, request: Any, version: int) -> dict[str, Any]:
    """A transactional id keeps its producer id with a new epoch; a transaction the
    previous instance left open is aborted first, as Kafka does."""
    transactional_id = request.transactional_id
    if not transactional_id:
        return _producer_answer(ErrorCode.none, *session.services.producers.init_producer(None))
    if not await permitted(session, "transactional_id", transactional_id, "write"):
        return _producer_answer(ErrorCode.transactional_id_authorization_failed)
    if not session.owns(transactional_id):
        return _producer_answer(ErrorCode.not_coordinator)
    try:
        await _abort_left_open(session, transactional_id)
        producer_id, epoch = session.services.producers.init_producer(transactional_id)
        transactions = session.services.transactions
        transactions.begin(session.namespace, transactional_id, producer_id, epoch)
        txn = transactions.get(session.namespace, transactional_id)
        assert txn is not None
        await save_transaction(session, txn)  # for a coordinator taking the id over
    except (StorageError, AuthError) as e:
        return _producer_answer(coordinator_error(e))
    return _producer_answer(ErrorCode.none, producer_id, epoch)


def _producer_answer(error: ErrorCode, producer_id: int = -1, epoch: int = -1) -> dict[str, Any]:
    return {
        "throttle_time": 0,
        "error_code": error,
        "producer_id": producer_id,
        "producer_epoch": epoch,
    }


async def _abort_left_open(session: Session, transactional_id: str) -> None:
    """Abort what the id's previous instance left open: known here if this gateway
    coordinated it, else as stored by the coordinator that did (a restart, or the id
    moved here from a gateway that left)."""
    previous = session.services.transactions.get(session.namespace, transactional_id)
    if previous is None:
        previous = await stored_transaction(session, transactional_id)
    if previous is not None:
        await end_transaction(session, previous, commit=False)
