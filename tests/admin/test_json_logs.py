"""``polymq run --log-format json``: every line the process writes is one JSON object,
lines logged while a connection is served carry its id, protocol and (once it logged
in) account, and no password tried or configured ever reaches the log (the unique
passwords are searched for in every line). The text format's side of failed logins
is tests/security/test_hashed_logins.py."""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polymq.gateway.cluster_tool import layout

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-" + uuid.uuid4().hex  # unique: any occurrence in the log is a leak
WRONG = "wrong-" + uuid.uuid4().hex
WAIT_S = 30.0


class Process:
    """A real ``polymq run`` whose output lines are collected as they come."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYMQ_")}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "polymq.gateway", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, check: Any) -> dict[str, Any]:
        """The first JSON entry from now on for which ``check(entry)`` is true."""
        deadline = time.monotonic() + WAIT_S
        while True:
            line = self._new.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, "the server exited:\n" + "".join(self.lines)
            self.lines.append(line)
            entry: dict[str, Any] = json.loads(line)  # every line is JSON, or this raises
            if check(entry):
                return entry

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait(WAIT_S)
        assert self.popen.stdout is not None
        while (line := self._new.get(timeout=WAIT_S)) is not None:
            self.lines.append(line)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Process]:
    config = tmp_path / "polymq.toml"
    config.write_text(
        f"""
[auth]
mode = "accounts"
[[auth.accounts]]
user = "alice"
password = "{PASSWORD}"
namespaces = ["default"]
admin = true
"""
    )
    listeners = ("kafka", "amqp", "mqtt-ws", "rocketmq")
    args = ["run", "--config", str(config), "--data-dir", str(tmp_path / "data")]
    args += ["--log-format", "json", "--durability", "async", "--mqtt-port=0", "--http-port=0"]
    env_off = [f"--{name}-port=0" for name in listeners]
    process = Process(args + env_off)
    try:
        yield process
    finally:
        if process.popen.poll() is None:
            process.stop()


def mqtt_connect(user: str, password: str, client_id: str) -> bytes:
    def text(s: str) -> bytes:
        return struct.pack(">H", len(s)) + s.encode()

    body = text("MQTT") + bytes([4, 0xC2]) + struct.pack(">H", 60)
    body += text(client_id) + text(user) + text(password)
    return bytes([0x10, len(body)]) + body


def test_json_lines_name_connections_and_accounts_and_never_a_password(server: Process) -> None:
    ports: dict[str, int] = {}

    def listener(entry: dict[str, Any]) -> bool:
        if entry["message"].startswith("listener "):
            name, _, address = entry["message"].removeprefix("listener ").partition(": ")
            if address[-1:].isdigit():
                ports[name] = int(address.rsplit(":", 1)[1])
        return bool(entry["message"].startswith("ready"))

    ready = server.wait_for(listener)
    assert {"ts", "level", "logger"} <= set(ready)
    mqtt = ("127.0.0.1", ports["mqtt"])

    # A refused login: the line names the connection, not the password tried.
    with socket.create_connection(mqtt, timeout=WAIT_S) as sock:
        sock.sendall(mqtt_connect("alice", WRONG, "c-wrong"))
        refused = server.wait_for(lambda e: "login failed" in e["message"])
        assert refused["protocol"] == "mqtt" and isinstance(refused["connection_id"], int)
    # A logged-in client's bad packet: the line names its account too.
    with socket.create_connection(mqtt, timeout=WAIT_S) as sock:
        sock.sendall(mqtt_connect("alice", PASSWORD, "c-right"))
        assert sock.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
        sock.sendall(b"\xf0\x00")  # packet type 15: reserved
        bad = server.wait_for(lambda e: "bad packet" in e["message"])
        assert (bad["account"], bad["namespace"], bad["protocol"]) == ("alice", "default", "mqtt")
    # Admin Basic credentials, wrong and right.
    base = f"http://127.0.0.1:{ports['http']}"
    assert httpx.get(base + "/admin/accounts", auth=("alice", WRONG)).status_code == 401
    assert httpx.get(base + "/admin/accounts", auth=("alice", PASSWORD)).status_code == 200
    server.wait_for(lambda e: "login failed: protocol=http" in e["message"])
    server.stop()
    logged = "".join(server.lines)
    assert PASSWORD not in logged and WRONG not in logged
    for line in server.lines:
        json.loads(line)


def test_cluster_up_passes_the_format_to_every_process(tmp_path: Path) -> None:
    specs = layout(storage=1, gateways=1, data_dir=tmp_path, port_offset=None, log_format="json")
    for spec in specs:
        args = list(spec.args)
        assert args[args.index("--log-format") + 1] == "json", spec
