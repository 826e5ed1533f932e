"""The event bus HTTP API on the HTTP listener (docs/eventbus.md): buses, rules,
CloudEvents ingest and replays, in JSON; errors as ``{"error": code, "message": why}``
with a 4xx status naming the problem.

Requests authenticate as the MNS API's do (``Authorization: MNS key:signature`` over
the same string to sign; the access key decides the namespace); unsigned requests
pass in open auth mode only, in the default namespace.
"""

from __future__ import annotations

import datetime
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import wraps
from typing import Any, Final, ParamSpec

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from polymq.gateway.accounts import AccessDenied, Accounts, AuthError
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.eventbus.cloudevent import (
    BATCH_TYPE,
    STRUCTURED_TYPE,
    CloudEvent,
    EventError,
    parse_batch,
    parse_binary,
    parse_structured,
)
from polymq.protocols.eventbus.dispatcher import Dispatchers
from polymq.protocols.eventbus.mapping import event_to_message
from polymq.protocols.eventbus.model import Bus, DefinitionError, Rule, bus_topic, check_name
from polymq.protocols.eventbus.store import BusStore, NotFound
from polymq.protocols.mns.auth import RequestAuth
from polymq.protocols.mns.errors import MnsError
from polymq.storage.errors import StorageError, TopicNotFound
from polymq.storage.model import AppendRequest, Message, QueueRef

__all__ = ["EventBusApi"]

log = logging.getLogger(__name__)

PROTOCOL: Final = "eventbus"
MAX_BODY_BYTES: Final = 1024 * 1024
MAX_BATCH_EVENTS: Final = 100
MAX_REPLAY_EVENTS: Final = 100_000
_REPLAY_READ: Final = 500

P = ParamSpec("P")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _answer(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


def _json_errors(
    endpoint: Callable[P, Awaitable[Response]],
) -> Callable[P, Awaitable[Response]]:
    """Every failure as the API's JSON error (the app's own handlers answer MNS XML)."""

    @wraps(endpoint)
    async def wrapped(*args: P.args, **kwargs: P.kwargs) -> Response:
        try:
            return await endpoint(*args, **kwargs)
        except ApiError as e:
            return _answer(e.status, e.code, e.message)
        except EventError as e:
            return _answer(400, "InvalidEvent", str(e))
        except DefinitionError as e:
            return _answer(400, "InvalidDefinition", str(e))
        except NotFound as e:
            return _answer(404, "NotFound", str(e))
        except MnsError as e:
            return _answer(e.status, e.code, e.message)
        except AccessDenied as e:
            return _answer(403, "AccessDenied", str(e))
        except AuthError as e:
            return _answer(401, "Unauthorized", str(e))
        except StorageError as e:
            log.warning("eventbus: storage failed: %s", e)
            return _answer(503, "Unavailable", f"storage is not available: {e}")

    return wrapped


def _time_ms(value: Any, what: str) -> int:
    """Epoch milliseconds, or an RFC 3339 timestamp."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            stamp = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=datetime.UTC)
            return int(stamp.timestamp() * 1000)
    raise ApiError(400, "InvalidReplay", f"{what} is epoch milliseconds or an RFC 3339 time")


class EventBusApi:
    """The routes, and the dispatchers to run beside them (:attr:`dispatchers`)."""

    def __init__(self, *, processor: Processor, accounts: Accounts, max_date_skew_s: int) -> None:
        self._processor = processor
        self._auth = RequestAuth(accounts, processor.clock, max_date_skew_s=max_date_skew_s)
        self.store = BusStore(processor)
        self.dispatchers = Dispatchers(self.store)

    def _caller(self, request: Request) -> Caller:
        principal = self._auth.principal(
            method=request.method,
            raw_path=(request.scope.get("raw_path") or request.scope["path"].encode()).decode(),
            query=request.scope.get("query_string", b"").decode(),
            headers=request.headers.items(),
        )
        return Caller(principal=principal, namespace=principal.default_namespace, protocol=PROTOCOL)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, "TooLarge", f"the body exceeds {MAX_BODY_BYTES} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ApiError(413, "TooLarge", f"the body exceeds {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "ClientGone", "the client left mid-request") from None
        return b"".join(chunks)

    async def _json(self, request: Request) -> Any:
        body = await self._body(request)
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "InvalidJson", f"the body is not valid JSON: {e}") from None

    # -- buses -------------------------------------------------------------------

    @_json_errors
    async def list_buses(self, request: Request) -> Response:
        caller = self._caller(request)
        buses = await self.store.buses(caller)
        return JSONResponse({"buses": [{"name": b.name, **b.to_json()} for b in buses]})

    @_json_errors
    async def put_bus(self, request: Request, bus: str) -> Response:
        caller = self._caller(request)
        created = await self.store.put_bus(caller, Bus.parse(bus, await self._json(request)))
        found = await self.store.bus(caller, bus)
        return JSONResponse({"name": bus, **found.to_json()}, status_code=201 if created else 200)

    @_json_errors
    async def get_bus(self, request: Request, bus: str) -> Response:
        found = await self.store.bus(self._caller(request), check_name("bus", bus))
        return JSONResponse({"name": bus, **found.to_json()})

    @_json_errors
    async def delete_bus(self, request: Request, bus: str) -> Response:
        await self.store.delete_bus(self._caller(request), bus)
        return Response(status_code=204)

    # -- rules -------------------------------------------------------------------

    @_json_errors
    async def list_rules(self, request: Request, bus: str) -> Response:
        caller = self._caller(request)
        await self.store.bus(caller, bus)
        rules = await self.store.rules(caller, bus)
        return JSONResponse({"rules": [{"name": r.name, **r.to_json()} for r in rules]})

    @_json_errors
    async def put_rule(self, request: Request, bus: str, rule: str) -> Response:
        caller = self._caller(request)
        parsed = Rule.parse(bus, rule, await self._json(request))
        created = await self.store.put_rule(caller, parsed)
        return JSONResponse({"name": rule, **parsed.to_json()}, status_code=201 if created else 200)

    @_json_errors
    async def get_rule(self, request: Request, bus: str, rule: str) -> Response:
        found = await self.store.rule(self._caller(request), bus, rule)
        return JSONResponse({"name": rule, **found.to_json()})

    @_json_errors
    async def delete_rule(self, request: Request, bus: str, rule: str) -> Response:
        await self.store.delete_rule(self._caller(request), bus, rule)
        return Response(status_code=204)

    # -- events ------------------------------------------------------------------

    @_json_errors
    async def post_events(self, request: Request, bus: str) -> Response:
        """Ingest: structured (one event), batched, or binary mode, chosen by the
        Content-Type (http-protocol-binding.md 3). All or nothing: a batch with one
        bad event stores none."""
        caller = self._caller(request)
        await self.store.bus(caller, bus)
        body = await self._body(request)
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        events: list[CloudEvent]
        if media == STRUCTURED_TYPE:
            events = [parse_structured(body)]
        elif media == BATCH_TYPE:
            events = parse_batch(body, max_events=MAX_BATCH_EVENTS)
        else:
            events = [parse_binary(request.headers.items(), body)]
        if not events:
            return JSONResponse({"events": []}, status_code=202)
        queue = QueueRef(caller.namespace, bus_topic(bus))
        requests = [AppendRequest(entry=event_to_message(e), queues=(queue,)) for e in events]
        results = await self._processor.append(caller, requests)
        return JSONResponse(
            {
                "events": [
                    {"id": e.id, "message_id": r.message_id}
                    for e, r in zip(events, results, strict=True)
                ]
            },
            status_code=202,
        )

    @_json_errors
    async def post_replay(self, request: Request, bus: str) -> Response:
        """Archived events stored from ``start`` up to ``end`` go through the bus
        again (appended anew, with extension ``replayname``)."""
        caller = self._caller(request)
        await self.store.bus(caller, bus)
        document = await self._json(request)
        if not isinstance(document, dict) or "start" not in document or "end" not in document:
            raise ApiError(400, "InvalidReplay", "a replay is {'start': time, 'end': time}")
        start, end = _time_ms(document["start"], "start"), _time_ms(document["end"], "end")
        if end < start:
            raise ApiError(400, "InvalidReplay", "end is before start")
        name = document.get("name") or uuid.uuid4().hex[:12]
        if not isinstance(name, str):
            raise ApiError(400, "InvalidReplay", "name is a string")
        count = await self._replay(caller, bus, start, end, name)
        return JSONResponse({"name": name, "replayed": count})

    async def _replay(self, caller: Caller, bus: str, start: int, end: int, name: str) -> int:
        topic = bus_topic(bus)
        try:
            info = await self._processor.describe_topic(caller, topic)
        except TopicNotFound:
            return 0
        count = 0
        for queue_id, offsets in enumerate(info.queues):
            ref = QueueRef(caller.namespace, topic, queue_id)
            offset = await self._processor.offset_for_timestamp(caller, ref, start)
            stop = offsets.latest  # what is appended now (the replay itself) is not read
            while offset < stop and count < MAX_REPLAY_EVENTS:
                read = await self._processor.read(
                    caller, ref, offset, max_messages=_REPLAY_READ, wait_ms=0, metered=False
                )
                if not read.messages:
                    break
                chosen = [
                    m
                    for m in read.messages
                    if m.offset < stop
                    and start <= m.store_timestamp_ms <= end
                    and m.message.property("ce_replayname") is None
                ]
                if chosen:
                    await self._processor.append(
                        caller, [self._replayed(m.message, ref, name) for m in chosen]
                    )
                    count += len(chosen)
                offset = read.next_offset
                if any(m.store_timestamp_ms > end for m in read.messages):
                    break
        return count

    @staticmethod
    def _replayed(message: Message, ref: QueueRef, name: str) -> AppendRequest:
        properties = (*message.properties, ("ce_replayname", name.encode()))
        return AppendRequest(entry=replace(message, properties=properties), queues=(ref,))

    def router(self) -> APIRouter:
        router = APIRouter(tags=["event bus"])
        bus, rule = "/buses/{bus}", "/buses/{bus}/rules/{rule}"
        router.add_api_route("/buses", self.list_buses, methods=["GET"], summary="List buses")
        router.add_api_route(bus, self.put_bus, methods=["PUT"], summary="Create or change a bus")
        router.add_api_route(bus, self.get_bus, methods=["GET"], summary="Describe a bus")
        router.add_api_route(bus, self.delete_bus, methods=["DELETE"], summary="Delete a bus")
        router.add_api_route(
            f"{bus}/rules", self.list_rules, methods=["GET"], summary="List a bus's rules"
        )
        router.add_api_route(rule, self.put_rule, methods=["PUT"], summary="Create/replace a rule")
        router.add_api_route(rule, self.get_rule, methods=["GET"], summary="Describe a rule")
        router.add_api_route(rule, self.delete_rule, methods=["DELETE"], summary="Delete a rule")
        router.add_api_route(
            f"{bus}/events", self.post_events, methods=["POST"], summary="Ingest CloudEvents"
        )
        router.add_api_route(
            f"{bus}/replays", self.post_replay, methods=["POST"], summary="Replay archived events"
        )
        return router
