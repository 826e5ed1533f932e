"""The MNS HTTP API (MNS API reference: queues, topics, subscriptions, account), each
operation to one handler of :mod:`queue_handlers` or :mod:`topic_handlers`.

Requests are signed per request (``Authorization: MNS AccessKeyId:Signature``); the
access key decides the namespace. In open auth mode unsigned requests act as the
anonymous admin in the default namespace.

One table names the routes. It is served by :class:`MnsDispatcher`, a plain ASGI app
in front of FastAPI: MNS requests are hot (one per message sent, received or deleted)
and need none of FastAPI's parameter validation or dependency injection, which cost
more than the handler itself. The same table is registered as FastAPI routes only so
that ``/docs`` describes the MNS API too; FastAPI serves everything else.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from polymq.gateway.accounts import Accounts
from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.processor import Processor
from polymq.gateway.quotas import Quotas
from polymq.protocols.mns import codec
from polymq.protocols.mns.auth import RequestAuth
from polymq.protocols.mns.errors import MnsError, from_exception
from polymq.protocols.mns.notify import Notifier
from polymq.protocols.mns.queue_handlers import QueueHandlers
from polymq.protocols.mns.queues import QueueService
from polymq.protocols.mns.quota import charge_answer
from polymq.protocols.mns.request import PeerGone, RequestReader, error_response
from polymq.protocols.mns.topic_feed import TopicFeeds
from polymq.protocols.mns.topic_handlers import TopicHandlers
from polymq.protocols.mns.topics import TopicService

__all__ = ["MnsApi", "MnsDispatcher", "Route"]

log = logging.getLogger(__name__)

Endpoint = Callable[..., Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Route:
    """One MNS operation. ``path`` is the template (``/queues/{queue}``): it labels the
    latency histogram, as FastAPI's route objects do."""

    method: str
    path: str
    endpoint: Endpoint
    summary: str

    def segments(self) -> list[str]:
        return self.path[1:].split("/")


class MnsDispatcher:
    """ASGI: a request whose method and path match a :class:`Route` goes straight to
    its handler; any other goes to ``fallback`` (the FastAPI app)."""

    def __init__(self, routes: tuple[Route, ...], fallback: ASGIApp) -> None:
        self._fallback = fallback
        # (method, segment count) -> [(route, literal segments by index, params by index)]
        self._table: dict[
            tuple[str, int],
            list[tuple[Route, tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]],
        ] = {}
        for route in routes:
            parts = route.segments()
            literals = tuple((i, p) for i, p in enumerate(parts) if not p.startswith("{"))
            params = tuple((i, p[1:-1]) for i, p in enumerate(parts) if p.startswith("{"))
            self._table.setdefault((route.method, len(parts)), []).append((route, literals, params))

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]] | None:
        parts = path[1:].split("/")
        for route, literals, params in self._table.get((method, len(parts)), ()):
            if all(parts[i] == text for i, text in literals):
                values = {name: parts[i] for i, name in params}
                if all(values.values()):
                    return route, values
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.match(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if found is None:
            await self._fallback(scope, receive, send)
            return
        route, params = found
        scope["route"] = route
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request, **params)
        except PeerGone:
            log.info("%s %s: the client left mid-request", scope["method"], route.path)
            return  # its connection is gone: uvicorn closes it
        except Exception as exc:
            response = _error(request, exc)
        charge_answer(request, response)
        await response(scope, receive, send)


def _error(request: Request, exc: Exception) -> Response:
    error = from_exception(exc)
    if error is None:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        error = MnsError("InternalError", "Internal error.", 500)
    elif error.status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return error_response(request, error)


class MnsApi:
    """The services and handlers of the MNS API, and the router over them."""

    def __init__(
        self,
        *,
        processor: Processor,
        accounts: Accounts,
        notifier: Notifier,
        max_message_bytes: int,
        max_date_skew_s: int,
        connections: ConnectionRegistry | None = None,
        max_depth: int = codec.MAX_DEPTH,
        max_items: int = codec.MAX_ITEMS,
        quotas: Quotas | None = None,
    ) -> None:
        auth = RequestAuth(accounts, processor.clock, max_date_skew_s=max_date_skew_s)
        reader = RequestReader(
            auth,
            max_message_bytes=max_message_bytes,
            connections=connections,
            max_depth=max_depth,
            max_items=max_items,
            quotas=quotas,
        )
        self.queues = QueueService(processor, max_message_bytes=max_message_bytes)
        self.topics = TopicService(processor, notifier, max_message_bytes=max_message_bytes)
        # What other protocols store in a subscribed topic reaches its subscriptions.
        notifier.also_run(TopicFeeds(self.topics, notifier).run)
        self._queue_handlers = QueueHandlers(reader, self.queues)
        self._topic_handlers = TopicHandlers(reader, self.topics)

    def routes(self) -> tuple[Route, ...]:
        q, t = self._queue_handlers, self._topic_handlers
        subscription = "/topics/{topic}/subscriptions/{subscription}"
        return (
            Route("GET", "/", q.get_account, "GetAccountAttributes"),
            Route("PUT", "/", q.put_account, "SetAccountAttributes"),
            Route("GET", "/queues", q.list_queues, "ListQueue"),
            Route("PUT", "/queues/{queue}", q.put_queue, "CreateQueue / SetQueueAttributes"),
            Route("GET", "/queues/{queue}", q.get_queue, "GetQueueAttributes"),
            Route("DELETE", "/queues/{queue}", q.delete_queue, "DeleteQueue"),
            Route("POST", "/queues/{queue}/messages", q.post_messages, "SendMessage / Batch"),
            Route("GET", "/queues/{queue}/messages", q.get_messages, "Receive / Peek (Batch)"),
            Route("DELETE", "/queues/{queue}/messages", q.delete_messages, "DeleteMessage / Batch"),
            Route("PUT", "/queues/{queue}/messages", q.put_messages, "ChangeMessageVisibility"),
            Route("GET", "/topics", t.list_topics, "ListTopic"),
            Route("PUT", "/topics/{topic}", t.put_topic, "CreateTopic / SetTopicAttributes"),
            Route("GET", "/topics/{topic}", t.get_topic, "GetTopicAttributes"),
            Route("DELETE", "/topics/{topic}", t.delete_topic, "DeleteTopic"),
            Route("POST", "/topics/{topic}/messages", t.publish, "PublishMessage"),
            Route("GET", "/topics/{topic}/subscriptions", t.list_subscriptions, "ListSubscription"),
            Route("PUT", subscription, t.put_subscription, "Subscribe / SetSubscriptionAttributes"),
            Route("GET", subscription, t.get_subscription, "GetSubscriptionAttributes"),
            Route("DELETE", subscription, t.delete_subscription, "Unsubscribe"),
        )

    def dispatcher(self, fallback: ASGIApp) -> MnsDispatcher:
        """The ASGI app that serves the MNS routes, in front of ``fallback``."""
        return MnsDispatcher(self.routes(), fallback)

    def router(self) -> APIRouter:
        """The same routes for FastAPI, so that ``/docs`` shows them; requests reach
        them only if no dispatcher is in front."""
        router = APIRouter(tags=["MNS"])
        for route in self.routes():
            router.add_api_route(
                route.path,
                route.endpoint,
                methods=[route.method],
                summary=route.summary,
                response_class=Response,
                name=route.summary,
            )
        return router
