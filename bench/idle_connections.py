"""Server memory per idle MQTT connection: open N connections that each send one
CONNECT (v3.1.1, clean session, keep-alive 600 s) and nothing else, and read the
server's RSS before and after.

    .venv/bin/python -m bench.idle_connections                    # as many as the fds allow
    .venv/bin/python -m bench.idle_connections --connections 10000
    .venv/bin/python -m bench.idle_connections --tracemalloc 25   # + where it went, top 25
    .venv/bin/python -m bench.idle_connections --waves 1          # all at once

polymq is started the way ``bench/_server.py`` starts it (``polymq run`` with only the
``mqtt`` listener, over a temporary data directory), wrapped in a few lines that
install SIGUSR1: a ``gc.collect()`` (and, with ``--tracemalloc``, a tracemalloc
snapshot written to a file), acknowledged by a file the bench waits for. So the
figures are read after a collection in the server too, and the snapshot is the real
server's (uvloop, as a user runs it), not a test double's.

The connections come from several client processes (each a raw asyncio client with
thousands of sockets, a few hundred bytes each: paho per connection would weigh more
than the server), from source addresses 127.0.0.2, .3, ... one per process, so the
ephemeral ports of one address are no limit. The server's file descriptor limit is:
its hard limit cannot be raised without privileges this bench does not ask for, so N
defaults to that limit less a reserve for the server's own files. While they are all
connected a paho client connects, subscribes and gets a message back, to show the
server still serves.

The "after" figures are read once the connections were idle ``IDLE_S`` (12 s): the
server parks a TCP connection that received nothing for a while (no task), and
then detaches its socket from the loop's transport, so that is what a server
holding many idle connections holds. The connections come in ``--waves`` (10)
``WAVE_PAUSE_S`` apart, as a server's clients come over time: the memory a wave's
transports held until they were detached is then reused by the next wave's, rather
than all of them held at once at the peak (which the allocator keeps as RSS).

One JSON line: connections, server RSS and USS before, after connecting (and a GC),
after closing them, and bytes per connection; with ``--tracemalloc``, the traced
Python heap per connection and the top allocation sites (file:line) of the growth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import resource
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from bench._server import (
    CANNOT_START,
    HOST,
    PORT_ATTEMPTS,
    Server,
    ServerExited,
    _polymq_env,
    free_port,
    process_server,
)

# Descriptors the server keeps for itself (listening socket, data files, epoll,
# logs, its storage's files) beyond the connections: the default N leaves them.
SERVER_RESERVE_FDS = 300
# Most connections wanted even where the descriptors would allow more.
MAX_CONNECTIONS = 100_000
PER_CLIENT_PROCESS = 8_000
CONCURRENT_CONNECTS = 64  # per client process: the server's accept backlog is 100
KEEP_ALIVE_S = 600
CONNECT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 60.0
WARM_UP_CONNECTIONS = 200
# How long the connections stay idle before the "after" figures: the server parks a
# TCP connection that received nothing for 5 s (MqttOptions.park_after_s), asked to
# within another 5 s, so by then it holds them as it holds any long-idle connection.
IDLE_S = 12.0
# Between waves: a connection idle since its CONNACK is detached 5 s after its
# accept (within the deadlines' 0.25 s tick).
WAVE_PAUSE_S = 6.0
DEFAULT_WAVES = 10
GC_TIMEOUT_S = 120.0  # a snapshot of a traced heap of 100k connections takes a while
PAHO_TIMEOUT_S = 30.0

# The server as ``polymq run``, with SIGUSR1 for a collection (and a tracemalloc
# snapshot when tracing) acknowledged by a file: the bench's way to ask the server
# process for a GC without any change to the server itself.
_WRAPPER = """
import gc, os, signal, sys, tracemalloc
from pathlib import Path
_out = Path(os.environ["IDLE_BENCH_DIR"])
_count = 0
def _collect(signum, frame):
    global _count
    _count += 1
    gc.collect()
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(str(_out / f"snapshot-{_count}"))
    (_out / f"done-{_count}").write_text("ok")
signal.signal(signal.SIGUSR1, _collect)
from polymq.gateway.cli import main
sys.argv[0] = "polymq"
sys.exit(main())
"""


def _connect_packet(client_id: str) -> bytes:
    """CONNECT v3.1.1, clean session, keep-alive ``KEEP_ALIVE_S``, this client id."""
    cid = client_id.encode()
    variable = b"\x00\x04MQTT\x04\x02" + KEEP_ALIVE_S.to_bytes(2, "big")
    payload = len(cid).to_bytes(2, "big") + cid
    body = variable + payload
    assert len(body) < 128
    return b"\x10" + bytes([len(body)]) + body


class _Idle(asyncio.Protocol):
    """One idle client connection: CONNECT once, the CONNACK awaited, then nothing."""

    __slots__ = ("_buffer", "connack", "transport")

    def __init__(self, connack: asyncio.Future[bool]) -> None:
        self.connack = connack
        self._buffer = b""
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= 4 and not self.connack.done():
            ok = self._buffer[0] == 0x20 and self._buffer[3] == 0
            self.connack.set_result(ok)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.connack.done():
            self.connack.set_result(False)


def _client_process(
    port: int, count: int, source: str, prefix: str, waves: int, pipe: Connection
) -> None:  # pragma: no cover - runs in a child process
    """Open ``count`` connections from ``source`` in ``waves``, report, hold them
    until told."""
    _raise_fd_limit()
    asyncio.run(_hold(port, count, source, prefix, waves, pipe))


async def _hold(
    port: int, count: int, source: str, prefix: str, waves: int, pipe: Connection
) -> None:
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(CONCURRENT_CONNECTS)
    transports: list[asyncio.BaseTransport] = []
    failures: list[str] = []

    async def one(i: int) -> None:
        async with gate:
            try:
                connack: asyncio.Future[bool] = loop.create_future()
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    transport, _ = await loop.create_connection(
                        lambda: _Idle(connack), HOST, port, local_addr=(source, 0)
                    )
                    transport.write(_connect_packet(f"{prefix}-{i}"))
                    ok = await connack
            except (OSError, TimeoutError) as e:
                failures.append(repr(e))
                return
            if ok:
                transports.append(transport)
            else:
                failures.append("no CONNACK")
                transport.close()

    seconds = 0.0  # opening, without the pauses between waves
    per_wave = -(-count // waves)
    for first in range(0, count, per_wave):
        if first:
            await asyncio.sleep(WAVE_PAUSE_S)  # a measurement parameter (see WAVE_PAUSE_S)
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(first, min(count, first + per_wave))))
        seconds += time.perf_counter() - start
    pipe.send(
        {
            "opened": len(transports),
            "failed": len(failures),
            "seconds": seconds,
            "first_failure": failures[0] if failures else None,
        }
    )
    await loop.run_in_executor(None, pipe.recv)  # "close"
    for transport in transports:
        transport.close()
    await asyncio.sleep(0)
    pipe.send({"closed": len(transports)})


def _raise_fd_limit() -> int:
    """The soft descriptor limit raised to the hard one (a child inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class _GcServer:
    """The server process, asked for a GC (and snapshot) by SIGUSR1."""

    def __init__(self, server: Server, out: Path) -> None:
        assert server.pid is not None
        self.server = server
        self.process = psutil.Process(server.pid)
        self._out = out
        self._count = 0

    def collect(self) -> Path | None:
        """A ``gc.collect()`` in the server, waited for; the snapshot file if tracing."""
        self._count += 1
        self.process.send_signal(signal.SIGUSR1)
        done = self._out / f"done-{self._count}"
        _wait(done.exists, GC_TIMEOUT_S, "the server's GC")
        snapshot = self._out / f"snapshot-{self._count}"
        return snapshot if snapshot.exists() else None

    def memory(self) -> tuple[int, int]:
        """RSS and USS in bytes."""
        info = self.process.memory_full_info()
        return int(info.rss), int(info.uss)

    def fds(self) -> int:
        return int(self.process.num_fds())


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def _server(connections: int, out: Path, trace_frames: int) -> Iterator[_GcServer]:
    """polymq with only the mqtt listener, its connection limits raised to allow
    ``connections``, started through the GC wrapper."""
    room = str(connections + 1_000)
    settings = {
        "limits.max_connections": room,
        "limits.max_connections_per_protocol": room,
        "limits.max_connections_per_address": room,
    }
    env = _polymq_env(["mqtt"], settings)
    env["IDLE_BENCH_DIR"] = str(out)
    if trace_frames:
        env["PYTHONTRACEMALLOC"] = str(trace_frames)
    data_dir = out / "data"
    start_s = 120.0 if trace_frames else 30.0  # a traced start is several times slower
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        command = [sys.executable, "-c", _WRAPPER, "run", "--data-dir", str(data_dir)]
        command += ["--log-level", "warning", "--mqtt-port", str(port)]
        try:
            with process_server(command, port, env=env, start_timeout=start_s) as server:
                yield _GcServer(server, out)
                return
        except ServerExited as e:
            if e.code != CANNOT_START or attempt == PORT_ATTEMPTS:
                raise


def _paho_round_trip(port: int) -> bool:
    """A real client still served: connect, subscribe, publish, get it back."""
    got = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"probe-{uuid.uuid4().hex[:8]}")
    client.on_message = lambda _c, _u, msg: got.set() if msg.payload == b"still here" else None
    client.connect(HOST, port, keepalive=30)
    client.loop_start()
    try:
        # The SUBACK is waited for through the message itself: published again
        # until one comes back.
        result, _ = client.subscribe("idle/probe", qos=1)
        assert result == paho.MQTT_ERR_SUCCESS
        deadline = time.monotonic() + PAHO_TIMEOUT_S
        while not got.is_set() and time.monotonic() < deadline:
            client.publish("idle/probe", b"still here", qos=1).wait_for_publish(PAHO_TIMEOUT_S)
            got.wait(0.5)
        return got.is_set()
    finally:
        client.disconnect()
        client.loop_stop()


def _open(
    port: int, connections: int, per_process: int, waves: int = 1
) -> tuple[list[Any], list[Connection], dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    processes, pipes = [], []
    run = uuid.uuid4().hex[:6]
    remaining, index = connections, 0
    while remaining > 0:
        count = min(per_process, remaining)
        ours, theirs = ctx.Pipe()
        source = f"127.0.0.{2 + index}"
        proc = ctx.Process(
            target=_client_process,
            args=(port, count, source, f"idle-{run}-{index}", waves, theirs),
        )
        proc.start()
        processes.append(proc)
        pipes.append(ours)
        remaining -= count
        index += 1
    reports = [pipe.recv() for pipe in pipes]
    summary = {
        "opened": sum(r["opened"] for r in reports),
        "failed": sum(r["failed"] for r in reports),
        "open_seconds": round(max(r["seconds"] for r in reports), 1),
        "first_failure": next((r["first_failure"] for r in reports if r["first_failure"]), None),
    }
    return processes, pipes, summary


def _close(processes: list[Any], pipes: list[Connection]) -> None:
    for pipe in pipes:
        pipe.send("close")
    for pipe in pipes:
        pipe.recv()
    for proc in processes:
        proc.join(30)


def _top(before: Path, after: Path, connections: int, limit: int) -> tuple[float, list[str]]:
    """Traced heap growth per connection, and the top sites of the growth."""
    old = tracemalloc.Snapshot.load(str(before))
    new = tracemalloc.Snapshot.load(str(after))
    stats = new.compare_to(old, "lineno")
    growth = sum(s.size_diff for s in stats)
    lines = []
    for stat in stats[:limit]:
        frame = stat.traceback[0]
        lines.append(
            f"{stat.size_diff / connections:8.1f} B/conn {stat.count_diff / connections:6.2f}"
            f" blocks/conn  {frame.filename}:{frame.lineno}"
        )
    return growth / connections, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, help="idle connections (default: the fd limit)")
    parser.add_argument(
        "--per-process", type=int, default=PER_CLIENT_PROCESS, help="connections per client process"
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=DEFAULT_WAVES,
        help=f"open the connections in this many waves, {WAVE_PAUSE_S:g} s apart",
    )
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="TOP",
        help="trace the server's heap and print the TOP growth sites",
    )
    args = parser.parse_args()
    hard = _raise_fd_limit()
    most = min(MAX_CONNECTIONS, hard - SERVER_RESERVE_FDS)
    connections = args.connections or most
    if connections > most:
        parser.error(f"at most {most} connections here (server fd hard limit {hard})")
    with (
        tempfile.TemporaryDirectory(prefix="polymq-idle-") as temp,
        _server(connections, Path(temp), 1 if args.tracemalloc else 0) as server,
    ):
        port = server.server.port
        # Warm up: the first connections load code and fill caches no later one costs.
        procs, pipes, _ = _open(port, WARM_UP_CONNECTIONS, WARM_UP_CONNECTIONS)
        _close(procs, pipes)
        assert _paho_round_trip(port)
        base_fds = server.fds()
        _wait(lambda: server.fds() <= base_fds, SETTLE_TIMEOUT_S, "the warm-up to close")
        snap_before = server.collect()
        rss_before, uss_before = server.memory()
        procs, pipes, opened = _open(port, connections, args.per_process, max(1, args.waves))
        try:
            n = opened["opened"]
            _wait(
                lambda: server.fds() >= base_fds + n - 2, SETTLE_TIMEOUT_S, "the server's sockets"
            )
            served = _paho_round_trip(port)
            time.sleep(IDLE_S)  # a measurement parameter: idle this long (see IDLE_S)
            snap_after = server.collect()
            rss_after, uss_after = server.memory()
        finally:
            _close(procs, pipes)
        _wait(lambda: server.fds() <= base_fds + 5, SETTLE_TIMEOUT_S, "the connections to close")
        server.collect()
        rss_closed, _ = server.memory()
        traced = None
        if snap_before is not None and snap_after is not None:
            traced = _top(snap_before, snap_after, max(1, n), args.tracemalloc)
    row: dict[str, Any] = {
        "scenario": "idle mqtt connections",
        "connections": n,
        "waves": max(1, args.waves),
        **{k: v for k, v in opened.items() if k != "opened"},
        "fd_hard_limit": hard,
        "paho_served_meanwhile": served,
        "server_rss_before_mib": round(rss_before / (1 << 20), 1),
        "server_rss_after_mib": round(rss_after / (1 << 20), 1),
        "server_rss_after_close_mib": round(rss_closed / (1 << 20), 1),
        "rss_bytes_per_connection": round((rss_after - rss_before) / max(1, n)),
        "uss_bytes_per_connection": round((uss_after - uss_before) / max(1, n)),
    }
    if traced is not None:
        per_conn, lines = traced
        row["traced_heap_bytes_per_connection"] = round(per_conn)
        print("\n".join(lines), file=sys.stderr)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
