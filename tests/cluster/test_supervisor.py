"""``polymq cluster up`` keeps the cluster running: a child that dies (SIGKILL) is
restarted on its ports and serves again, the others are never stopped, and
``polymq cluster status --data-dir`` shows the restart. The command runs as a real
subprocess on free ports (``--port-offset 0``) with the fast-failure settings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from polymq.gateway.cluster_status import render_processes
from polymq.gateway.cluster_tool import STATUS_FILE, Backoff, describe_exit
from tests.cluster.fast_failure import cluster_env

_TIMEOUT_S = 90.0
_CHILDREN = ("nameserver", "navigation", "storage-1", "gateway-1")


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    backoff = Backoff(first_s=0.5, cap_s=4.0, stable_s=30.0)
    assert [backoff.next(uptime_s=1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.next(uptime_s=31.0) == 0.5
    assert backoff.next(uptime_s=1.0) == 1.0
    # A long crash loop stays at the cap, and never overflows.
    assert {backoff.next(uptime_s=0.0) for _ in range(10_000)} == {2.0, 4.0}
    assert backoff.next(uptime_s=0.0) == 4.0


def test_exits_are_described_as_an_operator_reads_them() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-200) == "killed by signal 200"


def test_the_processes_table() -> None:
    status = {
        "supervisor_pid": 7,
        "running": True,
        "children": [
            {"name": "storage-1", "pid": 11, "state": "running", "started_ms": 1_000},
            {
                "name": "gateway-1",
                "pid": 12,
                "state": "restarting",
                "restarts": 2,
                "last_exit": {"reason": "killed by SIGKILL", "at_ms": 9_500},
            },
        ],
    }
    lines = render_processes(status, now_ms=10_000, alive=lambda pid: pid == 7)
    assert lines[0] == "processes (cluster up, supervisor pid 7: running):"
    assert lines[2].split() == ["storage-1", "11", "running", "9.0", "s", "0", "-"]
    assert lines[3].split()[:4] == ["gateway-1", "12", "restarting", "-"]
    assert "2  " in lines[3] and "killed by SIGKILL, 0.5 s ago" in lines[3]
    gone = render_processes(status, now_ms=10_000, alive=lambda pid: False)
    assert "NOT RUNNING" in gone[0]


@dataclass
class _Up:
    process: asyncio.subprocess.Process
    data_dir: Path
    log: Path

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.data_dir / STATUS_FILE).read_text()))
        except (OSError, ValueError):
            return {}

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.status().get("children", ()) if c["name"] == name)

    async def until(self, check: Any, what: str) -> None:
        async with asyncio.timeout(_TIMEOUT_S):
            while True:
                assert self.process.returncode is None, f"cluster up exited:\n{self.tail()}"
                with contextlib.suppress(StopIteration, KeyError):
                    if check():
                        return
                await asyncio.sleep(0.1)
        raise AssertionError(what)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@contextlib.asynccontextmanager
async def _cluster_up(tmp_path: Path, *extra: str) -> AsyncIterator[_Up]:
    """``cluster up`` with one storage node and one gateway (and ``extra`` flags), once
    its status file shows its four processes running; SIGTERM at the end."""
    data_dir, log = tmp_path / "cluster", tmp_path / "up.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "polymq.gateway", "cluster", "up", "--storage", "1", "--gateways", "1"),
            *("--port-offset", "0", "--data-dir", str(data_dir), *extra),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=cluster_env(),
        )
    running = _Up(process, data_dir, log)
    try:
        await running.until(
            lambda: [c["state"] for c in running.status()["children"]] == ["running"] * 4,
            "the cluster never came up",
        )
        yield running
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), _TIMEOUT_S)
            except TimeoutError:
                process.kill()
                await process.wait()


@pytest.fixture
async def up(tmp_path: Path) -> AsyncIterator[_Up]:
    async with _cluster_up(tmp_path) as running:
        yield running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _round_trip(base: str, queue: str) -> None:
    """Create a queue, send a message, receive it back (the MNS-style JSON API)."""
    body = f"hello {uuid.uuid4().hex}"
    json_ = {"Accept": "application/json"}
    async with httpx.AsyncClient(base_url=base, timeout=30.0, headers=json_) as http:
        async with asyncio.timeout(_TIMEOUT_S):
            while True:  # a restarted storage node is routable a heartbeat later
                created = await http.put(f"/queues/{queue}")
                sent = await http.post(f"/queues/{queue}/messages", json={"MessageBody": body})
                if created.status_code in (201, 204) and sent.status_code == 201:
                    break
                await asyncio.sleep(0.2)
        received = await http.get(f"/queues/{queue}/messages", params={"waitseconds": 5})
        assert received.status_code == 200, received.text
        assert received.json()["MessageBody"] == body


async def _kill_and_see_it_restarted(up: _Up, name: str) -> None:
    before = {n: up.child(n) for n in _CHILDREN}
    os.kill(before[name]["pid"], signal.SIGKILL)

    def restarted() -> bool:
        now = up.child(name)
        return bool(
            now["state"] == "running"
            and now["restarts"] == before[name]["restarts"] + 1
            and now["pid"] != before[name]["pid"]
        )

    await up.until(restarted, f"{name} was not restarted")
    assert up.child(name)["last_exit"]["reason"] == "killed by SIGKILL"
    assert f"{name} exited (killed by SIGKILL)" in up.log.read_text()
    for other in _CHILDREN:  # never stopped, never restarted
        if other != name:
            assert up.child(other)["pid"] == before[other]["pid"]
            assert up.child(other)["restarts"] == before[other]["restarts"]
            assert _alive(before[other]["pid"]), f"{other} was stopped"


async def test_a_killed_child_is_restarted_and_serves_again(up: _Up) -> None:
    http = f"http://{up.child('gateway-1')['addresses']['http']}"
    await _round_trip(http, "before")

    await _kill_and_see_it_restarted(up, "gateway-1")
    assert f"http://{up.child('gateway-1')['addresses']['http']}" == http  # same ports
    await _round_trip(http, "after-gateway")

    await _kill_and_see_it_restarted(up, "storage-1")
    await _round_trip(http, "after-storage")

    report = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "polymq.gateway", "cluster", "status", "--data-dir", str(up.data_dir)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=cluster_env(),
    )
    out, _ = await asyncio.wait_for(report.communicate(), _TIMEOUT_S)
    text = out.decode()
    assert report.returncode == 0, text
    processes, _, rest = text.partition("\n\n")
    rows = {line.split()[0]: line.split() for line in processes.splitlines()[2:]}
    for name in ("gateway-1", "storage-1"):
        # process, pid, state, up for ("3.1 s"), restarts, last exit
        assert rows[name][2] == "running" and rows[name][5] == "1", processes
        assert "killed by SIGKILL," in " ".join(rows[name][6:]), processes
    assert rows["nameserver"][-1] == "-"
    # The nameserver and navigation were found from the status file too.
    assert "node-1" in rest and "gateway-1" in rest, text

    pids = [up.child(n)["pid"] for n in _CHILDREN]
    up.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(up.process.wait(), _TIMEOUT_S) == 0, up.tail()
    assert not any(_alive(pid) for pid in pids)
    final = up.status()
    assert final["running"] is False
    assert {c["state"] for c in final["children"]} == {"stopped"}


async def test_a_quiet_log_level_still_comes_up_and_serves(tmp_path: Path) -> None:
    """``--log-level warning``: the supervisor learns each child's ports and readiness
    from lines logged at any level, so the cluster comes up on free ports, serves,
    and keeps the rest of the INFO lines quiet."""
    async with _cluster_up(tmp_path, "--log-level", "warning") as up:
        await _round_trip(f"http://{up.child('gateway-1')['addresses']['http']}", "quiet")
        text = up.log.read_text()
    assert "[gateway-1] " in text and " INFO polymq: ready (pid " in text, text[-3000:]
    assert "storage node: data in" not in text, text[-3000:]  # an INFO line, quiet
