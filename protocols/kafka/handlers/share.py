"""ShareGroupHeartbeat, ShareFetch and ShareAcknowledge (KIP-932) over the storage's
pop mode: see protocols/kafka/share_groups.py."""

from __future__ import annotations

import contextlib
import uuid
from collections import defaultdict
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.protocols.kafka.authz import denied, permitted
from polymq.protocols.kafka.codec import ms
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.kafka.handlers.consumer_group import (
    group_denied,
    group_described,
    group_not_described,
)
from polymq.protocols.kafka.handlers.fetch import encode_messages
from polymq.protocols.kafka.handlers.topics import topic_names, topic_partitions
from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.share_groups import HEARTBEAT_INTERVAL_MS, LOCK_MS, AckType
from polymq.storage.errors import StorageError
from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["share_acknowledge", "share_fetch", "share_group_describe", "share_group_heartbeat"]

_LEAVE_EPOCH = -1
_CLOSE_SESSION = -1
_DEFAULT_MAX_RECORDS = 500


async def share_group_heartbeat(session: Session, request: Any, version: int) -> dict[str, Any]:
    groups = session.services.share_groups
    namespace, group = session.namespace, request.group_id
    member_id = request.member_id or str(uuid.uuid4())
    if not await permitted(session, "group", group, "read"):
        return {"error_code": ErrorCode.group_authorization_failed, "member_id": member_id}
    if not session.owns(group):
        return {"error_code": ErrorCode.not_coordinator, "member_id": member_id}
    if request.member_epoch == _LEAVE_EPOCH:
        await _release(session, group, groups.leave(namespace, group, member_id))
        return {"error_code": ErrorCode.none, "member_id": member_id, "member_epoch": -1}
    if request.member_epoch != 0 and not groups.is_member(namespace, group, member_id):
        return {"error_code": ErrorCode.unknown_member_id, "member_id": member_id}
    names = request.subscribed_topic_names
    epoch, subscription = groups.join_or_update(
        namespace,
        group,
        member_id,
        tuple(names) if names is not None else None,
        (session.client_id or "", session.peer),
    )
    partitions, ids = await topic_partitions(session, set(subscription))
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "member_id": member_id,
        "member_epoch": epoch,
        "heartbeat_interval": HEARTBEAT_INTERVAL_MS,
        "assignment": {
            "topic_partitions": [
                {"topic_id": ids[name], "partitions": list(range(count))}
                for name, count in sorted(partitions.items())
            ]
        },
    }


async def share_group_describe(session: Session, request: Any, version: int) -> dict[str, Any]:
    """Members, their subscriptions and assignments (every partition of what they
    subscribe to: every member shares every partition)."""
    described = []
    for group_id in request.group_ids:
        if not await permitted(session, "group", group_id, "describe"):
            described.append(group_denied(group_id))
            continue
        found = session.services.share_groups.describe(session.namespace, group_id)
        if (refused := group_not_described(session, group_id, found)) is not None:
            described.append(refused)
            continue
        assert found is not None
        epoch, members = found
        partitions, ids = await topic_partitions(
            session, {t for topics, _ in members.values() for t in topics}
        )
        rows = [
            {
                "member_id": member_id,
                "member_epoch": epoch,
                "client_id": client_id,
                "client_host": client_host,
                "subscribed_topic_names": list(topics),
                "assignment": _assignment(topics, partitions, ids),
            }
            for member_id, (topics, (client_id, client_host)) in sorted(members.items())
        ]
        described.append(group_described(group_id, epoch, "simple", rows))
    return {"throttle_time": 0, "groups": described}


def _assignment(
    topics: tuple[str, ...], partitions: dict[str, int], ids: dict[str, uuid.UUID]
) -> dict[str, Any]:
    return {
        "topic_partitions": [
            {"topic_id": ids[t], "topic_name": t, "partitions": list(range(partitions[t]))}
            for t in topics
            if t in partitions
        ]
    }


async def _release(session: Session, group: str, receipts: list[str]) -> None:
    for receipt in receipts:
        with contextlib.suppress(StorageError):  # acked or redelivered meanwhile
            await session.processor.nack(session.caller, group, receipt)


async def _acknowledge(
    session: Session, group: str, member_id: str, queue: QueueRef, batches: Any
) -> ErrorCode:
    """Apply one partition's acknowledgement batches; the first error, if any."""
    shares = session.services.share_groups
    accepted: list[str] = []
    error = ErrorCode.none
    for batch in batches:
        types = batch.acknowledge_types
        for i, offset in enumerate(range(batch.first_offset, batch.last_offset + 1)):
            kind = AckType(types[i] if len(types) > 1 else types[0])
            if kind is AckType.GAP:
                continue
            receipt = shares.take(session.namespace, group, member_id, (queue, offset))
            if receipt is None:
                error = ErrorCode.invalid_record_state
                continue
            try:
                if kind is AckType.ACCEPT:
                    accepted.append(receipt)
                elif kind is AckType.RELEASE:
                    await session.processor.nack(session.caller, group, receipt)
                else:
                    await session.processor.dead_letter(session.caller, group, receipt)
            except (StorageError, AuthError):
                error = ErrorCode.invalid_record_state  # the lock ran out meanwhile
    if accepted:
        results = await session.processor.ack_many(session.caller, group, accepted)
        if any(r is not None for r in results):
            error = ErrorCode.invalid_record_state
    return error


async def _partitions(session: Session, topics: Any) -> list[tuple[Any, str | None, Any]]:
    """(topic id, topic name or None if unknown, partition request) per partition."""
    names = await topic_names(session, {t.topic_id for t in topics if t.topic_id is not None})
    return [
        (t.topic_id, names.get(t.topic_id) if t.topic_id is not None else None, p)
        for t in topics
        for p in t.partitions
    ]


def _empty_result(index: int) -> dict[str, Any]:
    return {
        "partition_index": index,
        "error_code": ErrorCode.none,
        "acknowledge_error_code": ErrorCode.none,
        "current_leader": {"leader_id": -1, "leader_epoch": -1},
        "records": b"",
        "acquired_records": [],
    }


async def share_fetch(session: Session, request: Any, version: int) -> dict[str, Any]:
    group, member_id = request.group_id or "", request.member_id or ""
    shares = session.services.share_groups
    namespace = session.namespace
    # Members are known to the group's coordinator only; clients fetch from each
    # partition's leader, so another gateway serves the member's share session as is
    # (what it acquires is locked in storage, and released when the lock runs out).
    if not await permitted(session, "group", group, "read"):
        return {
            "error_code": ErrorCode.group_authorization_failed,
            "acquisition_lock_timeout": LOCK_MS,
        }
    if session.owns(group) and not shares.is_member(namespace, group, member_id):
        return {"error_code": ErrorCode.unknown_member_id, "acquisition_lock_timeout": LOCK_MS}
    results: dict[tuple[Any, int], dict[str, Any]] = {}
    partitions = await _partitions(session, request.topics)
    refused = await denied(session, "topic", (n for _, n, _ in partitions if n is not None), "read")
    for tid, name, p in partitions:
        result = results[(tid, p.partition_index)] = _empty_result(p.partition_index)
        if name is None:
            result["error_code"] = ErrorCode.unknown_topic_id
        elif name in refused:
            result["error_code"] = ErrorCode.topic_authorization_failed
        elif p.acknowledgement_batches:
            queue = session.queue(name, p.partition_index)
            result["acknowledge_error_code"] = await _acknowledge(
                session, group, member_id, queue, p.acknowledgement_batches
            )
    if request.share_session_epoch == _CLOSE_SESSION:
        shares.close_session(namespace, group, member_id)
        await _release(session, group, shares.release_all(namespace, group, member_id))
    else:
        covered = shares.session_partitions(
            namespace,
            group,
            member_id,
            request.share_session_epoch,
            {(t.topic_id, p.partition_index) for t in request.topics for p in t.partitions},
            {(t.topic_id, index) for t in request.forgotten_topics_data for index in t.partitions},
        )
        names = await topic_names(session, {tid for tid, _ in covered if tid is not None})
        refused |= await denied(session, "topic", names.values(), "read")
        queues = {
            session.queue(names[tid], index): (tid, index)
            for tid, index in covered
            if tid in names and names[tid] not in refused
        }
        if queues:
            await _acquire(session, group, member_id, queues, request, results)
    by_topic: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for (tid, _), result in results.items():
        by_topic[tid].append(result)
    me = session.cluster.me
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "acquisition_lock_timeout": LOCK_MS,
        "responses": [{"topic_id": t, "partitions": ps} for t, ps in by_topic.items()],
        "node_endpoints": [{"node_id": me.node_id, "host": me.host, "port": me.port, "rack": None}],
    }


async def _acquire(
    session: Session,
    group: str,
    member_id: str,
    queues: dict[QueueRef, tuple[Any, int]],
    request: Any,
    results: dict[tuple[Any, int], dict[str, Any]],
) -> None:
    """Pop records for the member (a long poll over all its partitions) and frame
    them as record batches plus the acquired ranges with their delivery counts."""
    try:
        popped = await session.processor.pop(
            session.caller,
            group,
            list(queues),
            max_messages=request.max_records if request.max_records > 0 else _DEFAULT_MAX_RECORDS,
            invisible_ms=LOCK_MS,
            wait_ms=ms(request.max_wait),
        )
    except (StorageError, AuthError) as e:
        for queue, key in queues.items():
            result = results.setdefault(key, _empty_result(queue.queue_id))
            result["error_code"] = error_code(e)
        return
    by_queue: dict[QueueRef, list[StoredMessage]] = defaultdict(list)
    for message in popped:
        assert message.receipt is not None
        record = (message.queue, message.offset)
        session.services.share_groups.acquired(
            session.namespace, group, member_id, record, message.receipt
        )
        by_queue[message.queue].append(message)
    for queue, messages in by_queue.items():
        result = results.setdefault(queues[queue], _empty_result(queue.queue_id))
        messages.sort(key=lambda m: m.offset)
        result["records"] = encode_messages(messages)
        result["acquired_records"] = _ranges(messages)


def _ranges(messages: list[StoredMessage]) -> list[dict[str, Any]]:
    """Contiguous offsets with one delivery count, as KIP-932's AcquiredRecords."""
    ranges: list[dict[str, Any]] = []
    for m in messages:
        last = ranges[-1] if ranges else None
        if (
            last is not None
            and last["last_offset"] + 1 == m.offset
            and last["delivery_count"] == m.delivery_attempt
        ):
            last["last_offset"] = m.offset
        else:
            ranges.append(
                {
                    "first_offset": m.offset,
                    "last_offset": m.offset,
                    "delivery_count": m.delivery_attempt,
                }
            )
    return ranges


async def share_acknowledge(session: Session, request: Any, version: int) -> dict[str, Any]:
    group, member_id = request.group_id or "", request.member_id or ""
    if not await permitted(session, "group", group, "read"):
        return {"throttle_time": 0, "error_code": ErrorCode.group_authorization_failed}
    shares = session.services.share_groups
    by_topic: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for tid, name, p in await _partitions(session, request.topics):
        code = ErrorCode.unknown_topic_id
        if name is not None:
            queue = session.queue(name, p.partition_index)
            code = await _acknowledge(session, group, member_id, queue, p.acknowledgement_batches)
        by_topic[tid].append(
            {
                "partition_index": p.partition_index,
                "error_code": code,
                "current_leader": {"leader_id": -1, "leader_epoch": -1},
            }
        )
    if request.share_session_epoch == _CLOSE_SESSION:
        await _release(session, group, shares.release_all(session.namespace, group, member_id))
    me = session.cluster.me
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "responses": [{"topic_id": t, "partitions": ps} for t, ps in by_topic.items()],
        "node_endpoints": [{"node_id": me.node_id, "host": me.host, "port": me.port, "rack": None}],
    }
