"""The admin API's actions (docs/admin.md): create and delete topics and MNS queues,
purge a queue, peek at messages without consuming them, publish a test message,
describe a group and reset its offsets, close a connection, list the gateways.

Everything goes through the gateway's processor, as a protocol's own requests do, so
the storage behind it (embedded engine or a pool of nodes) does not matter here. The
actions are for admin accounts only (anyone in ``open`` mode, where nobody is
checked); the listings in :mod:`protocols.http.admin` stay open to every account for
its own namespaces.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from polymq.gateway.accounts import Principal
from polymq.gateway.config import LISTENER_NAMES
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mns.queues import (
    QUEUE_KIND,
    QueueService,
    group_of,
    queue_counts,
    storage_queues,
)
from polymq.storage.errors import (
    InvalidName,
    QueueNotFound,
    TopicAlreadyExists,
    TopicNotFound,
)
from polymq.storage.model import (
    AppendRequest,
    Message,
    MessageType,
    QueueRef,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)

__all__ = ["manage_router"]

_PROTOCOL = "http"
_PREVIEW_BYTES = 256  # a body preview's length: enough to recognise a message
_PEEK_MAX = 100
_PURGE_BATCH = 500
# Where the Kafka coordinator stores a stable generation (protocols/kafka/group_log.py).
_KAFKA_GROUP_KIND = "kafka.group"

PrincipalOf = Callable[[ListenerContext, Request], Awaitable[Principal]]


class NewTopic(BaseModel):
    """A topic to create, in the terms of ``kafka-topics --create``."""

    name: str
    queue_count: int = Field(1, ge=1, le=10_000, description="partitions / message queues")
    message_type: Literal["NORMAL", "FIFO", "DELAY", "TRANSACTION"] = "NORMAL"
    retention_ms: int | None = Field(
        None, description="None: the engine's default; -1: until consumed"
    )


class TestMessage(BaseModel):
    """A message to publish; ``body`` is text (UTF-8), or base64 with ``base64``."""

    body: str = ""
    base64: bool = False
    key: str | None = None
    tag: str | None = None
    properties: dict[str, str] = Field(default_factory=dict)
    queue_id: int = Field(0, ge=0)


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


def _preview(m: StoredMessage) -> dict[str, Any]:
    body = m.message.body
    shown = body[:_PREVIEW_BYTES]
    try:
        text: str | None = shown.decode()
    except UnicodeDecodeError:
        text = None
    return {
        "queue_id": m.queue.queue_id,
        "offset": m.offset,
        "message_id": m.message_id,
        "stored_ms": m.store_timestamp_ms,
        "size": len(body),
        "body": text if text is not None else base64.b64encode(shown).decode(),
        "body_encoding": "utf-8" if text is not None else "base64",
        "truncated": len(body) > _PREVIEW_BYTES,
        "key": m.message.key.decode(errors="replace") if m.message.key is not None else None,
        "tag": m.message.tag,
        "properties": {k: v.decode(errors="replace") for k, v in m.message.properties},
        "content_type": m.message.content_type,
    }


def _topic(info: TopicInfo, namespace: str) -> dict[str, Any]:
    return {
        "namespace": namespace,
        "name": info.name,
        "config": {
            "queue_count": info.config.queue_count,
            "message_type": str(info.config.message_type),
            "retention_ms": info.config.retention_ms,
        },
        "queues": [
            {"queue_id": i, "earliest": q.earliest, "latest": q.latest}
            for i, q in enumerate(info.queues)
        ],
    }


async def _peek(
    processor: Processor, caller: Caller, starts: list[tuple[QueueRef, int]], limit: int
) -> list[dict[str, Any]]:
    """Up to ``limit`` messages from each (queue, offset) in turn, read unmetered: a
    look delivers nothing and moves no cursor."""
    shown: list[dict[str, Any]] = []
    for ref, offset in starts:
        while len(shown) < limit:
            result = await processor.read(
                caller, ref, offset, max_messages=limit - len(shown), wait_ms=0, metered=False
            )
            shown.extend(_preview(m) for m in result.messages)
            if not result.messages or result.next_offset <= offset:
                break
            offset = result.next_offset
    return shown


def manage_router(context: ListenerContext, principal_of: PrincipalOf) -> APIRouter:
    # Included into the admin router, which adds /admin.
    router = APIRouter(tags=["admin"])
    processor = context.processor
    queues = QueueService(processor, max_message_bytes=context.config.http.max_message_bytes)

    async def admin_in(request: Request, namespace: str) -> Caller:
        principal = await principal_of(context, request)
        if not principal.admin:
            raise HTTPException(403, "only admin accounts may do this")
        base = Caller(
            principal=principal, namespace=principal.default_namespace, protocol=_PROTOCOL
        )
        if namespace not in await processor.list_namespaces(base):
            raise HTTPException(404, f"no namespace {namespace!r}")
        return Caller(principal=principal, namespace=namespace, protocol=_PROTOCOL)

    async def described(caller: Caller, topic: str) -> TopicInfo:
        try:
            return await processor.describe_topic(caller, topic)
        except TopicNotFound:
            raise HTTPException(404, f"no topic {topic!r} in {caller.namespace!r}") from None

    async def mns_queue(caller: Caller, name: str) -> None:
        if await processor.meta_get(caller, QUEUE_KIND, name) is None:
            raise HTTPException(404, f"no queue {name!r} in {caller.namespace!r}")

    # -- topics ----------------------------------------------------------------------

    @router.post("/topics/{namespace}", status_code=201, summary="Create a topic")
    async def create_topic(request: Request, namespace: str, topic: NewTopic) -> dict[str, Any]:
        caller = await admin_in(request, namespace)
        config = TopicConfig(
            queue_count=topic.queue_count,
            message_type=MessageType(topic.message_type),
            retention_ms=topic.retention_ms,
        )
        try:
            info = await processor.create_topic(caller, topic.name, config)
        except TopicAlreadyExists:
            raise HTTPException(409, f"topic {topic.name!r} exists") from None
        except InvalidName as e:
            raise HTTPException(400, str(e)) from None
        return _topic(info, namespace)

    @router.get("/topics/{namespace}/{topic}", summary="A topic, its queues and its groups")
    async def describe_topic(request: Request, namespace: str, topic: str) -> dict[str, Any]:
        """The groups are those with offsets committed on this topic, with their lag."""
        caller = await admin_in(request, namespace)
        info = await described(caller, topic)
        shown = _topic(info, namespace)
        groups = []
        for group in await processor.list_groups(caller):
            offsets = await processor.list_group_offsets(caller, group)
            mine = {r.queue_id: c.offset for r, c in offsets.items() if r.topic == topic}
            if mine:
                lag = sum(
                    max(0, info.queues[q].latest - o)
                    for q, o in mine.items()
                    if q < len(info.queues)
                )
                groups.append({"name": group, "committed": mine, "lag": lag})
        shown["groups"] = groups
        return shown

    @router.delete("/topics/{namespace}/{topic}", status_code=204, summary="Delete a topic")
    async def delete_topic(request: Request, namespace: str, topic: str) -> Response:
        caller = await admin_in(request, namespace)
        try:
            await processor.delete_topic(caller, topic)
        except TopicNotFound:
            raise HTTPException(404, f"no topic {topic!r} in {namespace!r}") from None
        return Response(status_code=204)

    @router.get(
        "/topics/{namespace}/{topic}/messages",
        summary="Peek at a topic's messages from an offset, consuming nothing",
    )
    async def peek_topic(
        request: Request,
        namespace: str,
        topic: str,
        queue_id: int | None = None,
        offset: int | None = None,
        limit: int = 10,
    ) -> dict[str, Any]:
        """From ``offset`` (default: the earliest kept) of ``queue_id`` (default: every
        queue in turn), at most ``limit`` (≤ 100) messages."""
        caller = await admin_in(request, namespace)
        info = await described(caller, topic)
        ids = range(len(info.queues)) if queue_id is None else [queue_id]
        if queue_id is not None and not 0 <= queue_id < len(info.queues):
            raise HTTPException(404, f"topic {topic!r} has no queue {queue_id}")
        starts = [
            (
                QueueRef(namespace, topic, q),
                offset if offset is not None else info.queues[q].earliest,
            )
            for q in ids
        ]
        limit = max(1, min(limit, _PEEK_MAX))
        return {"messages": await _peek(processor, caller, starts, limit)}

    @router.post(
        "/topics/{namespace}/{topic}/messages",
        status_code=201,
        summary="Publish a test message to one of a topic's queues",
    )
    async def publish(
        request: Request, namespace: str, topic: str, message: TestMessage
    ) -> dict[str, Any]:
        """Stored as a producer's message with no protocol of its own: every protocol's
        consumers of the topic (and of an MNS queue of that name) receive it."""
        caller = await admin_in(request, namespace)
        info = await described(caller, topic)
        if message.queue_id >= len(info.queues):
            raise HTTPException(404, f"topic {topic!r} has no queue {message.queue_id}")
        try:
            body = base64.b64decode(message.body) if message.base64 else message.body.encode()
        except ValueError:
            raise HTTPException(400, "the body is not base64") from None
        entry = Message(
            body=body,
            key=message.key.encode() if message.key is not None else None,
            tag=message.tag,
            properties=tuple((k, v.encode()) for k, v in message.properties.items()),
            born_timestamp_ms=processor.clock.now_ms(),
            producer="polymq-admin",
        )
        ref = QueueRef(namespace, topic, message.queue_id)
        [result] = await processor.append(caller, [AppendRequest(entry=entry, queues=(ref,))])
        return {"message_id": result.message_id, "queue_id": ref.queue_id}

    # -- MNS queues ------------------------------------------------------------------

    @router.get("/queues", summary="MNS queues with their depth")
    async def list_queues(request: Request, namespace: str | None = None) -> dict[str, Any]:
        """``active``: visible now; ``inactive``: received and not yet deleted;
        ``delayed``: not due yet. An account that is no admin sees its own namespaces."""
        principal = await principal_of(context, request)
        base = Caller(
            principal=principal, namespace=principal.default_namespace, protocol=_PROTOCOL
        )
        names = await processor.list_namespaces(base)
        if namespace is not None:
            if namespace not in names:
                raise HTTPException(404, f"no namespace {namespace!r} is visible to you")
            names = [namespace]
        shown = []
        for name in names:
            caller = Caller(principal=principal, namespace=name, protocol=_PROTOCOL)
            for queue in sorted(await processor.meta_list(caller, QUEUE_KIND)):
                try:
                    counts = await queue_counts(processor, caller, queue)
                except (TopicNotFound, QueueNotFound):
                    continue  # deleted meanwhile
                shown.append(
                    {
                        "namespace": name,
                        "name": queue,
                        "active": counts.active,
                        "inactive": counts.inactive,
                        "delayed": counts.delayed,
                    }
                )
        return {"queues": shown}

    @router.put("/queues/{namespace}/{queue}", status_code=201, summary="Create an MNS queue")
    async def create_queue(request: Request, namespace: str, queue: str) -> Response:
        """With MNS's default attributes; 204 if it exists with them already."""
        caller = await admin_in(request, namespace)
        created = await queues.create(caller, queue, {})
        return Response(status_code=201 if created else 204)

    @router.delete("/queues/{namespace}/{queue}", status_code=204, summary="Delete an MNS queue")
    async def delete_queue(request: Request, namespace: str, queue: str) -> Response:
        caller = await admin_in(request, namespace)
        await mns_queue(caller, queue)
        await queues.delete(caller, queue)
        return Response(status_code=204)

    @router.post("/queues/{namespace}/{queue}/purge", summary="Remove a queue's ready messages")
    async def purge_queue(request: Request, namespace: str, queue: str) -> dict[str, int]:
        """Messages received and not yet deleted stay, as RabbitMQ's purge leaves
        unacked ones: their consumers still hold receipts for them."""
        caller = await admin_in(request, namespace)
        await mns_queue(caller, queue)
        refs = await storage_queues(processor, caller, queue)
        group = group_of(queue)
        purged = 0
        while True:
            popped = await processor.pop(
                caller, group, refs, max_messages=_PURGE_BATCH, invisible_ms=60_000, wait_ms=0
            )
            if not popped:
                return {"purged": purged}
            await processor.ack_many(caller, group, [m.receipt or "" for m in popped])
            purged += len(popped)

    @router.get(
        "/queues/{namespace}/{queue}/messages",
        summary="Peek at a queue's messages not yet deleted, consuming nothing",
    )
    async def peek_queue(
        request: Request, namespace: str, queue: str, limit: int = 10
    ) -> dict[str, Any]:
        """From the oldest message its consumers have not deleted (received ones
        included), at most ``limit`` (≤ 100)."""
        caller = await admin_in(request, namespace)
        await mns_queue(caller, queue)
        group = group_of(queue)
        starts = [
            (ref, await processor.consumed_below(caller, group, ref))
            for ref in await storage_queues(processor, caller, queue)
        ]
        limit = max(1, min(limit, _PEEK_MAX))
        return {"messages": await _peek(processor, caller, starts, limit)}

    # -- consumer groups -------------------------------------------------------------

    @router.get("/groups/{namespace}/{group}", summary="A group's offsets, lag and members")
    async def describe_group(request: Request, namespace: str, group: str) -> dict[str, Any]:
        """Members: a Kafka classic group's last stable generation, as its coordinator
        stores it for takeover (``kafka.group`` metadata); a group that has never been
        stable, or of another protocol, lists none."""
        caller = await admin_in(request, namespace)
        if group not in await processor.list_groups(caller):
            raise HTTPException(404, f"no group {group!r} in {namespace!r}")
        rows = []
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
        members = []
        stored = await processor.meta_get(caller, _KAFKA_GROUP_KIND, group)
        if isinstance(stored, dict):
            members = [
                {k: m.get(k) for k in ("member_id", "client_id", "client_host")}
                for m in stored.get("members", [])
                if isinstance(m, dict)
            ]
        return {
            "namespace": namespace,
            "name": group,
            "queues": rows,
            "lag": sum(r["lag"] for r in rows),
            "members": members,
        }

    @router.post(
        "/groups/{namespace}/{group}/reset-offsets",
        summary="Move a group's committed offsets (kafka-consumer-groups --reset-offsets)",
    )
    async def reset_offsets(
        request: Request, namespace: str, group: str, reset: OffsetReset
    ) -> dict[str, Any]:
        """Stop the group's consumers first, as Kafka asks: a consumer that is running
        commits its own position over the reset."""
        caller = await admin_in(request, namespace)
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

    # -- connections and the cluster -------------------------------------------------

    @router.delete("/connections/{connection_id}", status_code=204, summary="Close a connection")
    async def close_connection(request: Request, connection_id: int) -> Response:
        """Only connections to this gateway: each gateway lists and closes its own."""
        principal = await principal_of(context, request)
        if not principal.admin:
            raise HTTPException(403, "only admin accounts may do this")
        if context.connections.get(connection_id) is None:
            raise HTTPException(404, f"no connection {connection_id} on this gateway")
        with contextlib.suppress(ConnectionError, OSError):
            await context.connections.close(connection_id)
        return Response(status_code=204)

    @router.get("/gateways", summary="The live gateways and their endpoints per protocol")
    async def gateways(request: Request) -> dict[str, Any]:
        """As navigation tells this gateway (the merged form: this one only)."""
        await principal_of(context, request)
        directory = context.directory
        found: dict[str, dict[str, Any]] = {}
        for protocol in LISTENER_NAMES:
            for e in directory.endpoints(protocol):
                entry = found.setdefault(
                    e.gateway_id,
                    {"gateway_id": e.gateway_id, "zone": e.zone, "load": e.load, "endpoints": {}},
                )
                entry["endpoints"][protocol] = f"{e.host}:{e.port}"
        return {"self": directory.self_id, "gateways": sorted(found.values(), key=str)}

    return router
