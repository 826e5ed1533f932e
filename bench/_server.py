"""The server side of the protocol benchmarks: start a broker in a subprocess, wait
until it listens, measure its CPU and memory, stop it.

The benchmarks measure the server a user would run, so polymq is started through its
own command (``python -m polymq.gateway run``), configured the way a user would configure it
(flags and ``POLYMQ_`` environment variables), with only the listener under test
enabled: the others would cost start-up time and memory that no scenario uses. It runs
in its own process so that its CPU time and RSS are its own, not the client's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from polymq.gateway.config import ENV_PREFIX, LISTENER_NAMES

__all__ = [
    "Meter",
    "Server",
    "ServerExited",
    "add_target_options",
    "free_port",
    "polymq_server",
    "process_server",
    "server_under_test",
    "stop_process",
]

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
# polymq's exit code when it cannot start (a port taken, a data dir not writable).
CANNOT_START = 1
PORT_ATTEMPTS = 3


class ServerExited(RuntimeError):
    """The server process ended before it listened; its stderr says why."""

    def __init__(self, code: int, port: int) -> None:
        super().__init__(
            f"the server exited with code {code} before listening on {port} (see its stderr)"
        )
        self.code = code


@dataclass(frozen=True)
class Server:
    """Where a server listens, its pid (for a ``Meter``; None when a ``--target``
    broker's pid was not given) and what to call it in the output."""

    host: str
    port: int
    pid: int | None
    label: str = "polymq"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def free_port() -> int:
    """A port free right now on loopback. Another process may take it before the
    server binds it: polymq then exits with code 1 and ``polymq_server`` tries again."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def listening_processes(pid: int, port: int) -> int:
    """How many of the process and its children (``polymq run --workers``: the
    workers listen, the parent does not) listen on ``port``."""
    try:
        process = psutil.Process(pid)
        family = [process, *process.children()]
    except psutil.Error:
        return 0
    count = 0
    for member in family:
        with contextlib.suppress(psutil.Error):
            conns = member.net_connections("inet")
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
                count += 1
    return count


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the process itself (or a child of it) listens on ``port``: a connect
    alone could reach another process that took the port meanwhile. Fails at once if
    the process exits (a port taken, a bad flag) instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise ServerExited(code, port)
        if listening_processes(proc.pid, port):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not listen on port {port} within {timeout:.0f} s")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (polymq stops cleanly on it: storage flushed), then SIGKILL if the
    process is still there after ``timeout``, so a stuck server never outlives the
    benchmark."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextlib.contextmanager
def process_server(
    command: Sequence[str],
    port: int,
    *,
    env: Mapping[str, str] | None = None,
    stderr: int | IO[bytes] | None = None,
    start_timeout: float = START_TIMEOUT_S,
    label: str = "polymq",
) -> Iterator[Server]:
    """Run any broker process (polymq, Mosquitto) until the block ends."""
    proc = subprocess.Popen(
        list(command), cwd=ROOT, env=None if env is None else dict(env), stderr=stderr
    )
    try:
        _wait_listening(port, proc, start_timeout)
        yield Server(HOST, port, proc.pid, label)
    finally:
        stop_process(proc)


def _env_name(key: str) -> str:
    """``limits.max_connections`` -> ``POLYMQ_LIMITS__MAX_CONNECTIONS``."""
    return ENV_PREFIX + "__".join(key.split(".")).upper()


def _polymq_env(listeners: Sequence[str], settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its ``POLYMQ_`` variables (a developer's
    shell settings or config file must not change what a benchmark measures), plus
    the other listeners disabled and ``settings`` (dotted config keys)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    for name in LISTENER_NAMES:
        if name not in listeners:
            env[_env_name(f"listeners.{name}.enabled")] = "false"
    for key, value in settings.items():
        env[_env_name(key)] = value
    return env


@contextlib.contextmanager
def polymq_server(
    listener: str,
    *,
    durability: str = "sync",
    data_dir: Path | None = None,
    settings: Mapping[str, str] | None = None,
    also: Sequence[str] = (),
) -> Iterator[Server]:
    """polymq with only ``listener`` (and the listeners in ``also``, on free ports)
    enabled, on a free port, over ``data_dir`` (default: a temporary directory deleted
    afterwards; pass one to read the storage after the server stopped). ``settings``
    are further config keys, e.g. ``{"limits.max_connections": "20000"}``."""
    wanted = (listener, *also)
    unknown = [name for name in wanted if name not in LISTENER_NAMES]
    if unknown:
        raise ValueError(f"unknown listeners {unknown}; known: {list(LISTENER_NAMES)}")
    env = _polymq_env(wanted, settings or {})
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            temp = stack.enter_context(tempfile.TemporaryDirectory(prefix="polymq-bench-"))
            data_dir = Path(temp)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            # A free port can be taken by another process before the server binds it
            # (tests run beside the benchmark): then try fresh ports, a bounded number
            # of times. Any other failure (a config error exits 2) is final.
            port = free_port()
            command = [sys.executable, "-m", "polymq.gateway", "run", "--data-dir", str(data_dir)]
            command += ["--durability", durability, "--log-level", "warning"]
            command += [f"--{listener.replace('_', '-')}-port", str(port)]
            for name in also:
                command += [f"--{name.replace('_', '-')}-port", str(free_port())]
            try:
                server = stack.enter_context(process_server(command, port, env=env))
            except ServerExited as e:
                if e.code != CANNOT_START or attempt == PORT_ATTEMPTS:
                    raise
            else:
                break
        yield server


@dataclass
class Meter:
    """CPU seconds and RSS of a server process. ``pid`` None (a ``--target`` run
    without ``--server-pid``) reads as zeros, so the benchmarks print the same table
    either way."""

    pid: int | None

    def __post_init__(self) -> None:
        self._process = psutil.Process(self.pid) if self.pid is not None else None

    def cpu(self) -> float:
        """User + system seconds so far, all threads (the fsync thread too)."""
        if self._process is None:
            return 0.0
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def rss_mib(self) -> float:
        if self._process is None:
            return 0.0
        return float(self._process.memory_info().rss) / (1 << 20)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """``--target`` and ``--server-pid``: run the same scenarios against another
    broker already running (RabbitMQ, Mosquitto, ...), for a comparison on the same
    machine and client."""
    parser.add_argument(
        "--target", metavar="HOST:PORT", help="a running broker to measure (default: start polymq)"
    )
    parser.add_argument(
        "--server-pid", type=int, metavar="PID", help="pid of the --target broker, for CPU/RSS"
    )


@contextlib.contextmanager
def server_under_test(
    listener: str,
    *,
    target: str | None,
    server_pid: int | None,
    settings: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """The ``--target`` broker if one was given, else polymq started for the block."""
    if target:
        host, _, port = target.rpartition(":")
        yield Server(host or HOST, int(port), server_pid, label=target)
        return
    with polymq_server(listener, settings=settings) as server:
        yield server
