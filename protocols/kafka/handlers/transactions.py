"""AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit and EndTxn: the transaction
coordinator's side of KIP-98 (the state lives in protocols/kafka/transactions.py, in
the memory of the gateway owning the transactional id; others answer NOT_COORDINATOR).
What partition leaders need (open transactions, aborted ranges) goes to storage
(protocols/kafka/txn_log.py): AddPartitionsToTxn opens the transaction on its new
partitions before answering, EndTxn writes the markers and then settles each partition.

TxnOffsetCommit goes to the *group's* coordinator, which may be another gateway than
the transaction's. That gateway cannot see the transaction, so it parks the offsets in
storage (metadata kind ``kafka.txn_offsets``, under the transactional id, tagged with
producer id and epoch); EndTxn at the transaction's gateway takes them back and commits
those of its producer id and epoch, or drops them on abort."""

from __future__ import annotations

import asyncio
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.protocols.kafka.authz import denied, permitted
from polymq.protocols.kafka.errors import coordinator_error
from polymq.protocols.kafka.records import BATCH_FORMAT, encode_control_batch
from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.transactions import PendingOffset, Transaction
from polymq.protocols.kafka.txn_log import (
    forget_transaction,
    join_partitions,
    settle_partition,
    stored_transaction,
)
from polymq.storage.errors import StorageError
from polymq.storage.model import AppendRequest, BatchEntry, QueueRef

__all__ = [
    "add_offsets_to_txn",
    "add_partitions_to_txn",
    "end_transaction",
    "end_txn",
    "txn_offset_commit",
]

_PARKED_KIND = "kafka.txn_offsets"


async def _transaction(
    session: Session, transactional_id: str, producer_id: int, epoch: int
) -> tuple[Transaction | None, ErrorCode]:
    if not await permitted(session, "transactional_id", transactional_id, "write"):
        return None, ErrorCode.transactional_id_authorization_failed
    if not session.owns(transactional_id):
        return None, ErrorCode.not_coordinator
    state = session.services.transactions
    txn = state.get(session.namespace, transactional_id)
    if txn is None:
        # Begun at another coordinator (the gateway list changed since): carry on
        # from what it stored, as Kafka's coordinators do from the transaction log.
        try:
            txn = await stored_transaction(session, transactional_id)
        except (StorageError, AuthError) as e:
            return None, coordinator_error(e)
        if txn is not None and txn.producer_id == producer_id:
            state.adopt(session.namespace, txn)
    if txn is None or txn.producer_id != producer_id:
        return None, ErrorCode.invalid_producer_id_mapping
    if txn.epoch != epoch:
        return None, ErrorCode.invalid_producer_epoch
    return txn, ErrorCode.none


async def add_partitions_to_txn(session: Session, request: Any, version: int) -> dict[str, Any]:
    txn, code = await _transaction(
        session,
        request.v3_and_below_transactional_id,
        request.v3_and_below_producer_id,
        request.v3_and_below_producer_epoch,
    )
    queues = [
        session.queue(topic.name, index)
        for topic in request.v3_and_below_topics
        for index in topic.partitions
    ]
    names = [topic.name for topic in request.v3_and_below_topics]
    refused = await denied(session, "topic", names, "write") if txn is not None else set()
    if refused:
        # Kafka: nothing is added, the refused topics say why, the others that they
        # were not attempted.
        txn, code = None, ErrorCode.operation_not_attempted
    if txn is not None:
        try:
            await join_partitions(session, txn, queues)
            txn.partitions.update(queues)
        except (StorageError, AuthError) as e:
            code = coordinator_error(e)
    results = []
    for topic in request.v3_and_below_topics:
        mine = ErrorCode.topic_authorization_failed if topic.name in refused else code
        parts = [
            {"partition_index": index, "partition_error_code": mine} for index in topic.partitions
        ]
        results.append({"name": topic.name, "results_by_partition": parts})
    return {"throttle_time": 0, "results_by_topic_v3_and_below": results}


async def add_offsets_to_txn(session: Session, request: Any, version: int) -> dict[str, Any]:
    _, code = await _transaction(
        session, request.transactional_id, request.producer_id, request.producer_epoch
    )
    if code is ErrorCode.none and not await permitted(session, "group", request.group_id, "read"):
        code = ErrorCode.group_authorization_failed
    return {"throttle_time": 0, "error_code": code}


async def txn_offset_commit(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        txn, code = None, ErrorCode.group_authorization_failed
    elif not session.owns(request.group_id):
        txn, code = None, ErrorCode.not_coordinator
    elif not session.owns(request.transactional_id):
        return await _park_offsets(session, request)
    else:
        txn, code = await _transaction(
            session, request.transactional_id, request.producer_id, request.producer_epoch
        )
    topics = []
    for topic in request.topics:
        parts = []
        for p in topic.partitions:
            if txn is not None:
                queue = session.queue(topic.name, p.partition_index)
                metadata = p.committed_metadata or ""
                txn.offsets.append(
                    PendingOffset(request.group_id, queue, p.committed_offset, metadata)
                )
            parts.append({"partition_index": p.partition_index, "error_code": code})
        topics.append({"name": topic.name, "partitions": parts})
    return {"throttle_time": 0, "topics": topics}


async def _park_offsets(session: Session, request: Any) -> dict[str, Any]:
    """The group's gateway, not the transaction's: keep the offsets in storage until
    EndTxn decides (see the module docstring)."""
    code = ErrorCode.none
    parked = [
        [
            request.producer_id,
            request.producer_epoch,
            request.group_id,
            topic.name,
            p.partition_index,
            p.committed_offset,
            p.committed_metadata or "",
        ]
        for topic in request.topics
        for p in topic.partitions
    ]
    try:
        earlier = await session.processor.meta_get(
            session.caller, _PARKED_KIND, request.transactional_id
        )
        await session.processor.meta_put(
            session.caller, _PARKED_KIND, request.transactional_id, [*(earlier or []), *parked]
        )
    except (StorageError, AuthError) as e:
        code = coordinator_error(e)
    topics = [
        {
            "name": topic.name,
            "partitions": [
                {"partition_index": p.partition_index, "error_code": code} for p in topic.partitions
            ],
        }
        for topic in request.topics
    ]
    return {"throttle_time": 0, "topics": topics}


async def _unpark_offsets(session: Session, txn: Transaction) -> list[PendingOffset]:
    """Offsets another gateway parked for this transaction (its producer id and
    epoch); the parked list is cleared either way."""
    parked = await session.processor.meta_get(session.caller, _PARKED_KIND, txn.transactional_id)
    if not parked:
        return []
    await session.processor.meta_delete(session.caller, _PARKED_KIND, txn.transactional_id)
    return [
        PendingOffset(group, QueueRef(session.namespace, topic, partition), offset, metadata)
        for producer_id, epoch, group, topic, partition, offset, metadata in parked
        if producer_id == txn.producer_id and epoch == txn.epoch
    ]


async def end_txn(session: Session, request: Any, version: int) -> dict[str, Any]:
    txn, code = await _transaction(
        session, request.transactional_id, request.producer_id, request.producer_epoch
    )
    if txn is not None:
        try:
            await end_transaction(session, txn, commit=request.committed)
        except (StorageError, AuthError) as e:
            code = coordinator_error(e)
    return {"throttle_time": 0, "error_code": code}


async def end_transaction(session: Session, txn: Transaction, *, commit: bool) -> None:
    """Write the markers, settle each partition in storage, commit the offsets sent
    with it. Raises on a storage error; the client retries EndTxn, which writes the
    markers again (a marker with no open transaction is ignored by readers)."""
    queues = sorted(txn.partitions | txn.first_offsets.keys(), key=str)
    if queues:
        marker = encode_control_batch(
            txn.producer_id,
            txn.epoch,
            commit=commit,
            timestamp_ms=session.processor.clock.now_ms(),
        )
        entry = BatchEntry(format=BATCH_FORMAT, raw=marker, count=1)
        requests = [AppendRequest(entry=entry, queues=(queue,)) for queue in queues]
        results = await session.processor.append(session.caller, requests)
        await asyncio.gather(
            *(
                settle_partition(
                    session,
                    txn,
                    queue,
                    result.placements[0].offset if result.placements else -1,
                    commit=commit,
                )
                for queue, result in zip(queues, results, strict=True)
            )
        )
    await forget_transaction(session, txn)
    offsets = [*txn.offsets, *await _unpark_offsets(session, txn)]
    if commit:
        for pending in offsets:
            await session.processor.commit_offset(
                session.caller, pending.group, pending.queue, pending.offset, pending.metadata
            )
    txn.partitions.clear()
    txn.offsets.clear()
