"""``polymq run --workers 2`` that cannot start: a shared port another program holds
(without SO_REUSEPORT, so no worker can join it) makes the parent exit 1 with a
``cannot start`` line naming the worker, as the single process does for a port
taken, and no traceback. And one that logs only warnings still starts: the parent
learns its workers' readiness and ports from lines logged at any level."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

from polymq.gateway.config import ENV_PREFIX
from polymq.storage.replicated.local_nats import free_ports
from tests.workers.helpers import LISTENERS, TIMEOUT, running_workers

ONE_FORM = True  # starts its own server processes


def test_a_port_taken_stops_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = dict(zip(LISTENERS, free_ports(len(LISTENERS)), strict=True))
        ports["amqp"] = taken.getsockname()[1]
        argv = [sys.executable, "-m", "polymq.gateway", "run", "--workers", "2"]
        argv += ["--data-dir", str(tmp_path / "data")]
        for name, port in ports.items():
            argv += [f"--{name.replace('_', '-')}-port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    last = [line for line in output.splitlines() if not line.startswith("[worker-")][-1]
    assert "ERROR polymq: cannot start: worker-" in last
    assert "Traceback" not in output


def test_a_quiet_log_level_still_starts_and_serves(tmp_path: Path) -> None:
    """``--log-level warning``: the parent saw both workers ready (the helper waits
    for its ready line and reads both workers' pids), each worker serves, and the
    rest of the INFO lines are quiet."""
    with running_workers(tmp_path / "data", 2, extra=["--log-level", "warning"]) as workers:
        queue = f"quiet-{uuid.uuid4().hex[:8]}"
        base = f"http://127.0.0.1:{workers.port('http')}"
        for _ in range(6):  # a connection each: the kernel spreads them over both workers
            request = urllib.request.Request(f"{base}/queues/{queue}", method="PUT")
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                assert response.status in (201, 204)
        lines = list(workers.lines)
    assert sum(" INFO polymq: ready (pid " in line for line in lines) == 2, lines
    assert any(" INFO polymq: listener http: 127.0.0.1:" in line for line in lines), lines
    assert not any("storage: opened" in line for line in lines), lines  # an engine INFO line
