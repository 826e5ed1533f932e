"""The merged form over the replicated log (``polymq run --storage nats://…``): a
server SIGKILLed with its data directory lost is replaced by a standby started with
the same URL, which serves everything the first one acknowledged; and a pool that
cannot work as configured says so at start-up."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from polymq.storage.replicated.local_nats import LocalNats, free_ports
from tests.crash_server import ROOT, _env, _listens, crash_server, free_port

ONE_FORM = True
_JSON = {"Accept": "application/json", "Content-Type": "application/json"}


def _command(data_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-c",
        "from polymq.gateway.cli import main; raise SystemExit(main())",
        "run",
        "--data-dir",
        str(data_dir),
        "--log-level",
        "info",
        "--http-port",
        str(port),
    ]


def _drain(client: httpx.Client, queue: str) -> list[str]:
    bodies: list[str] = []
    while True:
        reply = client.get(f"/queues/{queue}/messages", params={"numOfMessages": 16})
        if reply.status_code == 404:
            return bodies
        assert reply.status_code == 200, reply.text
        for message in reply.json()["Messages"]:
            bodies.append(message["MessageBody"])
            gone = client.delete(
                f"/queues/{queue}/messages", params={"ReceiptHandle": message["ReceiptHandle"]}
            )
            assert gone.status_code == 204, gone.text


async def test_a_standby_takes_over_a_killed_merged_server(tmp_path: Path) -> None:
    async with LocalNats(tmp_path / "nats", 3) as nats:
        url = nats.url + "?replicas=3"
        settings = {"storage.url": url, "replication.lease_ms": "2000"}
        queue = f"q{uuid.uuid4().hex[:8]}"
        acknowledged = []
        standby_port = free_port()
        env = _env("http", settings)
        standby: subprocess.Popen[bytes] | None = None
        log = tmp_path / "standby.log"
        try:
            with crash_server(tmp_path / "a", "http", settings=settings) as port:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=_JSON) as client:
                    assert client.put(f"/queues/{queue}").status_code == 201
                    for i in range(100):
                        body = f"m{i}-" + "x" * (i * 37 % 3000)
                        reply = client.post(f"/queues/{queue}/messages", json={"MessageBody": body})
                        assert reply.status_code == 201, reply.text
                        acknowledged.append(body)
                    # The first ten consumed and deleted: those deletes are acknowledged too.
                    consumed: list[str] = []
                    while len(consumed) < 10:
                        got = client.get(f"/queues/{queue}/messages", params={"numOfMessages": 1})
                        assert got.status_code == 200, got.text
                        [message] = got.json()["Messages"]
                        deleted = client.delete(
                            f"/queues/{queue}/messages",
                            params={"ReceiptHandle": message["ReceiptHandle"]},
                        )
                        assert deleted.status_code == 204
                        consumed.append(message["MessageBody"])
                standby = subprocess.Popen(
                    _command(tmp_path / "b", standby_port),
                    cwd=ROOT,
                    env=env,
                    stderr=log.open("wb"),
                )
                deadline = time.monotonic() + 60
                while "standing by to take over" not in log.read_text():
                    assert standby.poll() is None, log.read_text()[-2000:]
                    assert time.monotonic() < deadline, "the standby never said it waits"
                    time.sleep(0.05)
                assert not _listens(standby.pid, standby_port), "the standby must wait"
            # crash_server SIGKILLed the first server; its data directory is lost too.
            shutil.rmtree(tmp_path / "a")
            deadline = time.monotonic() + 60
            while not _listens(standby.pid, standby_port):
                assert standby.poll() is None, "the standby exited"
                assert time.monotonic() < deadline, "the standby did not take over"
                time.sleep(0.05)
            with httpx.Client(base_url=f"http://127.0.0.1:{standby_port}", headers=_JSON) as client:
                remaining = _drain(client, queue)
            assert not set(consumed) & set(remaining), "an acknowledged delete was undone"
            assert remaining == [b for b in acknowledged if b not in consumed]
        finally:
            if standby is not None:
                standby.kill()
                standby.wait()


def _start_fails(tmp_path: Path, settings: dict[str, str]) -> str:
    """Run ``polymq run`` expecting it to exit; its log."""
    proc = subprocess.run(
        _command(tmp_path / "data", free_port()),
        cwd=ROOT,
        env=_env("http", settings),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode != 0
    return proc.stderr.decode(errors="replace") + proc.stdout.decode(errors="replace")


async def test_three_replicas_on_one_nats_server_is_refused_at_start_up(tmp_path: Path) -> None:
    async with LocalNats(tmp_path / "nats", 1) as nats:
        output = _start_fails(tmp_path, {"storage.url": nats.url + "?replicas=3"})
    assert "replicas 3 needs a NATS cluster of at least 3 servers" in output, output[-2000:]


def test_an_unreachable_nats_url_is_refused_at_start_up(tmp_path: Path) -> None:
    [port] = free_ports(1)
    output = _start_fails(tmp_path, {"storage.url": f"nats://127.0.0.1:{port}"})
    assert f"cannot reach NATS at nats://127.0.0.1:{port}" in output, output[-2000:]


@pytest.mark.parametrize("url", ["nats://", "nats://127.0.0.1:4222?replicas=two"])
def test_a_malformed_nats_url_is_a_configuration_error(tmp_path: Path, url: str) -> None:
    output = _start_fails(tmp_path, {"storage.url": url})
    assert "storage URL" in output, output[-2000:]


def test_a_storage_process_with_an_unreachable_nats_is_refused_at_start_up(
    tmp_path: Path,
) -> None:
    [port] = free_ports(1)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from polymq.gateway.cli import main; raise SystemExit(main())",
            "storage",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path / "node"),
            "--nats",
            f"127.0.0.1:{port}",
            "--replicas",
            "3",
            "--prefer",
            "shard-1",
        ],
        cwd=ROOT,
        env=_env("http", {}),
        capture_output=True,
        timeout=60,
    )
    output = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1, output[-2000:]
    assert f"cannot reach NATS at nats://127.0.0.1:{port}" in output, output[-2000:]
