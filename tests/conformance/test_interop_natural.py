"""The 5 x 5 matrix with natural names only (docs/interop.md): each client uses what
its application would (exchange ``T`` with a bound queue, Kafka topic ``T``, MQTT
``T/#``, RocketMQ topic ``T``, MNS topic ``T`` with a subscribed queue), no
polymq-specific argument; producers on one gateway, consumers on another."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.conformance.interop.driver import Driver
from polymq.conformance.interop.expectations import PROTOCOLS
from polymq.conformance.interop.matrix import cell_topic, open_drivers, run_cell
from polymq.conformance.results import Outcome
from tests.live_server import LiveServer, live_gateways

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LISTENERS = ("kafka", "amqp", "mqtt", "rocketmq", "http")
RUN = uuid.uuid4().hex[:8]


def _ports(server: LiveServer) -> dict[str, int]:
    ports = {name: server.port(name) for name in LISTENERS}
    ports["mns"] = ports.pop("http")
    return ports


@pytest.fixture(scope="module")
def drivers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, Driver], dict[str, Driver]]]:
    """Natural-name clients: producers on the first gateway, consumers on the second."""
    data_dir: Path = tmp_path_factory.mktemp("interop-natural")
    with (
        live_gateways(data_dir, LISTENERS, 2) as (first, second),
        open_drivers(first.host, _ports(first), natural=True) as producing,
        open_drivers(second.host, _ports(second), natural=True) as consuming,
    ):
        opened = {f"{p} producer": d for p, d in producing.items()}
        opened.update({f"{p} consumer": d for p, d in consuming.items()})
        failed = {p: d for p, d in opened.items() if isinstance(d, Exception)}
        assert not failed, f"clients did not start: {failed}"
        yield (
            {p: d for p, d in producing.items() if not isinstance(d, Exception)},
            {p: d for p, d in consuming.items() if not isinstance(d, Exception)},
        )


@pytest.mark.parametrize("consumer", PROTOCOLS)
@pytest.mark.parametrize("producer", PROTOCOLS)
def test_natural_cell(
    drivers: tuple[dict[str, Driver], dict[str, Driver]], producer: str, consumer: str
) -> None:
    producing, consuming = drivers
    topic = cell_topic(RUN, producer, consumer)
    result = run_cell(producing[producer], consuming[consumer], topic)
    assert result.outcome is Outcome.PASS, result.detail
    assert result.feature == f"{producer} -> {consumer}"
