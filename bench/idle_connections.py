"""Server memory per idle MQTT connection: open N connections that each send one
CONNECT (v3.1.1, clean session, keep-alive 600 s) and nothing else, and read the
server's RSS before and after.

    .venv/bin/python -m bench.idle_connections                    # as many as the fds allow
    .venv/bin/python -m bench.idle_connections --connections 10000
    .venv/bin/python -m bench.idle_connections --workers 6        # 100,000 over 6 workers
    .venv/bin/python -m bench.idle_connections --tracemalloc 25   # + where it went, top 25
    .venv/bin/python -m bench.idle_connections --waves 1          # all at once

polymq is started the way ``bench/_server.py`` starts it (``polymq run`` with only the
``mqtt`` listener, over a temporary data directory), with ``bench/_idle_gc`` first on
its path, whose ``sitecustomize`` makes every server process answer SIGUSR1 with a
``gc.collect()`` (and, with ``--tracemalloc``, a tracemalloc snapshot written to a
file), acknowledged by a file the bench waits for. So the figures are read after a
collection in the server too, and the snapshot is the real server's (uvloop, as a
user runs it), not a test double's.

A process holds one file descriptor per connection, and its hard limit cannot be
raised without privileges this bench does not ask for (20,000 on the machines
measured so far). So one process holds at most that many, and 100,000 connections
need ``--workers`` (``polymq run --workers W``, docs/workers.md): W gateway processes
sharing the port, among which the kernel spreads the connections, over one engine in
the parent. The figures are then the sums over every server process (the parent and
each worker), and the row says how many connections each worker held. N defaults to
what the limit allows W processes, at most 100,000.

The connections come from several client processes (each a raw asyncio client with
thousands of sockets, a few hundred bytes each: paho per connection would weigh more
than the server), from source addresses 127.0.0.2, .3, ... one per process, so the
ephemeral ports of one address are no limit. While they are all connected a paho
client connects, subscribes and gets a message back, to show the server still
serves.

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
import functools
import json
import multiprocessing
import os
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
    listening_processes,
    process_server,
)

# Descriptors the server keeps for itself (listening socket, data files, epoll,
# logs, its storage's files) beyond the connections: the default N leaves them.
SERVER_RESERVE_FDS = 300
# The share of a worker's descriptors the default N counts on (see _most_connections).
SPREAD_ROOM = 0.9
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

# Put first on the server's path: its ``sitecustomize`` answers SIGUSR1 in every
# server process (a collection, and a snapshot when tracing).
_GC_HOOK = Path(__file__).parent / "_idle_gc"


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
    """The server's processes (the parent, and with workers each worker), each asked
    for a GC (and snapshot) by SIGUSR1."""

    def __init__(self, server: Server, out: Path, workers: int) -> None:
        assert server.pid is not None
        self.server = server
        parent = psutil.Process(server.pid)
        self.processes = [parent, *(parent.children() if workers > 1 else ())]
        self._out = out
        self._asked = dict.fromkeys((p.pid for p in self.processes), 0)

    def collect(self) -> list[Path]:
        """A ``gc.collect()`` in every server process, waited for; the snapshot files
        if tracing."""
        done = []
        for process in self.processes:
            self._asked[process.pid] += 1
            process.send_signal(signal.SIGUSR1)
            done.append(f"{process.pid}-{self._asked[process.pid]}")
        for name in done:
            _wait((self._out / f"done-{name}").exists, GC_TIMEOUT_S, "the server's GC")
        snapshots = [self._out / f"snapshot-{name}" for name in done]
        return [path for path in snapshots if path.exists()]

    def memory(self) -> tuple[int, int]:
        """RSS and USS in bytes, summed over the server's processes."""
        infos = [process.memory_full_info() for process in self.processes]
        return sum(int(i.rss) for i in infos), sum(int(i.uss) for i in infos)

    def fds(self) -> int:
        return sum(self.fds_each())

    def fds_each(self) -> list[int]:
        return [int(process.num_fds()) for process in self.processes]


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _all_listen(pid: int, port: int, workers: int) -> bool:
    return listening_processes(pid, port) >= workers


@contextlib.contextmanager
def _server(connections: int, out: Path, trace_frames: int, workers: int) -> Iterator[_GcServer]:
    """polymq with only the mqtt listener (over ``workers`` gateway processes), its
    connection limits raised to allow ``connections``, with the GC hook on its path."""
    room = str(connections + 1_000)
    settings = {
        "limits.max_connections": room,
        "limits.max_connections_per_protocol": room,
        "limits.max_connections_per_address": room,
    }
    env = _polymq_env(["mqtt"], settings)
    env["IDLE_BENCH_DIR"] = str(out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_GC_HOOK), env.get("PYTHONPATH")) if p)
    if trace_frames:
        env["PYTHONTRACEMALLOC"] = str(trace_frames)
    data_dir = out / "data"
    start_s = 120.0 if trace_frames else 30.0  # a traced start is several times slower
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        command = [sys.executable, "-m", "polymq.gateway", "run", "--data-dir", str(data_dir)]
        command += ["--log-level", "warning", "--mqtt-port", str(port)]
        command += ["--workers", str(workers)]
        try:
            with process_server(command, port, env=env, start_timeout=start_s) as server:
                if workers > 1:  # process_server waited for the first one only
                    assert server.pid is not None
                    every = functools.partial(_all_listen, server.pid, port, workers)
                    _wait(every, start_s, "every worker to listen")
                yield _GcServer(server, out, workers)
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


def _top(
    before: list[Path], after: list[Path], connections: int, limit: int
) -> tuple[float, list[str]]:
    """Traced heap growth per connection, and the top sites of the growth (summed
    over the server's processes: snapshots in the same order before and after)."""
    stats: list[tracemalloc.StatisticDiff] = []
    for old_path, new_path in zip(before, after, strict=True):
        old = tracemalloc.Snapshot.load(str(old_path))
        new = tracemalloc.Snapshot.load(str(new_path))
        stats += new.compare_to(old, "lineno")
    stats.sort(key=lambda stat: abs(stat.size_diff), reverse=True)
    growth = sum(s.size_diff for s in stats)
    lines = []
    for stat in stats[:limit]:
        frame = stat.traceback[0]
        lines.append(
            f"{stat.size_diff / connections:8.1f} B/conn {stat.count_diff / connections:6.2f}"
            f" blocks/conn  {frame.filename}:{frame.lineno}"
        )
    return growth / connections, lines


def _most_connections(hard: int, workers: int) -> int:
    """The connections ``workers`` processes can hold with ``hard`` descriptors each:
    the kernel spreads a shared port's connections by a hash, a few per cent unevenly,
    so workers leave that much room."""
    if workers == 1:
        return min(MAX_CONNECTIONS, hard - SERVER_RESERVE_FDS)
    return min(MAX_CONNECTIONS, int(workers * (hard - SERVER_RESERVE_FDS) * SPREAD_ROOM))


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
        "--workers",
        type=int,
        default=1,
        help="polymq run --workers W: W gateway processes share the connections",
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
    workers = max(1, args.workers)
    most = _most_connections(hard, workers)
    connections = args.connections or most
    if connections > most:
        parser.error(
            f"at most {most} connections here with {workers} worker(s)"
            f" (a process's fd hard limit is {hard}): add --workers"
        )
    with (
        tempfile.TemporaryDirectory(prefix="polymq-idle-") as temp,
        _server(connections, Path(temp), 1 if args.tracemalloc else 0, workers) as server,
    ):
        port = server.server.port
        # Warm up: the first connections load code and fill caches no later one costs.
        procs, pipes, _ = _open(port, WARM_UP_CONNECTIONS, WARM_UP_CONNECTIONS)
        _close(procs, pipes)
        assert _paho_round_trip(port)
        base_fds = server.fds()
        _wait(lambda: server.fds() <= base_fds, SETTLE_TIMEOUT_S, "the warm-up to close")
        base_each = server.fds_each()
        snap_before = server.collect()
        rss_before, uss_before = server.memory()
        procs, pipes, opened = _open(port, connections, args.per_process, max(1, args.waves))
        try:
            n = opened["opened"]
            _wait(
                lambda: server.fds() >= base_fds + n - 2, SETTLE_TIMEOUT_S, "the server's sockets"
            )
            held_each = [now - b for now, b in zip(server.fds_each(), base_each, strict=True)]
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
        if snap_before and snap_after:
            traced = _top(snap_before, snap_after, max(1, n), args.tracemalloc)
    row: dict[str, Any] = {
        "scenario": "idle mqtt connections",
        "connections": n,
        "waves": max(1, args.waves),
        **{k: v for k, v in opened.items() if k != "opened"},
        "fd_hard_limit": hard,
        "workers": workers,
        **({"connections_per_worker": held_each[1:]} if workers > 1 else {}),
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
