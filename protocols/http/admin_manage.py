"""The admin API's actions (docs/admin.md): create, describe and delete topics, peek
at a topic's messages without consuming them, publish a test message, close a
connection, list the gateways; MNS queues (:mod:`protocols.http.admin_queues`) and
consumer groups (:mod:`protocols.http.admin_groups`) are included from their modules.

Everything goes through the gateway's processor, as a protocol's own requests do, so
the storage behind it (embedded engine or a pool of nodes) does not matter here. The
actions are for admin accounts only (anyone in ``open`` mode, where nobody is
checked); the listings in :mod:`protocols.http.admin` stay open to every account for
its own namespaces.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from polymq.gateway.config import LISTENER_NAMES
from polymq.gateway.listeners import ListenerContext
from polymq.protocols.http.admin_groups import groups_router
from polymq.protocols.http.admin_pool import pool_router
from polymq.protocols.http.admin_queues import queues_router
from polymq.protocols.http.admin_scope import (
    PEEK_MAX,
    AdminScope,
    PrincipalOf,
    body_schema,
    peek,
)
from polymq.storage.errors import InvalidName, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import (
    AppendRequest,
    Message,
    MessageType,
    QueueRef,
    TopicConfig,
    TopicInfo,
)

__all__ = ["manage_router"]


class NewTopic(BaseModel):
    """A topic to create, in the terms of ``kafka-topics --create``."""

    name: str
    queue_count: int = Field(1, ge=1, le=10_000, description="partitions / message queues")
    message_type: Literal["NORMAL", "FIFO", "DELAY", "TRANSACTION"] = "NORMAL"
    retention_ms: int | None = Field(
        None, description="None: the engine's default; -1: until consumed"
    )


class PublishedMessage(BaseModel):
    """A message to publish; ``body`` is text (UTF-8), or base64 with ``base64``."""

    body: str = ""
    base64: bool = False
    key: str | None = None
    tag: str | None = None
    properties: dict[str, str] = Field(default_factory=dict)
    queue_id: int = Field(0, ge=0)


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


def manage_router(context: ListenerContext, principal_of: PrincipalOf) -> APIRouter:
    # Included into the admin router, which adds /admin.
    router = APIRouter(tags=["admin"])
    scope = AdminScope(context, principal_of)
    processor = context.processor
    admin_in = scope.admin_in
    described = scope.described

    # -- topics ----------------------------------------------------------------------

    @router.post(
        "/topics/{namespace}",
        status_code=201,
        summary="Create a topic",
        openapi_extra=body_schema(NewTopic),
    )
    async def create_topic(request: Request, namespace: str) -> dict[str, Any]:
        caller = await admin_in(request, namespace)
        topic = await scope.body(request, NewTopic)
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
        limit = max(1, min(limit, PEEK_MAX))
        return {"messages": await peek(processor, caller, starts, limit)}

    @router.post(
        "/topics/{namespace}/{topic}/messages",
        status_code=201,
        summary="Publish a test message to one of a topic's queues",
        openapi_extra=body_schema(PublishedMessage),
    )
    async def publish(request: Request, namespace: str, topic: str) -> dict[str, Any]:
        """Stored as a producer's message with no protocol of its own: every protocol's
        consumers of the topic (and of an MNS queue of that name) receive it."""
        caller = await admin_in(request, namespace)
        message = await scope.body(request, PublishedMessage)
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

    # -- connections and the cluster -------------------------------------------------

    @router.delete("/connections/{connection_id}", status_code=204, summary="Close a connection")
    async def close_connection(request: Request, connection_id: int) -> Response:
        """Only connections to this gateway: each gateway lists and closes its own."""
        await scope.admin(request)
        if context.connections.get(connection_id) is None:
            raise HTTPException(404, f"no connection {connection_id} on this gateway")
        with contextlib.suppress(ConnectionError, OSError):
            await context.connections.close(connection_id)
        return Response(status_code=204)

    @router.get("/gateways", summary="The live gateways and their endpoints per protocol")
    async def gateways(request: Request) -> dict[str, Any]:
        """As navigation tells this gateway (the merged form: this one only)."""
        await scope.principal(request)
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

    router.include_router(queues_router(scope))
    router.include_router(groups_router(scope))
    router.include_router(pool_router(scope))
    return router
