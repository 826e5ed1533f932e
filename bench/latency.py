"""End-to-end latency and server CPU per message at an everyday rate (issue 21).

A publisher paced at 1,000 msgs/s, a consumer receiving each message (and acking
each one where the protocol has acks), 100 B bodies stamped with the send time;
prints p50/p99 of send-to-receive in ms and the server's CPU (user + system, all
threads, from psutil) per message over the scenario. Cases:

- ``amqp``: pika, transient queue, delivery_mode 1, consumer prefetch 500, basic.ack each
- ``amqp-durable``: the same with a durable queue and persistent messages (mode 2)
- ``mqtt0`` / ``mqtt1``: paho 3.1.1, publisher and subscriber at QoS 0 / QoS 1

    .venv/bin/python -m bench.latency                       # polymq, every case, 3 runs
    .venv/bin/python -m bench.latency --cases amqp --runs 5 --seconds 5
    .venv/bin/python -m bench.latency --amqp 127.0.0.1:5672 --amqp-pid PID  # RabbitMQ
    .venv/bin/python -m bench.latency --mqtt 127.0.0.1:1883 --mqtt-pid PID  # Mosquitto

Each run starts fresh clients; the medians of the runs are printed last. Without
``--amqp``/``--mqtt`` polymq is started once (``bench/_server.py``) and serves every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pika

from bench._server import HOST, Meter, Server, polymq_server
from bench._stats import p50_p99_ms
from bench.mqtt import Counter, _client, _stop, _subscribe
from polymq.gateway.progress import Progress

__all__ = ["CASES", "Result", "measure"]

RATE = 1_000
BODY = 100
_STAMP = struct.Struct(">d")


@dataclass(frozen=True)
class Result:
    case: str
    server: str
    received: int
    p50_ms: float
    p99_ms: float
    cpu_us_per_msg: float
    cpu_pct: float


def _paced(total: int, send: Callable[[int], object]) -> float:
    """Call ``send(i)`` at RATE per second; returns the seconds it took."""
    start = time.perf_counter()
    for i in range(total):
        due = start + i / RATE
        while (now := time.perf_counter()) < due:
            time.sleep(min(0.001, due - now))
        send(i)
    return time.perf_counter() - start


def _amqp(server: Server, total: int, durable: bool) -> list[float]:
    params = pika.ConnectionParameters(server.host, server.port, heartbeat=0)
    queue = f"lat-{uuid.uuid4().hex[:8]}"
    latencies: list[float] = []
    ready = threading.Event()

    def consumer() -> None:
        with contextlib.closing(pika.BlockingConnection(params)) as conn:
            ch = conn.channel()
            ch.queue_declare(queue, durable=durable, auto_delete=not durable)
            ch.basic_qos(prefetch_count=500)
            ready.set()
            deadline = time.monotonic() + total / RATE + 20
            for method, _, body in ch.consume(queue, inactivity_timeout=1):
                if method is not None:
                    latencies.append(time.perf_counter() - _STAMP.unpack_from(body)[0])
                    ch.basic_ack(method.delivery_tag)
                if len(latencies) >= total or time.monotonic() > deadline:
                    break
            ch.cancel()
            if durable:
                ch.queue_delete(queue)

    thread = threading.Thread(target=consumer)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the AMQP consumer did not start")
    pad = b"x" * (BODY - _STAMP.size)
    props = pika.BasicProperties(delivery_mode=2 if durable else 1)
    with contextlib.closing(pika.BlockingConnection(params)) as conn:
        ch = conn.channel()
        _paced(
            total,
            lambda _: ch.basic_publish("", queue, _STAMP.pack(time.perf_counter()) + pad, props),
        )
        thread.join(total / RATE + 30)
    return latencies


def _mqtt(server: Server, total: int, qos: int) -> list[float]:
    counter = Counter()
    topic = f"lat/{uuid.uuid4().hex[:8]}"
    sub = _client(server.host, server.port, counter)
    _subscribe(sub, topic, qos)
    pub = _client(server.host, server.port)
    pad = b"x" * (BODY - 1 - _STAMP.size)
    _paced(total, lambda _: pub.publish(topic, b"T" + _STAMP.pack(time.perf_counter()) + pad, qos))
    counter.wait(total, total / RATE + 30)
    _stop(pub, sub)
    return list(counter.latencies)


CASES: dict[str, tuple[str, Callable[[Server, int], list[float]]]] = {
    "amqp": ("amqp", lambda s, n: _amqp(s, n, durable=False)),
    "amqp-durable": ("amqp", lambda s, n: _amqp(s, n, durable=True)),
    "mqtt0": ("mqtt", lambda s, n: _mqtt(s, n, 0)),
    "mqtt1": ("mqtt", lambda s, n: _mqtt(s, n, 1)),
}


def measure(case: str, server: Server, seconds: float) -> Result:
    """One run of ``case`` against ``server``: fresh clients, RATE x seconds messages."""
    _, run = CASES[case]
    meter = Meter(server.pid)
    total = int(RATE * seconds)
    cpu, wall = meter.cpu(), time.perf_counter()
    latencies = run(server, total)
    used, wall = meter.cpu() - cpu, time.perf_counter() - wall
    p50, p99 = p50_p99_ms(latencies) if latencies else (0.0, 0.0)
    n = len(latencies)
    return Result(
        case=case,
        server=server.label,
        received=n,
        p50_ms=p50,
        p99_ms=p99,
        cpu_us_per_msg=used / n * 1e6 if n else 0.0,
        cpu_pct=used / wall * 100 if wall else 0.0,
    )


def median(results: list[Result]) -> Result:
    """The median of each figure over runs of one case on one server."""
    first = results[0]
    return Result(
        case=first.case,
        server=first.server,
        received=int(statistics.median(r.received for r in results)),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        cpu_us_per_msg=statistics.median(r.cpu_us_per_msg for r in results),
        cpu_pct=statistics.median(r.cpu_pct for r in results),
    )


def _line(r: Result, tag: str = "") -> str:
    return (
        f"{r.case:<13} {r.server:<22} {tag:<7} {r.received:>6} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f}"
        f" {r.cpu_us_per_msg:>8.0f} {r.cpu_pct:>6.0f}"
    )


def _header() -> str:
    return (
        f"{'case':<13} {'server':<22} {'run':<7} {'msgs':>6} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'cpu us/m':>8} {'cpu %':>6}"
    )


@contextlib.contextmanager
def _servers(args: argparse.Namespace, listeners: set[str]) -> Iterator[dict[str, Server]]:
    """The brokers to measure, per listener: the given ones, else a polymq each."""
    servers: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        for name in sorted(listeners):
            target = getattr(args, name)
            if target:
                host, _, port = target.rpartition(":")
                servers[name] = Server(
                    host or HOST, int(port), getattr(args, f"{name}_pid"), target
                )
            else:
                servers[name] = stack.enter_context(polymq_server(name, durability=args.durability))
        yield servers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="amqp,amqp-durable", help=f"of {','.join(CASES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--amqp", metavar="HOST:PORT", help="an AMQP broker already running")
    parser.add_argument("--amqp-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--mqtt", metavar="HOST:PORT", help="an MQTT broker already running")
    parser.add_argument("--mqtt-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--durability", choices=("sync", "async"), default="sync")
    parser.add_argument("--json", action="store_true", help="one JSON line per result")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(CASES)}")
    listeners = {CASES[c][0] for c in cases}
    with (
        _servers(args, listeners) as servers,
        Progress(len(cases) * args.runs, "bench.latency") as progress,
    ):
        print(f"# {RATE} msgs/s, {BODY} B, {args.seconds:g} s per run", flush=True)
        print(_header(), flush=True)
        for case in cases:
            server = servers[CASES[case][0]]
            results = []
            for run in range(args.runs):
                progress.step(f"{case} run {run + 1}/{args.runs}")
                result = measure(case, server, args.seconds)
                results.append(result)
                print(_emit(result, f"#{run + 1}", args.json), flush=True)
            print(_emit(median(results), "median", args.json), flush=True)


def _emit(result: Result, tag: str, as_json: bool) -> str:
    if as_json:
        data: dict[str, Any] = asdict(result)
        data["run"] = tag
        return json.dumps(data)
    return _line(result, tag)


if __name__ == "__main__":
    main()
