"""``polymq run --workers 2`` that cannot start: a shared port another program holds
(without SO_REUSEPORT, so no worker can join it) makes the parent exit 1 with a
``cannot start`` line naming the worker, as the single process does for a port
taken, and no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from polymq.gateway.config import ENV_PREFIX
from polymq.storage.replicated.local_nats import free_ports
from tests.workers.helpers import LISTENERS, TIMEOUT

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
