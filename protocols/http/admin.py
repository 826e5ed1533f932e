"""The JSON admin API under ``/admin/``: namespaces, topics with their queues and
offsets, consumer groups with lag, connections, accounts (never their secrets), usage.

In ``accounts`` auth mode it takes HTTP Basic credentials of a configured account and
shows only the namespaces that account may use; in open mode anyone sees everything.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from polymq.gateway.accounts import ANONYMOUS, AccessDenied, AuthError, Principal
from polymq.gateway.connections import OUT_NOT_PER_CONNECTION
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.processor import Caller
from polymq.protocols.http.admin_amqp import amqp_queues
from polymq.protocols.http.admin_manage import manage_router
from polymq.protocols.http.admin_members import members_of
from polymq.protocols.http.admin_permissions import permissions_router
from polymq.protocols.http.admin_scope import AdminScope, body_schema
from polymq.protocols.mns.queues import QUEUE_KIND, QueueCounts, group_of, queue_counts
from polymq.storage.errors import (
    InvalidName,
    NamespaceAlreadyExists,
    QueueNotFound,
    TopicNotFound,
)

__all__ = ["admin_router"]

_PROTOCOL = "http"


async def _principal(context: ListenerContext, request: Request) -> Principal:
    if context.accounts.open:
        return ANONYMOUS
    header = request.headers.get("authorization", "")
    scheme, _, encoded = header.partition(" ")
    challenge = {"WWW-Authenticate": 'Basic realm="polymq admin"'}
    if request.headers.get("x-requested-with") == "XMLHttpRequest":
        # The web console asks with its own sign-in form: a challenge would make the
        # browser hold the request behind its native password prompt instead.
        challenge = {}
    if scheme.lower() != "basic":
        raise HTTPException(401, "HTTP Basic credentials are required", headers=challenge)
    try:
        user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise HTTPException(401, "malformed Basic credentials", headers=challenge) from None
    try:
        client = request.client
        peer = f"{client.host}:{client.port}" if client is not None else ""
        return await context.accounts.authenticate(user, password, protocol="http", peer=peer)
    except AuthError:
        raise HTTPException(401, "bad user name or password", headers=challenge) from None


class NewNamespace(BaseModel):
    """A namespace to create."""

    name: str


def admin_router(context: ListenerContext) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])
    processor = context.processor
    scope = AdminScope(context, _principal)

    async def callers(request: Request, namespace: str | None) -> list[Caller]:
        principal = await _principal(context, request)
        base = Caller(
            principal=principal, namespace=principal.default_namespace, protocol=_PROTOCOL
        )
        names = await processor.list_namespaces(base)
        if namespace is not None:
            if namespace not in names:
                raise HTTPException(404, f"no namespace {namespace!r} is visible to you")
            names = [namespace]
        return [Caller(principal=principal, namespace=name, protocol=_PROTOCOL) for name in names]

    @router.get("/namespaces", summary="Namespaces and how many topics and queues each holds")
    async def namespaces(request: Request) -> dict[str, Any]:
        """``queues``: the MNS and AMQP queues (as ``/admin/queues`` lists them);
        ``topics``: the topics it holds, as ``/admin/topics`` lists them (each queue
        is kept in a topic of its own, ``jobs`` or ``amqp:tasks``: queues count in
        both)."""
        result = []
        for caller in await callers(request, None):
            topics = await processor.list_topics(caller)
            mns = await processor.meta_list(caller, QUEUE_KIND)
            amqp = await amqp_queues(processor, caller)
            result.append(
                {"name": caller.namespace, "topics": len(topics), "queues": len(mns) + len(amqp)}
            )
        return {"namespaces": result}

    @router.post(
        "/namespaces",
        status_code=201,
        summary="Create a namespace (admins only)",
        openapi_extra=body_schema(NewNamespace),
    )
    async def create_namespace(request: Request) -> dict[str, Any]:
        """In accounts mode only an admin account creates one (``Processor.
        create_namespace`` checks it too); the body is read after that check."""
        principal = await scope.admin(request)
        name = (await scope.body(request, NewNamespace)).name
        caller = Caller(principal=principal, namespace=name, protocol=_PROTOCOL)
        try:
            await processor.create_namespace(caller, name)
        except NamespaceAlreadyExists:
            raise HTTPException(409, f"namespace {name!r} exists") from None
        except InvalidName as e:
            raise HTTPException(400, str(e)) from None
        except AccessDenied as e:
            raise HTTPException(403, str(e)) from None
        return {"name": name, "topics": 0, "queues": 0}

    @router.get("/topics", summary="Topics with their queues' offsets")
    async def topics(
        request: Request, namespace: str | None = None, internal: bool = False
    ) -> dict[str, Any]:
        """``internal=true`` also lists the topics protocols keep for themselves (MQTT
        session and shared-subscription queues), which clients never see."""
        result = []
        for caller in await callers(request, namespace):
            for info in await processor.list_topics(caller, include_internal=internal):
                if not await processor.permitted(caller, "topic", info.name, "describe"):
                    continue  # docs/permissions.md: only what the account may describe
                result.append(
                    {
                        "namespace": caller.namespace,
                        "name": info.name,
                        "config": {
                            "queue_count": info.config.queue_count,
                            "message_type": str(info.config.message_type),
                            "retention_ms": info.config.retention_ms,
                            "retention_bytes": info.config.retention_bytes,
                            "internal": info.config.internal,
                        },
                        "queues": [
                            {"queue_id": i, "earliest": q.earliest, "latest": q.latest}
                            for i, q in enumerate(info.queues)
                        ],
                        "created_ms": info.created_ms,
                    }
                )
        return {"topics": result}

    @router.get("/groups", summary="Consumer groups with their lag")
    async def groups(request: Request, namespace: str | None = None) -> dict[str, Any]:
        """Offset groups: lag is latest minus committed per queue. MNS queue groups (pop
        mode): lag is the messages not yet deleted (``pending``), ``inflight`` those
        received and not yet deleted. AMQP and MQTT pop groups (``amqp``, ``amqp:<view>``,
        ``mqtt``): one row per queue they take from, lag its messages not yet
        acknowledged, ``inflight`` those delivered (:mod:`protocols.http.admin_members`)."""
        result = []
        for caller in await callers(request, namespace):
            mns_groups = {group_of(q): q for q in await processor.meta_list(caller, QUEUE_KIND)}
            for group in await processor.list_groups(caller):
                if not await processor.permitted(caller, "group", group, "describe"):
                    continue
                queues: list[dict[str, Any]] = []
                for ref, committed in (await processor.list_group_offsets(caller, group)).items():
                    try:
                        latest = (await processor.queue_offsets(caller, ref)).latest
                    except (TopicNotFound, QueueNotFound):
                        continue  # committed offsets of a deleted topic
                    queues.append(
                        {
                            "topic": ref.topic,
                            "queue_id": ref.queue_id,
                            "committed": committed.offset,
                            "latest": latest,
                            "lag": max(0, latest - committed.offset),
                        }
                    )
                if group in mns_groups:
                    name = mns_groups[group]
                    try:
                        counts = await queue_counts(processor, caller, name)
                    except (TopicNotFound, QueueNotFound):
                        counts = QueueCounts(active=0, inactive=0, delayed=0)
                    queues.append(
                        {
                            "topic": name,
                            "queue_id": 0,  # all priority levels together
                            "lag": counts.active + counts.inactive,
                            "inflight": counts.inactive,
                        }
                    )
                popped = await members_of(
                    processor, caller, group, self_id=context.directory.self_id, local={}
                )
                queues += [
                    {"topic": q["queue"], "queue_id": 0, "lag": q["lag"], "inflight": q["unacked"]}
                    for q in (popped[0] if popped is not None else [])
                ]
                config = await processor.get_group_config(caller, group)
                result.append(
                    {
                        "namespace": caller.namespace,
                        "name": group,
                        "config": asdict(config),
                        "queues": queues,
                        "lag": sum(q["lag"] for q in queues),
                    }
                )
        return {"groups": result}

    def traffic(connection_id: int) -> dict[str, int | None]:
        """What metering counted for a connection (None where its protocol's work runs
        outside the connection's task, and MQTT's out: ``ConnectionRegistry.count_traffic``,
        ``OUT_NOT_PER_CONNECTION``)."""
        t = context.connections.traffic(connection_id)
        out = t is not None and t.protocol not in OUT_NOT_PER_CONNECTION
        return {
            "messages_in": t.messages_in if t else None,
            "messages_out": t.messages_out if t and out else None,
            "bytes_in": t.bytes_in if t else None,
            "bytes_out": t.bytes_out if t and out else None,
        }

    @router.get("/connections", summary="Open connections, per protocol")
    async def connections(request: Request) -> dict[str, Any]:
        """``tls``: whether the connection came over TLS (null where its listener does
        not say); ``certificate``: the client certificate's subject CN; messages and
        bytes in and out: counted by metering for this connection since it opened
        (``opened_ms``), from which the console shows rates."""
        principal = await _principal(context, request)
        listed = [
            c
            for c in context.connections.list()
            if principal.admin or (c.namespace is not None and principal.may_use(c.namespace))
        ]
        per_protocol: dict[str, int] = {}
        for c in listed:
            per_protocol[c.protocol] = per_protocol.get(c.protocol, 0) + 1
        return {
            "per_protocol": per_protocol,
            "connections": [
                {
                    "id": c.id,
                    "protocol": c.protocol,
                    "peer": c.peer,
                    "opened_ms": c.opened_ms,
                    "user": c.principal.name if c.principal else None,
                    "namespace": c.namespace,
                    "client_id": c.client_id,
                    "tls": c.tls,
                    "certificate": c.certificate,
                    **traffic(c.id),
                }
                for c in listed
            ],
        }

    @router.get("/accounts", summary="Configured accounts, without passwords or secrets")
    async def accounts(request: Request) -> dict[str, Any]:
        principal = await _principal(context, request)
        return {
            "mode": context.config.auth.mode,
            "accounts": [
                {
                    "user": a.user,
                    "namespaces": list(a.namespaces),
                    "default_namespace": a.default_namespace
                    or (a.namespaces[0] if a.namespaces else None),
                    "admin": a.admin,
                    "access_key": a.access_key,
                    "has_password": a.password is not None or a.password_hash is not None,
                    "scram": [
                        m
                        for m, keys in (
                            ("SCRAM-SHA-256", a.scram_sha_256),
                            ("SCRAM-SHA-512", a.scram_sha_512),
                        )
                        if keys is not None or a.password is not None
                    ],
                }
                for a in context.config.auth.accounts
                if principal.admin or a.user == principal.name
            ],
        }

    @router.get("/usage", summary="Metering: messages and bytes per namespace and protocol")
    async def usage(request: Request) -> dict[str, Any]:
        principal = await _principal(context, request)
        return {
            "usage": [
                asdict(u) for u in context.metering.snapshot() if principal.may_use(u.namespace)
            ]
        }

    router.include_router(permissions_router(context, _principal))
    router.include_router(manage_router(context, _principal))
    return router
