"""The admin API's queues (docs/admin.md): MNS queues (list with depth, create,
delete, purge and peek, through the processor and the MNS queue service: the same code
the MNS API runs, so a queue made here is one that MNS, Kafka or AMQP clients see) and,
listed beside them, AMQP queues (:mod:`protocols.http.admin_amqp`)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, Response

from polymq.gateway.processor import Caller
from polymq.protocols.http.admin_amqp import amqp_queues
from polymq.protocols.http.admin_scope import PEEK_MAX, PROTOCOL, AdminScope, peek
from polymq.protocols.mns.queues import (
    QUEUE_KIND,
    QueueService,
    group_of,
    queue_counts,
    storage_queues,
)
from polymq.storage.errors import QueueNotFound, TopicNotFound

__all__ = ["queues_router"]

_PURGE_BATCH = 500


def queues_router(scope: AdminScope) -> APIRouter:
    router = APIRouter(tags=["admin"])
    context = scope.context
    processor = scope.processor
    queues = QueueService(processor, max_message_bytes=context.config.http.max_message_bytes)
    admin_in = scope.admin_in

    async def mns_queue(caller: Caller, name: str) -> None:
        if await processor.meta_get(caller, QUEUE_KIND, name) is None:
            raise HTTPException(404, f"no queue {name!r} in {caller.namespace!r}")

    @router.get("/queues", summary="MNS and AMQP queues with their depth")
    async def list_queues(
        request: Request,
        namespace: str | None = None,
        kind: Literal["mns", "amqp"] | None = None,
    ) -> dict[str, Any]:
        """Every queue has ``kind`` (``mns`` or ``amqp``), ``messages_ready`` and
        ``messages_unacked`` (delivered or received, not yet acknowledged or deleted).
        MNS queues also have ``active`` (= ready), ``inactive`` (= unacked) and
        ``delayed`` (not due yet); AMQP queues their flags, consumers and bindings.
        ``kind`` lists one kind only. An account that is no admin sees its own
        namespaces."""
        principal = await scope.principal(request)
        names = await scope.visible(principal)
        if namespace is not None:
            if namespace not in names:
                raise HTTPException(404, f"no namespace {namespace!r} is visible to you")
            names = [namespace]
        shown = []
        for name in names:
            caller = Caller(principal=principal, namespace=name, protocol=PROTOCOL)
            mns = [] if kind == "amqp" else await processor.meta_list(caller, QUEUE_KIND)
            for queue in sorted(mns):
                try:
                    counts = await queue_counts(processor, caller, queue)
                except (TopicNotFound, QueueNotFound):
                    continue  # deleted meanwhile
                shown.append(
                    {
                        "kind": "mns",
                        "namespace": name,
                        "name": queue,
                        "messages_ready": counts.active,
                        "messages_unacked": counts.inactive,
                        "active": counts.active,
                        "inactive": counts.inactive,
                        "delayed": counts.delayed,
                    }
                )
            if kind != "mns":
                shown.extend(await amqp_queues(processor, caller))
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
        limit = max(1, min(limit, PEEK_MAX))
        return {"messages": await peek(processor, caller, starts, limit)}

    return router
