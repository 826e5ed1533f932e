"""ConsumerGroupHeartbeat (KIP-848): the coordinator-assigned consumer protocol, over
protocols/kafka/consumer_groups.py. Topics travel by topic id."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.protocols.kafka.authz import permitted
from polymq.protocols.kafka.consumer_groups import HEARTBEAT_INTERVAL_MS, Assignment
from polymq.protocols.kafka.handlers.topics import topic_partitions
from polymq.protocols.kafka.session import Session

__all__ = [
    "consumer_group_describe",
    "consumer_group_heartbeat",
    "group_denied",
    "group_described",
    "group_not_described",
]


async def consumer_group_heartbeat(session: Session, request: Any, version: int) -> dict[str, Any]:
    if not await permitted(session, "group", request.group_id, "read"):
        return {
            "throttle_time": 0,
            "error_code": ErrorCode.group_authorization_failed,
            "member_id": request.member_id,
            "member_epoch": request.member_epoch,
        }
    if not session.owns(request.group_id):
        return {
            "throttle_time": 0,
            "error_code": ErrorCode.not_coordinator,
            "member_id": request.member_id,
            "member_epoch": request.member_epoch,
        }
    groups = session.services.consumer_groups
    namespace = session.namespace
    names = request.subscribed_topic_names
    subscribed = tuple(names) if names is not None else None
    partitions, ids = await topic_partitions(
        session, groups.subscriptions(namespace, request.group_id, subscribed or ())
    )
    by_id = {tid: name for name, tid in ids.items()}
    owned: Assignment | None = None
    if request.topic_partitions is not None:
        owned = {
            by_id[tp.topic_id]: frozenset(tp.partitions)
            for tp in request.topic_partitions
            if tp.topic_id in by_id
        }
    result = groups.heartbeat(
        namespace,
        request.group_id,
        member_id=request.member_id or str(uuid.uuid4()),
        member_epoch=request.member_epoch,
        subscribed=subscribed,
        owned=owned,
        partitions=partitions,
        now=asyncio.get_running_loop().time(),
        client_id=session.client_id or "",
        client_host=session.peer,
    )
    if session.connection_id is not None and result.error == ErrorCode.none:
        # The admin API's group members (KIP-848 state is this listener's memory).
        leaving = request.member_epoch < 0
        session.services.connections.consumes_for(
            session.connection_id, None if leaving else request.group_id
        )
    assignment = None
    if result.assignment is not None:
        assignment = {
            "topic_partitions": [
                {"topic_id": ids[name], "partitions": sorted(parts)}
                for name, parts in sorted(result.assignment.items())
            ]
        }
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "error_message": None,
        "member_id": result.member_id,
        "member_epoch": result.member_epoch,
        "heartbeat_interval": HEARTBEAT_INTERVAL_MS,
        "assignment": assignment,
    }


async def consumer_group_describe(session: Session, request: Any, version: int) -> dict[str, Any]:
    groups = session.services.consumer_groups
    described = []
    for group_id in request.group_ids:
        if not await permitted(session, "group", group_id, "describe"):
            described.append(group_denied(group_id))
            continue
        found = groups.describe(session.namespace, group_id)
        if (refused := group_not_described(session, group_id, found)) is not None:
            described.append(refused)
            continue
        assert found is not None
        epoch, members = found
        names = {t for m in members for t in (*m.subscribed, *m.assignment, *m.target)}
        _, ids = await topic_partitions(session, names)

        def assignment(parts: Assignment, ids: dict[str, uuid.UUID] = ids) -> dict[str, Any]:
            return {
                "topic_partitions": [
                    {"topic_id": ids[name], "topic_name": name, "partitions": sorted(ps)}
                    for name, ps in sorted(parts.items())
                    if name in ids
                ]
            }

        rows = [
            {
                "member_id": m.member_id,
                "member_epoch": m.member_epoch,
                "client_id": m.client_id,
                "client_host": m.client_host,
                "subscribed_topic_names": list(m.subscribed),
                "assignment": assignment(m.assignment),
                "target_assignment": assignment(m.target),
            }
            for m in members
        ]
        described.append(group_described(group_id, epoch, "range", rows))
    return {"throttle_time": 0, "groups": described}


def group_denied(group_id: str) -> dict[str, Any]:
    """The ConsumerGroupDescribe or ShareGroupDescribe entry of a group the session may
    not describe (docs/permissions.md)."""
    return {"error_code": ErrorCode.group_authorization_failed, "group_id": group_id}


def group_not_described(session: Session, group_id: str, found: object) -> dict[str, Any] | None:
    """The ConsumerGroupDescribe or ShareGroupDescribe entry of a group this gateway
    cannot describe (only the coordinator knows the members; ``found`` None: a group
    never seen), or None when it can."""
    if not session.owns(group_id):
        return {"error_code": ErrorCode.not_coordinator, "group_id": group_id}
    if found is None:
        return {
            "error_code": ErrorCode.group_id_not_found,
            "group_id": group_id,
            "group_state": "Dead",
        }
    return None


def group_described(
    group_id: str, epoch: int, assignor: str, members: list[dict[str, Any]]
) -> dict[str, Any]:
    """A described group's entry (KIP-848 and KIP-932 alike): the assignment epoch is
    the group epoch, as the assignment is computed at once."""
    return {
        "error_code": ErrorCode.none,
        "group_id": group_id,
        "group_state": "Stable" if members else "Empty",
        "group_epoch": epoch,
        "assignment_epoch": epoch,
        "assignor_name": assignor,
        "members": members,
        "authorized_operations": -2147483648,
    }
