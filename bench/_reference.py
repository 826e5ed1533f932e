"""The reference brokers of the comparisons, RabbitMQ and Mosquitto from Debian's
packages, each started for one block on free loopback ports over a throwaway
directory and stopped at its end, so nothing system-wide is used or left running.

RabbitMQ gets its own node name, data, log and config locations through its
``RABBITMQ_*`` variables, its own Erlang distribution and epmd ports (another node on
the machine, or a system service, is never touched; the epmd is ours, started first
and stopped last), and no plugins. Mosquitto runs with persistence off, as people
usually run it. The ``Server`` yielded carries the pid
of the process doing the work (RabbitMQ's Erlang VM, not the shell script around it),
so a ``Meter`` reads that broker's CPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil

from bench._server import (
    HOST,
    PORT_ATTEMPTS,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Server,
    ServerExited,
    free_port,
    process_server,
    stop_process,
)

__all__ = [
    "MOSQUITTO",
    "RABBITMQ_SCRIPT",
    "mosquitto_installed",
    "mosquitto_server",
    "rabbitmq_installed",
    "rabbitmq_server",
]

MOSQUITTO = "/usr/sbin/mosquitto"
# The script the Debian wrapper (/usr/sbin/rabbitmq-server) runs after su-ing to the
# rabbitmq user: called directly it runs as us, over the directories we give it.
RABBITMQ_SCRIPT = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBITMQ_START_TIMEOUT_S = 120.0  # an Erlang VM's boot on two busy cores


def mosquitto_installed() -> bool:
    return os.access(MOSQUITTO, os.X_OK) or shutil.which("mosquitto") is not None


def rabbitmq_installed() -> bool:
    return os.access(RABBITMQ_SCRIPT, os.X_OK) and shutil.which("erl") is not None


@contextlib.contextmanager
def mosquitto_server() -> Iterator[Server]:
    """Mosquitto on a free port: anonymous, persistence off, a deep queue per client
    (the throughput cases publish faster than a subscriber drains)."""
    binary = MOSQUITTO if os.access(MOSQUITTO, os.X_OK) else shutil.which("mosquitto")
    if binary is None:
        raise FileNotFoundError("mosquitto is not installed (apt-get install mosquitto)")
    with tempfile.TemporaryDirectory(prefix="bench-mosquitto-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()  # taken before mosquitto binds it: it exits; try another
            conf.write_text(
                f"listener {port} {HOST}\nallow_anonymous true\npersistence false\n"
                "max_queued_messages 100000\n"
            )
            command = [binary, "-c", str(conf)]
            try:
                with process_server(
                    command, port, stderr=subprocess.DEVNULL, label="mosquitto"
                ) as server:
                    yield server
                    return
            except ServerExited:
                if attempt == PORT_ATTEMPTS:
                    raise


def _rabbitmq_env(base: Path, amqp_port: int, epmd_port: int) -> dict[str, str]:
    """Everything RabbitMQ writes goes under ``base``; its ports are ours."""
    plugins = base / "enabled_plugins"
    plugins.write_text("[].\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
    env.update(
        HOME=str(base),  # the Erlang cookie
        RABBITMQ_NODENAME=f"polymq-bench-{os.getpid()}-{amqp_port}@localhost",
        RABBITMQ_NODE_IP_ADDRESS=HOST,
        RABBITMQ_NODE_PORT=str(amqp_port),
        RABBITMQ_DIST_PORT=str(free_port()),
        ERL_EPMD_PORT=str(epmd_port),
        ERL_EPMD_ADDRESS=HOST,
        RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
        RABBITMQ_LOG_BASE=str(base / "log"),
        RABBITMQ_CONFIG_FILE=str(base / "rabbitmq"),  # none there: the defaults
        RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
        RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(plugins),
        RABBITMQ_PID_FILE=str(base / "rabbitmq.pid"),
    )
    return env


def _beam(script_pid: int) -> psutil.Process | None:
    """The Erlang VM the start script runs (in the background, behind its signal
    traps), found among the script's descendants."""
    try:
        children = psutil.Process(script_pid).children(recursive=True)
    except psutil.Error:
        return None
    return next((c for c in children if c.name().startswith("beam")), None)


def _listens(proc: psutil.Process, port: int) -> bool:
    try:
        conns = proc.net_connections(kind="inet")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


@contextlib.contextmanager
def _epmd() -> Iterator[int]:
    """An epmd of our own on a free loopback port, as our child, until the block
    ends. Left to the VM, epmd is started as a detached daemon that outlives it, and the
    VM's first query could race its start (``{error,address}`` at boot, seen here)."""
    binary = shutil.which("epmd")
    if binary is None:
        raise FileNotFoundError("epmd is missing (it comes with erlang-base)")
    env = {**os.environ, "ERL_EPMD_ADDRESS": HOST}
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        command = [binary, "-port", str(port)]
        try:
            with process_server(command, port, env=env, stderr=subprocess.DEVNULL, label="epmd"):
                yield port
                return
        except ServerExited:
            if attempt == PORT_ATTEMPTS:
                raise


@contextlib.contextmanager
def rabbitmq_server(start_timeout: float = RABBITMQ_START_TIMEOUT_S) -> Iterator[Server]:
    """RabbitMQ on a free AMQP port until the block ends, then SIGTERM (its script
    stops the VM cleanly), SIGKILL past ``STOP_TIMEOUT_S``, and its epmd stopped.
    A port taken between our choice and its bind (tests run beside the benchmark)
    makes it exit at start: then fresh ports, a bounded number of times."""
    if not rabbitmq_installed():
        raise FileNotFoundError("RabbitMQ is not installed (apt-get install rabbitmq-server)")
    for attempt in range(1, PORT_ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="bench-rabbitmq-") as tmp, _epmd() as epmd_port:
            try:
                started = _start_rabbitmq(Path(tmp), epmd_port, start_timeout)
            except _StartFailed:
                if attempt == PORT_ATTEMPTS:
                    raise
                continue
            proc, beam, env, log = started
            try:
                yield Server(HOST, int(env["RABBITMQ_NODE_PORT"]), beam.pid, "rabbitmq")
            finally:
                _stop_rabbitmq(proc, beam)
                log.close()
            return


class _StartFailed(RuntimeError):
    """RabbitMQ exited before it listened; its output says why."""


def _start_rabbitmq(
    base: Path, epmd_port: int, start_timeout: float
) -> tuple[subprocess.Popen[bytes], psutil.Process, dict[str, str], IO[bytes]]:
    """Start it and wait until its VM listens; on failure nothing is left running."""
    port = free_port()
    env = _rabbitmq_env(base, port, epmd_port)
    log = (base / "server.out").open("wb")
    proc = subprocess.Popen(
        [RABBITMQ_SCRIPT],
        cwd=base,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    beam: psutil.Process | None = None
    try:
        deadline = time.monotonic() + max(start_timeout, START_TIMEOUT_S)
        while beam is None or not _listens(beam, port):
            if proc.poll() is not None:
                out = (base / "server.out").read_text(errors="replace")[-1500:]
                raise _StartFailed(f"RabbitMQ exited with code {proc.returncode}:\n{out}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ did not listen on {port} in {start_timeout:g} s")
            beam = beam or _beam(proc.pid)
            time.sleep(0.2)
    except BaseException:
        _stop_rabbitmq(proc, beam)
        log.close()
        raise
    return proc, beam, env, log


def _stop_rabbitmq(proc: subprocess.Popen[bytes], beam: psutil.Process | None) -> None:
    stop_process(proc)  # SIGTERM: the script's trap stops the VM cleanly
    if beam is not None and beam.is_running():
        with contextlib.suppress(psutil.Error):
            beam.terminate()
            try:
                beam.wait(STOP_TIMEOUT_S)
            except psutil.TimeoutExpired:
                beam.kill()
