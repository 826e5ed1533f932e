"""bench/_server.py, the protocol benchmarks' server harness: it starts the real
polymq command with only the listeners asked for, measures the process, stops it, and
fails clearly (not after a timeout) when the server cannot start."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

import bench._server  # noqa: E402
from bench._server import Meter, polymq_server  # noqa: E402


def _listening_ports(pid: int | None) -> set[int]:
    assert pid is not None
    return {
        conn.laddr.port
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    }


@pytest.mark.timeout(120)
def test_server_listens_only_where_asked_is_measured_and_stops(tmp_path: Path) -> None:
    with polymq_server("mqtt", also=("mqtt_ws",), data_dir=tmp_path) as server:
        assert server.address == f"127.0.0.1:{server.port}"
        with socket.create_connection((server.host, server.port), timeout=10):
            pass
        ports = _listening_ports(server.pid)
        assert server.port in ports
        assert len(ports) == 2, ports  # mqtt and mqtt_ws; kafka, amqp, ... disabled
        meter = Meter(server.pid)
        assert meter.cpu() > 0
        assert meter.rss_mib() > 10
        process = psutil.Process(server.pid)
    assert not process.is_running()
    assert any(tmp_path.iterdir()), "the server wrote nothing in its data dir"


@pytest.mark.timeout(120)
def test_a_server_that_exits_fails_at_once_with_its_code() -> None:
    with (
        pytest.raises(RuntimeError, match="exited with code 2"),
        polymq_server("amqp", settings={"limits.max_connections": "0"}),
    ):
        pass


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real_free_port = bench._server.free_port

    def first_taken() -> int:
        return ports.pop() if ports else real_free_port()

    monkeypatch.setattr(bench._server, "free_port", first_taken)
    with taken, polymq_server("amqp") as server:
        assert server.port != taken.getsockname()[1]
        assert server.port in _listening_ports(server.pid)


def test_unknown_listener_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown listeners"), polymq_server("smtp"):
        pass


def test_meter_without_pid_reads_zero() -> None:
    meter = Meter(None)
    assert meter.cpu() == 0.0
    assert meter.rss_mib() == 0.0
