"""A live gateway serving Kafka, shared by a module's tests (starting one costs more
than most tests), plus helpers to make unique topic names."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.protocols.kafka.listener import kafka_listener
from tests.live_server import LiveServer, live_server

_names = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("kafka")
    with live_server(data_dir, ("kafka",), factories={"kafka": kafka_listener}) as live:
        yield live


@pytest.fixture
def bootstrap(server: LiveServer) -> str:
    host, port = server.address("kafka")
    return f"{host}:{port}"


@pytest.fixture
def topic() -> str:
    return f"t{os.getpid()}-{next(_names)}"
