"""The app served on the HTTP port: the MNS API (through its own dispatcher, in front),
and a FastAPI app with the admin API, ``/metrics``, ``/healthz`` and the OpenAPI page
at ``/docs``; request latency is timed around both."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp

from polymq.gateway.accounts import AuthError
from polymq.gateway.listeners import ListenerContext
from polymq.protocols.eventbus.routes import EventBusApi
from polymq.protocols.http.admin import admin_router
from polymq.protocols.http.console import console_router
from polymq.protocols.http.metrics import GatewayMetrics, LatencyMiddleware
from polymq.protocols.mns.errors import MnsError, from_exception
from polymq.protocols.mns.notify import Notifier
from polymq.protocols.mns.request import error_response
from polymq.protocols.mns.routes import MnsApi
from polymq.storage.errors import StorageError

__all__ = ["HttpApp", "build_app"]

log = logging.getLogger(__name__)

_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class HttpApp:
    """The app and the parts its listener starts and stops around it. ``asgi`` is what
    the server runs: the MNS dispatcher in front of ``app``, timed."""

    asgi: ASGIApp
    app: FastAPI
    api: MnsApi
    notifier: Notifier
    metrics: GatewayMetrics


def build_app(context: ListenerContext, *, notify_retry_unit_ms: int = 1000) -> HttpApp:
    notifier = Notifier(context.processor, retry_unit_ms=notify_retry_unit_ms)
    api = MnsApi(
        processor=context.processor,
        accounts=context.accounts,
        notifier=notifier,
        max_message_bytes=context.config.http.max_message_bytes,
        max_date_skew_s=context.config.http.max_date_skew_s,
        connections=context.connections,
        max_depth=context.config.limits.max_nesting_depth,
        max_items=context.config.limits.max_batch_items,
        quotas=context.quotas,
    )
    metrics = GatewayMetrics(context)
    app = FastAPI(
        title="polymq HTTP API",
        summary="Alibaba MNS-style queues and topics, admin API and metrics.",
        version="1",
    )
    app.include_router(api.router())
    app.include_router(admin_router(context))
    app.include_router(console_router())  # /console: the web console (docs/admin.md)
    # The event bus (docs/eventbus.md); its dispatchers live as long as the notifier.
    bus = EventBusApi(
        processor=context.processor,
        accounts=context.accounts,
        max_date_skew_s=context.config.http.max_date_skew_s,
    )
    app.include_router(bus.router())
    notifier.also_run(bus.dispatchers.run)

    @app.get("/healthz", tags=["ops"], summary="Liveness: the gateway answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def prometheus() -> Response:
        await metrics.refresh()
        return Response(metrics.render(), media_type=_PROMETHEUS_TEXT)

    async def known_error(request: Request, exc: Exception) -> Response:
        error = from_exception(exc)
        if error is None:  # registered only for the types from_exception knows
            raise exc
        if error.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(request, error)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        if request.url.path.startswith(("/queues", "/topics")):
            return error_response(request, MnsError("InternalError", "Internal error.", 500))
        return PlainTextResponse("internal error", status_code=500)

    app.add_exception_handler(MnsError, known_error)
    app.add_exception_handler(StorageError, known_error)
    app.add_exception_handler(AuthError, known_error)
    app.add_exception_handler(Exception, unexpected)
    asgi = LatencyMiddleware(api.dispatcher(app), histogram=metrics.latency)
    return HttpApp(asgi=asgi, app=app, api=api, notifier=notifier, metrics=metrics)
