"""What the admin API's action routes share (docs/admin.md): who may act (admin
accounts; anyone in ``open`` mode, where nobody is checked), in which namespace, on
which topic, and how a message is shown without being consumed."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel, ValidationError

from polymq.gateway.accounts import Principal
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.processor import Caller, Processor
from polymq.storage.errors import TopicNotFound
from polymq.storage.model import QueueRef, StoredMessage, TopicInfo

__all__ = ["PROTOCOL", "AdminScope", "PrincipalOf", "body_schema", "peek", "preview"]

PROTOCOL = "http"
_PREVIEW_BYTES = 256  # a body preview's length: enough to recognise a message
PEEK_MAX = 100
_MAX_BODY_BYTES = 1024 * 1024  # a test message of the largest default size, and then some

ModelT = TypeVar("ModelT", bound=BaseModel)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` naming a route's JSON body, for a route that reads its body
    itself (:meth:`AdminScope.body`) so that /docs still shows it."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


PrincipalOf = Callable[[ListenerContext, Request], Awaitable[Principal]]


class AdminScope:
    """The checks every action makes before it acts, through the processor."""

    def __init__(self, context: ListenerContext, principal_of: PrincipalOf) -> None:
        self.context = context
        self.processor = context.processor
        self._principal_of = principal_of

    async def principal(self, request: Request) -> Principal:
        return await self._principal_of(self.context, request)

    async def admin(self, request: Request) -> Principal:
        principal = await self.principal(request)
        if not principal.admin:
            raise HTTPException(403, "only admin accounts may do this")
        return principal

    async def visible(self, principal: Principal) -> list[str]:
        base = Caller(principal=principal, namespace=principal.default_namespace, protocol=PROTOCOL)
        return await self.processor.list_namespaces(base)

    async def admin_in(self, request: Request, namespace: str) -> Caller:
        """The caller for an action in ``namespace``: 403 unless an admin, 404 unless
        the namespace exists and is visible."""
        principal = await self.admin(request)
        if namespace not in await self.visible(principal):
            raise HTTPException(404, f"no namespace {namespace!r}")
        return Caller(principal=principal, namespace=namespace, protocol=PROTOCOL)

    async def body(self, request: Request, model: type[ModelT]) -> ModelT:
        """The request's JSON body as ``model``, read only after :meth:`admin_in` or
        :meth:`admin` let the caller in (a FastAPI body parameter is read before any
        check runs, so anyone could make the gateway buffer and parse it), and at
        most 1 MiB of it."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > _MAX_BODY_BYTES:
            raise HTTPException(413, f"the body is over {_MAX_BODY_BYTES} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_BODY_BYTES:
                raise HTTPException(413, f"the body is over {_MAX_BODY_BYTES} bytes")
        try:
            return model.model_validate_json(bytes(raw))
        except ValidationError as e:
            raise HTTPException(422, e.errors(include_url=False, include_input=False)) from None

    async def described(self, caller: Caller, topic: str) -> TopicInfo:
        try:
            return await self.processor.describe_topic(caller, topic)
        except TopicNotFound:
            raise HTTPException(404, f"no topic {topic!r} in {caller.namespace!r}") from None


def preview(m: StoredMessage) -> dict[str, Any]:
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


async def peek(
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
            shown.extend(preview(m) for m in result.messages)
            if not result.messages or result.next_offset <= offset:
                break
            offset = result.next_offset
    return shown
