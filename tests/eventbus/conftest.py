"""One live gateway per test module and form: HTTP (the bus API), Kafka, AMQP and
MQTT (the protocols whose real clients consume what the bus delivers)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.live_server import LiveServer, live_server

LISTENERS = ("http", "kafka", "amqp", "mqtt")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("eventbus"), LISTENERS) as started:
        yield started


@pytest.fixture
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port('http')}", timeout=30) as c:
        yield c
