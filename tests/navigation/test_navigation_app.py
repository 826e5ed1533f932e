"""The navigation HTTP API on a real uvicorn server on a free port, driven with httpx."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from polymq.gateway.config import GatewayConfig, NavigationConfig, ServerConfig
from polymq.gateway.roles import serve_navigation
from polymq.navigation.server import NavigationServer
from polymq.storage.clock import ManualClock

EXPIRY = 10_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def http(clock: ManualClock) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        NavigationServer(gateway_expiry_ms=EXPIRY, clock=clock) as navigation,
        httpx.AsyncClient(base_url=navigation.url, timeout=10) as client,
    ):
        yield client


def gateway(gateway_id: str, zone: str, load: float, **ports: int) -> dict[str, Any]:
    return {
        "gateway_id": gateway_id,
        "zone": zone,
        "load": load,
        "endpoints": [
            {"protocol": protocol, "host": f"{gateway_id}.example", "port": port}
            for protocol, port in ports.items()
        ],
    }


async def beat(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await http.post("/v1/gateways/heartbeat", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"gateway_id": body["gateway_id"], "gateway_expiry_ms": EXPIRY}


async def endpoints(http: httpx.AsyncClient, **params: str) -> list[dict[str, Any]]:
    response = await http.get("/v1/endpoints", params=params)
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["endpoints"]
    return found


async def test_registered_gateways_are_found_by_protocol_and_zone(
    http: httpx.AsyncClient,
) -> None:
    await beat(http, gateway("g1", "east", 3, kafka=9092, amqp=5672))
    await beat(http, gateway("g2", "west", 1, kafka=19092))
    await beat(http, gateway("g3", "east", 2, kafka=29092))
    found = await endpoints(http, protocol="kafka", namespace="tenant-a", zone="east")
    assert found == [
        {"gateway_id": "g3", "host": "g3.example", "port": 29092, "zone": "east", "load": 2.0},
        {"gateway_id": "g1", "host": "g1.example", "port": 9092, "zone": "east", "load": 3.0},
        {"gateway_id": "g2", "host": "g2.example", "port": 19092, "zone": "west", "load": 1.0},
    ]
    assert [e["gateway_id"] for e in await endpoints(http, protocol="kafka")] == ["g2", "g3", "g1"]
    assert [e["port"] for e in await endpoints(http, protocol="amqp")] == [5672]
    assert await endpoints(http, protocol="mqtt") == []


async def test_delete_and_expiry_remove_gateways(
    http: httpx.AsyncClient, clock: ManualClock
) -> None:
    await beat(http, gateway("g1", "", 0, kafka=1))
    await beat(http, gateway("g2", "", 0, kafka=2))
    response = await http.delete("/v1/gateways/g1")
    assert response.status_code == 204
    assert (await http.delete("/v1/gateways/g1")).status_code == 204  # idempotent
    assert [e["gateway_id"] for e in await endpoints(http, protocol="kafka")] == ["g2"]
    clock.advance(EXPIRY + 1)
    assert await endpoints(http, protocol="kafka") == []
    listed = (await http.get("/v1/gateways")).json()["gateways"]
    assert [(g["gateway_id"], g["healthy"]) for g in listed] == [("g2", False)]
    assert listed[0]["endpoints"] == [{"protocol": "kafka", "host": "g2.example", "port": 2}]
    await beat(http, gateway("g2", "", 0, kafka=2))
    listed = (await http.get("/v1/gateways")).json()["gateways"]
    assert [(g["gateway_id"], g["healthy"]) for g in listed] == [("g2", True)]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"zone": "z"}, "gateway_id: Field required"),
        ({"gateway_id": ""}, "gateway_id"),
        ({"gateway_id": "g", "load": -1}, "load"),
        ({"gateway_id": "g", "load": "busy"}, "load"),
        ({"gateway_id": "g", "endpoints": [{"protocol": "kafka", "host": "h"}]}, "port"),
        (
            {"gateway_id": "g", "endpoints": [{"protocol": "kafka", "host": "h", "port": 0}]},
            "endpoints.0.port",
        ),
        ({"gateway_id": "g", "colour": "red"}, "colour"),
    ],
)
async def test_bad_heartbeats_are_refused_with_a_clear_message(
    http: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    response = await http.post("/v1/gateways/heartbeat", json=body)
    assert response.status_code == 422
    answer = response.json()
    assert answer["error"] == "invalid_request"
    assert field in answer["message"]
    assert (await http.get("/v1/gateways")).json() == {"gateways": []}


async def test_bad_requests_are_refused_and_the_server_goes_on(http: httpx.AsyncClient) -> None:
    response = await http.get("/v1/endpoints")
    assert response.status_code == 422
    assert "protocol: Field required" in response.json()["message"]
    response = await http.post(
        "/v1/gateways/heartbeat", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/nowhere")).status_code == 404


async def test_serve_navigation_logs_its_address_and_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = GatewayConfig(
        server=ServerConfig(host="127.0.0.1"), navigation=NavigationConfig(port=0)
    )
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="polymq.gateway.roles"):
        task = asyncio.create_task(serve_navigation(config, stop))
        async with asyncio.timeout(10):
            while not any(r.getMessage() == "ready" for r in caplog.records):
                if task.done():
                    await task
                await asyncio.sleep(0.01)
        line = next(r.getMessage() for r in caplog.records if "listening on" in r.getMessage())
        match = re.search(r"listening on (http://\S+),", line)
        assert match is not None
        async with httpx.AsyncClient(base_url=match[1]) as http:
            assert (await http.get("/healthz")).status_code == 200
        stop.set()
        await asyncio.wait_for(task, 10)
    assert any(r.getMessage() == "stopped" for r in caplog.records)
