"""The storage RPC's cost: our framed msgpack RPC beside gRPC, and a storage node beside
the embedded engine.

1. A trivial bytes echo (16 B), one call at a time and 64 calls in flight, through
   ``storage.rpc`` and through ``grpc.aio`` unary calls (generic handler, bytes in and
   out, so no .proto): calls/s and per-call p50/p99.
2. Appends of 100 B messages (one message per call, as a gateway makes them), one at a
   time, 8 and 64 in flight: through ``RemoteStorage`` to a storage node, each append
   its own call and merged per loop iteration (``storage/remote_appends.py``), with
   the CPU each side spent per message; and straight into an embedded engine; msgs/s
   and per-call p50/p99.

Every server runs in its own process (as in production: a gateway and a node do not
share a core's event loop), on uvloop when it is installed, like ``polymq``. Each
scenario stops after a fixed time.

    .venv/bin/python -m bench.rpc            # about 30 s
    .venv/bin/python -m bench.rpc --quick    # smoke run, a few seconds
    .venv/bin/python -m bench.rpc --durability async
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench._stats import p50_p99_ms
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef
from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from polymq.storage.rpc import RpcClient, RpcServer

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = b"x" * 16
BODY = b"x" * 100
TOPIC = "bench"
QUEUE = QueueRef(DEFAULT_NAMESPACE, TOPIC)
CONCURRENCY = 64

Call = Callable[[], Awaitable[Any]]


# -- servers (each in its own process) -------------------------------------------------


async def _echo(payload: bytes) -> bytes:
    return payload


async def _serve(kind: str, data_dir: str, durability: str) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)  # parent gone
    if kind == "framed":
        server = RpcServer({"echo": _echo})
        await server.start()
        port = server.address[1]
        close: Callable[[], Awaitable[None]] = server.close
    elif kind == "grpc":

        async def echo(request: bytes, context: Any) -> bytes:
            return request

        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        )
        grpc_server = grpc.aio.server()
        grpc_server.add_generic_rpc_handlers((handler,))
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()

        async def close() -> None:
            await grpc_server.stop(None)
    else:
        node = StorageNode(_engine(Path(data_dir), durability))
        await node.start()
        port = node.address[1]
        close = node.close
    print(port, flush=True)
    await stop.wait()
    await close()


def _engine(data_dir: Path, durability: str) -> Engine:
    return Engine(EngineConfig(data_dir=data_dir, durability=Durability(durability)))


@contextlib.contextmanager
def _server_process(
    kind: str, data_dir: str = "", durability: str = "sync"
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    command = ["--serve", kind, "--data-dir", data_dir, "--durability", durability]
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.rpc", *command],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline()), process
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


# -- measuring -------------------------------------------------------------------------


async def measure(call: Call, concurrency: int, seconds: float) -> tuple[int, float, float, float]:
    """Calls made, calls/s, p50 and p99 ms: ``concurrency`` loops calling until time."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        clock = time.perf_counter
        while clock() < deadline:
            start = clock()
            await call()
            latencies.append(clock() - start)

    for _ in range(20):  # warm up (connections, caches)
        await call()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    p50, p99 = p50_p99_ms(latencies)
    return len(latencies), len(latencies) / elapsed, p50, p99


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def row(name: str, unit: str, figures: tuple[int, float, float, float]) -> None:
    count, rate, p50, p99 = figures
    print(f"{name:<44} {count:>9,} {rate:>12,.0f} {unit:<8} {p50:>8.3f} {p99:>8.3f}")


@contextlib.asynccontextmanager
async def _framed_echo(port: int) -> AsyncIterator[Call]:
    client = RpcClient("127.0.0.1", port)
    try:
        yield lambda: client.call("echo", PAYLOAD)
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def _grpc_echo(port: int) -> AsyncIterator[Call]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        echo = channel.unary_unary("/bench.Echo/Echo")
        yield lambda: echo(PAYLOAD)


def _append_call(storage: Any) -> Call:
    request = [AppendRequest(entry=Message(body=BODY), queues=(QUEUE,))]
    return lambda: storage.append(request)


async def run(seconds: float, durability: str) -> None:
    print(f"{'scenario':<44} {'calls':>9} {'rate':>12} {'':<8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, kind, client in (
        ("framed", "framed", _framed_echo),
        ("grpc.aio", "grpc", _grpc_echo),
    ):
        with _server_process(kind) as (port, _):
            async with client(port) as call:
                for concurrency in (1, CONCURRENCY):
                    figures = await measure(call, concurrency, seconds)
                    row(f"echo 16 B, {name}, c{concurrency}", "calls/s", figures)
    with tempfile.TemporaryDirectory(prefix="polymq-bench-rpc-") as tmp:
        with _server_process("node", str(Path(tmp) / "node"), durability) as (port, node):
            node_cpu = psutil.Process(node.pid)
            me = psutil.Process()
            remotes = {
                merge: RemoteStorage("127.0.0.1", port, merge_appends=merge)
                for merge in (False, True)
            }
            await remotes[False].create_topic(DEFAULT_NAMESPACE, TOPIC)
            for concurrency in (1, 8, CONCURRENCY):
                for merge, remote in remotes.items():  # side by side
                    before = _cpu(node_cpu), _cpu(me)
                    figures = await measure(_append_call(remote), concurrency, seconds)
                    node_us = (_cpu(node_cpu) - before[0]) / figures[0] * 1e6
                    client_us = (_cpu(me) - before[1]) / figures[0] * 1e6
                    name = f"append 100 B, RemoteStorage{', merged' if merge else ''}"
                    row(f"{name}, c{concurrency}", "msgs/s", figures)
                    print(
                        f"{'':<8}CPU per message: node {node_us:.0f} us, client {client_us:.0f} us"
                    )
            for remote in remotes.values():
                await remote.close()
        async with _engine(Path(tmp) / "embedded", durability) as engine:
            await engine.create_topic(DEFAULT_NAMESPACE, TOPIC)
            for concurrency in (1, CONCURRENCY):
                figures = await measure(_append_call(engine), concurrency, seconds)
                row(f"append 100 B, embedded engine, c{concurrency}", "msgs/s", figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.5 s per scenario")
    parser.add_argument("--seconds", type=float, default=3.0, help="per scenario")
    parser.add_argument("--durability", choices=("sync", "async"), default="sync")
    parser.add_argument("--serve", choices=("framed", "grpc", "node"), help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        if args.serve:
            runner.run(_serve(args.serve, args.data_dir, args.durability))
        else:
            loop = "uvloop" if loop_factory else "asyncio"
            print(f"event loop: {loop}; engine durability: {args.durability}")
            runner.run(run(0.5 if args.quick else args.seconds, args.durability))


if __name__ == "__main__":
    main()
