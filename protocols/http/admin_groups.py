"""The admin API's consumer groups (docs/admin.md): one group's offsets, lag and
members (Kafka's classic groups here, AMQP and MQTT pop groups in
:mod:`protocols.http.admin_members`), and ``kafka-consumer-groups --reset-offsets``
for any protocol's offset groups, through the processor."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from polymq.protocols.http.admin_members import connected_members, members_of
from polymq.protocols.http.admin_scope import AdminScope, body_schema
from polymq.storage.errors import QueueNotFound, TopicNotFound
from polymq.storage.model import QueueRef

__all__ = ["groups_router"]

# Where the Kafka coordinator stores a stable generation (protocols/kafka/group_log.py).
_KAFKA_GROUP_KIND = "kafka.group"


class OffsetReset(BaseModel):
    """``kafka-consumer-groups --reset-offsets``: ``to`` earliest, latest, an
    ``offset`` or the first message stored at or after ``timestamp_ms``; on every queue
    of ``topic`` or only ``queue_id``. ``dry_run`` shows the new offsets without
    committing them."""

    topic: str
    to: Literal["earliest", "latest", "offset", "timestamp"]
    offset: int | None = Field(None, ge=0)
    timestamp_ms: int | None = None
    queue_id: int | None = Field(None, ge=0)
    dry_run: bool = False


def groups_router(scope: AdminScope) -> APIRouter:
    router = APIRouter(tags=["admin"])
    processor = scope.processor
    admin_in = scope.admin_in
    described = scope.described

    @router.get("/groups/{namespace}/{group}", summary="A group's offsets, lag and members")
    async def describe_group(request: Request, namespace: str, group: str) -> dict[str, Any]:
        """Members: a Kafka classic group's last stable generation, as its coordinator
        stores it for takeover (``kafka.group`` metadata); for the AMQP groups
        (``amqp``, ``amqp:<view>``) the consumers of their queues and for ``mqtt`` the
        shared subscriptions of stored sessions, with each queue's lag in
        ``pop_queues``; and the RocketMQ clients connected to this gateway whose
        settings name the group. Every member has its ``protocol``."""
        caller = await admin_in(request, namespace)
        directory = scope.context.directory
        local = {c.id: c for c in scope.context.connections.list()}
        popped = await members_of(processor, caller, group, self_id=directory.self_id, local=local)
        connected = connected_members(group, namespace, directory.self_id, local)
        known = connected or (popped is not None and (popped[0] or popped[1]))
        if not known and group not in await processor.list_groups(caller):
            raise HTTPException(404, f"no group {group!r} in {namespace!r}")
        rows: list[dict[str, Any]] = []
        for ref, committed in sorted(
            (await processor.list_group_offsets(caller, group)).items(),
            key=lambda item: (item[0].topic, item[0].queue_id),
        ):
            try:
                latest = (await processor.queue_offsets(caller, ref)).latest
            except (TopicNotFound, QueueNotFound):
                continue
            rows.append(
                {
                    "topic": ref.topic,
                    "queue_id": ref.queue_id,
                    "committed": committed.offset,
                    "latest": latest,
                    "lag": max(0, latest - committed.offset),
                }
            )
        members: list[dict[str, Any]] = []
        stored = await processor.meta_get(caller, _KAFKA_GROUP_KIND, group)
        if isinstance(stored, dict):
            members = [
                {"protocol": "kafka"}
                | {k: m.get(k) for k in ("member_id", "client_id", "client_host")}
                for m in stored.get("members", [])
                if isinstance(m, dict)
            ]
        pop_rows = popped[0] if popped is not None else []
        members += popped[1] if popped is not None else []
        members += connected
        return {
            "namespace": namespace,
            "name": group,
            "queues": rows,
            "pop_queues": pop_rows,
            "lag": sum(r["lag"] for r in rows) + sum(r["lag"] for r in pop_rows),
            "members": members,
        }

    @router.post(
        "/groups/{namespace}/{group}/reset-offsets",
        summary="Move a group's committed offsets (kafka-consumer-groups --reset-offsets)",
        openapi_extra=body_schema(OffsetReset),
    )
    async def reset_offsets(request: Request, namespace: str, group: str) -> dict[str, Any]:
        """Stop the group's consumers first, as Kafka asks: a consumer that is running
        commits its own position over the reset."""
        caller = await admin_in(request, namespace)
        reset = await scope.body(request, OffsetReset)
        info = await described(caller, reset.topic)
        if reset.to == "offset" and reset.offset is None:
            raise HTTPException(400, "'offset' needs an offset")
        if reset.to == "timestamp" and reset.timestamp_ms is None:
            raise HTTPException(400, "'timestamp' needs timestamp_ms")
        ids = range(len(info.queues)) if reset.queue_id is None else [reset.queue_id]
        moved = []
        for q in ids:
            if not 0 <= q < len(info.queues):
                raise HTTPException(404, f"topic {reset.topic!r} has no queue {q}")
            ref = QueueRef(namespace, reset.topic, q)
            bounds = info.queues[q]
            if reset.to == "earliest":
                target = bounds.earliest
            elif reset.to == "latest":
                target = bounds.latest
            elif reset.to == "offset":
                target = min(max(reset.offset or 0, bounds.earliest), bounds.latest)
            else:
                target = await processor.offset_for_timestamp(caller, ref, reset.timestamp_ms or 0)
                if target < 0:  # nothing stored at or after it
                    target = bounds.latest
            before = await processor.fetch_offset(caller, group, ref)
            if not reset.dry_run:
                await processor.commit_offset(caller, group, ref, target)
            moved.append(
                {
                    "topic": reset.topic,
                    "queue_id": q,
                    "previous": before.offset if before is not None else None,
                    "offset": target,
                }
            )
        return {"group": group, "dry_run": reset.dry_run, "offsets": moved}

    return router
