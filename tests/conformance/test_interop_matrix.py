"""The 5 x 5 interoperability matrix against a live polymq: every (producer, consumer)
pair of kafka, amqp, mqtt, rocketmq and the MNS-style HTTP API, each with the real
client, each cell judged against conformance/interop/expectations.py (the table
docs/interop.md shows)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.conformance.interop.driver import Driver
from polymq.conformance.interop.expectations import PROTOCOLS
from polymq.conformance.interop.matrix import cell_topic, open_drivers, run_cell
from polymq.conformance.results import Outcome
from tests.live_server import live_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LISTENERS = ("kafka", "amqp", "mqtt", "rocketmq", "http")
RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Driver]]:
    """One server and one connected client per protocol for the whole matrix."""
    data_dir: Path = tmp_path_factory.mktemp("interop")
    with live_server(data_dir, LISTENERS) as server:
        ports = {name: server.port(name) for name in LISTENERS}
        ports["mns"] = ports.pop("http")
        with open_drivers(server.host, ports) as opened:
            failed = {p: d for p, d in opened.items() if isinstance(d, Exception)}
            assert not failed, f"clients did not start: {failed}"
            yield {p: d for p, d in opened.items() if not isinstance(d, Exception)}


@pytest.mark.parametrize("consumer", PROTOCOLS)
@pytest.mark.parametrize("producer", PROTOCOLS)
def test_cell(drivers: dict[str, Driver], producer: str, consumer: str) -> None:
    topic = cell_topic(RUN, producer, consumer)
    result = run_cell(drivers[producer], drivers[consumer], topic)
    assert result.outcome is Outcome.PASS, result.detail
    assert result.feature == f"{producer} -> {consumer}"
