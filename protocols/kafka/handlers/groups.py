"""FindCoordinator, the classic group protocol, committed offsets and group
administration. Membership is the coordinator's (its gateway's memory), so a group's
requests reaching another gateway get NOT_COORDINATOR (protocols/kafka/cluster.py);
offsets are committed to storage through the processor, so any gateway reads them."""

from __future__ import annotations

from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.protocols.kafka.authz import denied, permitted
from polymq.protocols.kafka.codec import ms
from polymq.protocols.kafka.coordinator import GroupState
from polymq.protocols.kafka.errors import coordinator_error
from polymq.protocols.kafka.group_log import adopt_group, save_group
from polymq.protocols.kafka.session import Session
from polymq.storage.errors import StorageError, StorageUnavailable

# Kafka's group.min.session.timeout.ms is 6 s; a little lower lets tests run fast.
_MIN_SESSION_MS = 1_000
_MAX_SESSION_MS = 1_800_000  # group.max.session.timeout.ms

__all__ = [
    "delete_groups",
    "describe_groups",
    "find_coordinator",
    "heartbeat",
    "join_group",
    "leave_group",
    "list_groups",
    "offset_commit",
    "offset_delete",
    "offset_fetch",
    "sync_group",
]


_NOT_COORDINATOR = ErrorCode.not_coordinator
_GROUP_DENIED = ErrorCode.group_authorization_failed
_TRANSACTION_KEY = 1  # FindCoordinator's key_type of a transactional id


async def find_coordinator(session: Session, request: Any, version: int) -> dict[str, Any]:
    """The gateway owning each key (group or transactional id alike) among the live
    gateways; v4 on asks for many keys at once."""
    cluster = session.cluster
    if version >= 4:
        coordinators = []
        for key in request.coordinator_keys:
            node = cluster.owner(key)
            coordinators.append(
                {
                    "key": key,
                    "node_id": node.node_id,
                    "host": node.host,
                    "port": node.port,
                    "error_code": await _key_denied(session, request.key_type, key),
                    "error_message": None,
                }
            )
        return {"throttle_time": 0, "coordinators": coordinators}
    node = cluster.owner(request.key)
    return {
        "throttle_time": 0,
        "error_code": await _key_denied(session, getattr(request, "key_type", 0), request.key),
        "error_message": None,
        "node_id": node.node_id,
        "host": node.host,
        "port": node.port,
    }


async def _key_denied(session: Session, key_type: int, key: str) -> ErrorCode:
    """FindCoordinator's answer for a key the session may not describe (Kafka's
    GROUP_/TRANSACTIONAL_ID_AUTHORIZATION_FAILED), else NONE."""
    if key_type == _TRANSACTION_KEY:
        if not await permitted(session, "transactional_id", key, "describe"):
            return ErrorCode.transactional_id_authorization_failed
    elif not await permitted(session, "group", key, "describe"):
        return ErrorCode.group_authorization_failed
    return ErrorCode.none


async def join_group(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        return {"throttle_time": 0, "error_code": _GROUP_DENIED, "member_id": request.member_id}
    if not session.owns(request.group_id):
        return {"throttle_time": 0, "error_code": _NOT_COORDINATOR, "member_id": request.member_id}
    session_ms = ms(request.session_timeout)
    if not _MIN_SESSION_MS <= session_ms <= _MAX_SESSION_MS:
        return {"throttle_time": 0, "error_code": ErrorCode.invalid_session_timeout}
    rebalance = getattr(request, "rebalance_timeout", None)
    result = await session.services.coordinator.join(
        session.namespace,
        request.group_id,
        member_id=request.member_id,
        group_instance_id=getattr(request, "group_instance_id", None),
        client_id=session.client_id or "",
        client_host=session.peer,
        session_timeout_ms=session_ms,
        rebalance_timeout_ms=ms(rebalance) if rebalance is not None else session_ms,
        protocol_type=request.protocol_type,
        protocols=[(p.name, p.metadata) for p in request.protocols],
    )
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "generation_id": result.generation,
        "protocol_type": result.protocol_type,
        "protocol_name": result.protocol_name or "",
        "leader": result.leader,
        "member_id": result.member_id,
        "members": [
            {
                "member_id": m.member_id,
                "group_instance_id": m.group_instance_id,
                "metadata": m.metadata,
            }
            for m in result.members
        ],
    }


async def sync_group(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        return {"throttle_time": 0, "error_code": _GROUP_DENIED}
    if not session.owns(request.group_id):
        return {"throttle_time": 0, "error_code": _NOT_COORDINATOR}
    await adopt_group(session, request.group_id, request.member_id)
    result = await session.services.coordinator.sync(
        session.namespace,
        request.group_id,
        member_id=request.member_id,
        generation=request.generation_id,
        assignments={a.member_id: a.assignment for a in request.assignments},
    )
    if result.error is ErrorCode.none and request.assignments:
        await save_group(session, request.group_id)  # the leader's sync: a new generation
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "protocol_type": result.protocol_type,
        "protocol_name": result.protocol_name,
        "assignment": result.assignment,
    }


async def heartbeat(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        return {"throttle_time": 0, "error_code": _GROUP_DENIED}
    if not session.owns(request.group_id):
        return {"throttle_time": 0, "error_code": _NOT_COORDINATOR}
    await adopt_group(session, request.group_id, request.member_id)
    error = session.services.coordinator.heartbeat(
        session.namespace, request.group_id, request.member_id, request.generation_id
    )
    return {"throttle_time": 0, "error_code": error}


async def leave_group(session: Session, request: Any, version: int) -> dict[str, Any]:
    coordinator = session.services.coordinator
    if not await permitted(session, "group", request.group_id, "read"):
        return {"throttle_time": 0, "error_code": _GROUP_DENIED, "members": []}
    if not session.owns(request.group_id):
        return {"throttle_time": 0, "error_code": _NOT_COORDINATOR, "members": []}
    if version < 3:
        error = coordinator.leave(session.namespace, request.group_id, request.member_id)
        return {"throttle_time": 0, "error_code": error}
    members = [
        {
            "member_id": m.member_id,
            "group_instance_id": m.group_instance_id,
            "error_code": coordinator.leave(session.namespace, request.group_id, m.member_id),
        }
        for m in request.members
    ]
    return {"throttle_time": 0, "error_code": ErrorCode.none, "members": members}


async def offset_commit(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        check = _GROUP_DENIED
    elif not session.owns(request.group_id):
        check = _NOT_COORDINATOR
    elif session.services.consumer_groups.is_consumer_group(session.namespace, request.group_id):
        check = session.services.consumer_groups.check_commit(
            session.namespace, request.group_id, request.member_id
        )
    else:
        await adopt_group(session, request.group_id, request.member_id)
        check = session.services.coordinator.check_commit(
            session.namespace,
            request.group_id,
            request.member_id,
            request.generation_id_or_member_epoch,
        )
    topics = []
    refused = await denied(session, "topic", (t.name for t in request.topics), "read")
    for topic in request.topics:
        results = []
        for p in topic.partitions:
            code = check
            if code is ErrorCode.none and topic.name in refused:
                code = ErrorCode.topic_authorization_failed
            if code is ErrorCode.none:
                try:
                    await session.processor.commit_offset(
                        session.caller,
                        request.group_id,
                        session.queue(topic.name, p.partition_index),
                        p.committed_offset,
                        p.committed_metadata or "",
                    )
                except (StorageError, AuthError) as e:
                    code = coordinator_error(e)
            results.append({"partition_index": p.partition_index, "error_code": code})
        topics.append({"name": topic.name, "partitions": results})
    return {"throttle_time": 0, "topics": topics}


async def offset_fetch(session: Session, request: Any, version: int) -> dict[str, Any]:
    """v8 on asks for many groups at once; before, for one. Storage out of reach is
    the group's error (clients retry COORDINATOR_NOT_AVAILABLE there, not per
    partition)."""
    if version >= 8:
        groups = []
        for g in request.groups:
            if not await permitted(session, "group", g.group_id, "describe"):
                groups.append({"group_id": g.group_id, "error_code": _GROUP_DENIED})
                continue
            try:
                topics = await _group_offsets(session, g.group_id, g.topics)
            except StorageUnavailable as e:
                groups.append({"group_id": g.group_id, "error_code": coordinator_error(e)})
            else:
                groups.append(
                    {"group_id": g.group_id, "topics": topics, "error_code": ErrorCode.none}
                )
        return {"throttle_time": 0, "groups": groups}
    if not await permitted(session, "group", request.group_id, "describe"):
        return {"throttle_time": 0, "topics": [], "error_code": _GROUP_DENIED}
    try:
        topics = await _group_offsets(session, request.group_id, request.topics)
    except StorageUnavailable as e:
        return {"throttle_time": 0, "topics": [], "error_code": coordinator_error(e)}
    return {"throttle_time": 0, "topics": topics, "error_code": ErrorCode.none}


async def _group_offsets(session: Session, group: str, requested: Any) -> list[dict[str, Any]]:
    wanted: list[tuple[str, list[int]]]
    if requested is None:
        committed = await session.processor.list_group_offsets(session.caller, group)
        by_topic: dict[str, list[int]] = {}
        for queue in committed:
            by_topic.setdefault(queue.topic, []).append(queue.queue_id)
        wanted = sorted(by_topic.items())
    else:
        wanted = [(t.name, list(t.partition_indexes)) for t in requested]
    topics = []
    for name, partitions in wanted:
        results = []
        for index in sorted(partitions):
            result: dict[str, Any] = {
                "partition_index": index,
                "committed_offset": -1,
                "committed_leader_epoch": -1,
                "metadata": "",
                "error_code": ErrorCode.none,
            }
            try:
                found = await session.processor.fetch_offset(
                    session.caller, group, session.queue(name, index)
                )
            except StorageUnavailable:
                raise
            except (StorageError, AuthError) as e:
                if coordinator_error(e) is not ErrorCode.unknown_topic_or_partition:
                    result["error_code"] = coordinator_error(e)
            else:
                if found is not None:
                    result.update(committed_offset=found.offset, metadata=found.metadata)
            results.append(result)
        topics.append({"name": name, "partitions": results})
    return topics


async def offset_delete(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "delete"):
        return {"throttle_time": 0, "error_code": _GROUP_DENIED, "topics": []}
    if not session.owns(request.group_id):
        return {"throttle_time": 0, "error_code": _NOT_COORDINATOR, "topics": []}
    coordinator = session.services.coordinator
    described = coordinator.describe(session.namespace, request.group_id)
    busy = described is not None and described[0] is not GroupState.EMPTY
    topics = []
    for topic in request.topics:
        results = []
        for p in topic.partitions:
            code = ErrorCode.group_subscribed_to_topic if busy else ErrorCode.none
            if not busy:
                try:
                    queue = session.queue(topic.name, p.partition_index)
                    await session.processor.delete_group_offsets(
                        session.caller, request.group_id, [queue]
                    )
                except (StorageError, AuthError) as e:
                    code = coordinator_error(e)
            results.append({"partition_index": p.partition_index, "error_code": code})
        topics.append({"name": topic.name, "partitions": results})
    return {"throttle_time": 0, "error_code": ErrorCode.none, "topics": topics}


async def describe_groups(session: Session, request: Any, version: int) -> dict[str, Any]:
    coordinator = session.services.coordinator
    groups = []
    for group_id in request.groups:
        if not await permitted(session, "group", group_id, "describe"):
            groups.append({"error_code": _GROUP_DENIED, "group_id": group_id})
            continue
        if not session.owns(group_id):
            groups.append({"error_code": _NOT_COORDINATOR, "group_id": group_id})
            continue
        described = coordinator.describe(session.namespace, group_id)
        if described is None:
            stored = await session.processor.list_groups(session.caller)
            state = GroupState.EMPTY if group_id in stored else GroupState.DEAD
            groups.append(
                {
                    "error_code": ErrorCode.none,
                    "group_id": group_id,
                    "group_state": state.value,
                    "protocol_type": "",
                    "protocol_data": "",
                    "members": [],
                    "authorized_operations": -2147483648,
                }
            )
            continue
        state, group = described
        groups.append(
            {
                "error_code": ErrorCode.none,
                "group_id": group_id,
                "group_state": state.value,
                "protocol_type": group.protocol_type or "",
                "protocol_data": group.protocol_name or "",
                "members": [
                    {
                        "member_id": m.member_id,
                        "group_instance_id": m.group_instance_id,
                        "client_id": m.client_id,
                        "client_host": m.client_host,
                        "member_metadata": m.metadata,
                        "member_assignment": m.assignment,
                    }
                    for m in coordinator.members(session.namespace, group_id)
                ],
                "authorized_operations": -2147483648,
            }
        )
    return {"throttle_time": 0, "groups": groups}


async def list_groups(session: Session, request: Any, version: int) -> dict[str, Any]:
    """Classic groups (live, or known from committed offsets), KIP-848 consumer groups
    and share groups, with their type (v5): those this gateway coordinates, since admin
    clients ask every broker and add the answers up."""
    services = session.services
    listed: dict[str, tuple[str, str, str]] = {  # id -> protocol type, state, group type
        name: ("consumer", GroupState.EMPTY.value, "classic")
        for name in await session.processor.list_groups(session.caller)
    }
    for name, (state, protocol_type) in services.coordinator.groups(session.namespace).items():
        listed[name] = (protocol_type or "consumer", state.value, "classic")
    for name, count in services.consumer_groups.groups(session.namespace).items():
        listed[name] = ("consumer", "Stable" if count else "Empty", "consumer")
    for name, count in services.share_groups.groups(session.namespace).items():
        listed[name] = ("share", "Stable" if count else "Empty", "share")
    states = set(getattr(request, "states_filter", ()) or ())
    types = {t.lower() for t in getattr(request, "types_filter", ()) or ()}
    cluster = session.cluster
    groups = [
        {"group_id": name, "protocol_type": ptype, "group_state": state, "group_type": gtype}
        for name, (ptype, state, gtype) in sorted(listed.items())
        if (not states or state in states)
        and (not types or gtype in types)
        and cluster.owns(name)
        and await permitted(session, "group", name, "describe")
    ]
    return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}


async def delete_groups(session: Session, request: Any, version: int) -> dict[str, Any]:
    results = []
    stored = set(await session.processor.list_groups(session.caller))
    for group_id in request.groups_names:
        if not await permitted(session, "group", group_id, "delete"):
            results.append({"group_id": group_id, "error_code": _GROUP_DENIED})
            continue
        if not session.owns(group_id):
            results.append({"group_id": group_id, "error_code": _NOT_COORDINATOR})
            continue
        known = group_id in stored or session.services.coordinator.describe(
            session.namespace, group_id
        )
        code = session.services.coordinator.forget(session.namespace, group_id)
        if not known:
            code = ErrorCode.group_id_not_found
        elif code is ErrorCode.none:
            try:
                await session.processor.delete_group_offsets(session.caller, group_id)
            except (StorageError, AuthError) as e:
                code = coordinator_error(e)
        results.append({"group_id": group_id, "error_code": code})
    return {"throttle_time": 0, "results": results}
