"""A real ``polymq run`` in a subprocess, killed with SIGKILL when the block ends: the
crash tests' server. No clean stop runs, so whatever survives was on disk when the
process died, which is what "never loses an acknowledged message" promises.

Only the listener under test is enabled (the others would cost start-up time), and
this process's ``POLYMQ_`` variables are left out so a developer's shell settings do
not change what is tested.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil

from polymq.gateway.config import ENV_PREFIX, LISTENER_NAMES

__all__ = ["crash_server", "free_port"]

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
# polymq's exit code when it cannot start (a port taken, a data dir not writable).
CANNOT_START = 1
PORT_ATTEMPTS = 3


class _Exited(RuntimeError):
    def __init__(self, code: int, stderr: str) -> None:
        super().__init__(f"the server exited with code {code} before listening:\n{stderr}")
        self.code = code


def free_port() -> int:
    """A port free right now on loopback (another process may take it first)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _listens(pid: int, port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                return True
    return False


def _env(listener: str, settings: Mapping[str, str]) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    for name in LISTENER_NAMES:
        if name != listener:
            env[f"{ENV_PREFIX}LISTENERS__{name.upper()}__ENABLED"] = "false"
    for key, value in settings.items():  # dotted config keys: storage.flush_interval_ms
        env[ENV_PREFIX + "__".join(key.split(".")).upper()] = value
    return env


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


@contextlib.contextmanager
def _run(command: Sequence[str], port: int, env: Mapping[str, str]) -> Iterator[None]:
    """Until the process itself listens on ``port`` (a connect alone could reach
    another process that took the port); fails at once if it exits."""
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(list(command), cwd=ROOT, env=dict(env), stderr=stderr)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _listens(proc.pid, port):
                code = proc.poll()
                if code is not None:
                    stderr.seek(0)
                    raise _Exited(code, stderr.read().decode(errors="replace")[-4000:])
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not listen on {port} in time")
                time.sleep(0.05)
            yield
        finally:
            _kill(proc)


@contextlib.contextmanager
def crash_server(
    data_dir: Path,
    listener: str,
    *,
    port: int | None = None,
    durability: str | None = None,
    settings: Mapping[str, str] | None = None,
    prelude: str = "",
) -> Iterator[int]:
    """polymq serving only ``listener`` over ``data_dir``; yields its port and
    SIGKILLs it when the block ends. A port taken before the server bound it is
    retried on a fresh one (unless ``port`` was given). ``prelude``: Python run in
    the server process before it starts (``tests/powerloss.py`` records its fsyncs)."""
    assert listener in LISTENER_NAMES, listener
    env = _env(listener, settings or {})
    for attempt in range(1, PORT_ATTEMPTS + 1):
        chosen = port or free_port()
        command = [
            sys.executable,
            "-c",
            prelude + "\nfrom polymq.gateway.cli import main; raise SystemExit(main())",
        ]
        command += ["run", "--data-dir", str(data_dir), "--log-level", "warning"]
        command += [f"--{listener.replace('_', '-')}-port", str(chosen)]
        if durability is not None:
            command += ["--durability", durability]
        try:
            with _run(command, chosen, env):
                yield chosen
                return
        except _Exited as e:
            if e.code != CANNOT_START or port is not None or attempt == PORT_ATTEMPTS:
                raise
