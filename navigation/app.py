"""The navigation HTTP API: gateways register their listeners, clients (and gateways
answering Kafka Metadata or RocketMQ QueryRoute) ask where to connect.

Validation is pydantic's; its errors are answered 422 with a one-line ``message``
naming each bad field, besides FastAPI's usual ``detail`` list.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from polymq.navigation.registry import GatewayRegistry, Listener
from polymq.storage.clock import Clock

__all__ = ["build_app"]

_Name = Annotated[str, Field(min_length=1, max_length=255)]


class EndpointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol: _Name
    host: _Name
    port: Annotated[int, Field(gt=0, lt=65536)]


class HeartbeatIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gateway_id: _Name
    zone: Annotated[str, Field(max_length=255)] = ""
    load: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    endpoints: Annotated[list[EndpointIn], Field(max_length=64)] = []


class EndpointOut(BaseModel):
    gateway_id: str
    host: str
    port: int
    zone: str
    load: float


class EndpointsOut(BaseModel):
    endpoints: list[EndpointOut]


class GatewayOut(BaseModel):
    gateway_id: str
    zone: str
    load: float
    endpoints: list[EndpointIn]
    last_seen_ms: int
    healthy: bool


class GatewaysOut(BaseModel):
    gateways: list[GatewayOut]


class HeartbeatOut(BaseModel):
    gateway_id: str
    gateway_expiry_ms: int


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def build_app(registry: GatewayRegistry, clock: Clock) -> FastAPI:
    app = FastAPI(
        title="polymq navigation",
        summary="Where the gateways are: register, heartbeat, find the least loaded.",
        version="1",
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body: dict[str, Any] = {
            "error": "invalid_request",
            "message": _validation_message(exc),
            "detail": exc.errors(),
        }
        return JSONResponse(body, status_code=422)

    @app.post("/v1/gateways/heartbeat")
    async def heartbeat(body: HeartbeatIn) -> HeartbeatOut:
        """Register or refresh a gateway; everything it said before is replaced."""
        registry.heartbeat(
            gateway_id=body.gateway_id,
            zone=body.zone,
            load=body.load,
            listeners=[
                Listener(protocol=e.protocol, host=e.host, port=e.port) for e in body.endpoints
            ],
            now_ms=clock.now_ms(),
        )
        return HeartbeatOut(gateway_id=body.gateway_id, gateway_expiry_ms=registry.expiry_ms)

    # ``:path``: an id may hold a slash (sent as %2F, which the router sees decoded).
    @app.delete("/v1/gateways/{gateway_id:path}", status_code=204)
    async def remove(gateway_id: str) -> Response:
        """A gateway stopping cleanly: clients stop being sent to it at once. Unknown
        ids are fine (the gateway may have expired already): deleting is idempotent."""
        registry.remove(gateway_id)
        return Response(status_code=204)

    @app.get("/v1/endpoints")
    async def endpoints(
        protocol: Annotated[str, Query(min_length=1, max_length=255)],
        namespace: Annotated[str, Query(max_length=255)] = "",
        zone: Annotated[str, Query(max_length=255)] = "",
    ) -> EndpointsOut:
        """Healthy gateways serving ``protocol``: ``zone`` first, least loaded first.
        Every gateway serves every namespace, so ``namespace`` does not filter (it is
        accepted so clients can send it, and a future placement may use it)."""
        del namespace
        found = registry.endpoints(protocol, clock.now_ms(), zone=zone)
        return EndpointsOut(
            endpoints=[
                EndpointOut(
                    gateway_id=e.gateway_id, host=e.host, port=e.port, zone=e.zone, load=e.load
                )
                for e in found
            ]
        )

    @app.get("/v1/gateways")
    async def gateways() -> GatewaysOut:
        """Every gateway remembered, with its health (for ``polymq cluster status``)."""
        now_ms = clock.now_ms()
        return GatewaysOut(
            gateways=[
                GatewayOut(
                    gateway_id=r.gateway_id,
                    zone=r.zone,
                    load=r.load,
                    endpoints=[
                        EndpointIn(protocol=li.protocol, host=li.host, port=li.port)
                        for li in r.listeners
                    ],
                    last_seen_ms=r.last_seen_ms,
                    healthy=r.healthy(now_ms, registry.expiry_ms),
                )
                for r in registry.gateways(now_ms)
            ]
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
