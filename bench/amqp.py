"""AMQP 0-9-1 benchmark with pika on loopback.

For 100 B and 4 KiB bodies: publish msgs/s without confirms and with confirms (pika
BlockingConnection, one publish waiting for its confirm at a time), consume msgs/s
with prefetch 500 and an ack per message, and end-to-end latency p50/p99 at a paced
1,000 msgs/s; plus the server's CPU and RSS. Every scenario is bounded in count and
time.

    .venv/bin/python -m bench.amqp                         # starts polymq itself
    .venv/bin/python -m bench.amqp --target 127.0.0.1:5672 [--server-pid PID]

With ``--target`` it measures whatever broker listens there (RabbitMQ, say); pass
``--server-pid`` to get that server's CPU and RSS too. ``--lockstep N`` measures only
the server's CPU per message with one message in flight at a time (see ``lockstep``).
"""

from __future__ import annotations

import argparse
import contextlib
import struct
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial

import pika

from bench._server import Meter, add_target_options, server_under_test
from bench._stats import p50_p99_ms
from polymq.gateway.progress import Progress

SIZES = (100, 4096)

PUBLISH_COUNT = 20_000
CONFIRM_COUNT = 3_000
LATENCY_RATE = 1_000
LATENCY_SECONDS = 5.0
SCENARIO_LIMIT_S = 30.0
PREFETCH = 500


def _connect(host: str, port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(host, port, heartbeat=0, blocked_connection_timeout=60)
    )


def _count(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> int:
    count: int = ch.queue_declare(queue, passive=True).method.message_count
    return count


def publish(
    host: str,
    port: int,
    queue: str,
    size: int,
    count: int,
    confirms: bool,
    *,
    durable: bool = True,
) -> tuple[int, float]:
    """``count`` publishes of ``size`` B, one at a time (with ``confirms``, each waits
    for its confirm): a durable queue and persistent messages, or with ``durable``
    off a transient queue and messages (what a broker need not fsync)."""
    body = b"x" * size
    with contextlib.closing(_connect(host, port)) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, durable=durable)
        if confirms:
            ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2 if durable else 1)
        start = time.perf_counter()
        sent = 0
        while sent < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
            ch.basic_publish("", queue, body, props)
            sent += 1
        # Without confirms the figure counts only once the server has them all.
        deadline = time.monotonic() + SCENARIO_LIMIT_S
        while not confirms and _count(ch, queue) < sent and time.monotonic() < deadline:
            time.sleep(0.01)
        return sent, time.perf_counter() - start


def consume(
    host: str, port: int, queue: str, count: int, *, ack_every: int = 1
) -> tuple[int, float]:
    """Up to ``count`` messages with prefetch 500: an ack per message, or with
    ``ack_every`` N one ack with ``multiple`` per N deliveries (and one for the rest)."""
    with contextlib.closing(_connect(host, port)) as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=PREFETCH)
        got = 0
        last_tag = 0
        start = time.perf_counter()
        for method, _, _ in ch.consume(queue, inactivity_timeout=5):
            if method is None:
                break
            got += 1
            last_tag = method.delivery_tag
            if got % ack_every == 0:
                ch.basic_ack(last_tag, multiple=ack_every > 1)
            if got >= count or time.perf_counter() - start > SCENARIO_LIMIT_S:
                break
        if got % ack_every:
            ch.basic_ack(last_tag, multiple=True)
        elapsed = time.perf_counter() - start
        ch.cancel()
        return got, elapsed


def delete_queue(host: str, port: int, queue: str) -> None:
    """Drop a queue a scenario left (so runs against one broker start alike)."""
    with contextlib.closing(_connect(host, port)) as conn:
        conn.channel().queue_delete(queue)


def latency(host: str, port: int, queue: str, size: int) -> tuple[float, float, int]:
    stamp = struct.Struct(">d")
    latencies: list[float] = []
    total = int(LATENCY_RATE * LATENCY_SECONDS)
    ready = threading.Event()

    def consumer() -> None:
        with contextlib.closing(_connect(host, port)) as conn:
            ch = conn.channel()
            ch.queue_declare(queue, durable=True)
            ch.basic_qos(prefetch_count=500)
            ready.set()
            deadline = time.monotonic() + LATENCY_SECONDS + 15
            for method, _, body in ch.consume(queue, inactivity_timeout=1):
                if method is not None:
                    latencies.append(time.perf_counter() - stamp.unpack_from(body)[0])
                    ch.basic_ack(method.delivery_tag)
                if len(latencies) >= total or time.monotonic() > deadline:
                    break
            ch.cancel()

    thread = threading.Thread(target=consumer)
    thread.start()
    ready.wait(30)
    padding = b"x" * max(0, size - stamp.size)
    with contextlib.closing(_connect(host, port)) as conn:
        ch = conn.channel()
        start = time.perf_counter()
        for i in range(total):
            due = start + i / LATENCY_RATE
            while (now := time.perf_counter()) < due:
                time.sleep(min(0.001, due - now))
            ch.basic_publish("", queue, stamp.pack(time.perf_counter()) + padding)
        thread.join(LATENCY_SECONDS + 30)
    if not latencies:
        return 0.0, 0.0, 0
    p50, p99 = p50_p99_ms(latencies)
    return p50, p99, len(latencies)


def lockstep(host: str, port: int, count: int, heartbeat: int) -> tuple[int, float]:
    """Publish one 100 B message, wait until the consumer (prefetch 500) got it and
    acked it, then the next: every message is handled on its own, whatever the
    machine's load, which is what 1,000 msgs/s looks like to the server (each
    message pays every wake-up) without the pacing that load makes noisy. Both
    connections use ``heartbeat`` (pika's default is the server's, 60 s)."""
    queue = f"lockstep-{uuid.uuid4().hex[:8]}"
    params = pika.ConnectionParameters(host, port, heartbeat=heartbeat)
    got = threading.Event()
    ready = threading.Event()
    stop = threading.Event()
    failed: list[BaseException] = []

    def consumer() -> None:
        try:
            with contextlib.closing(pika.BlockingConnection(params)) as conn:
                ch = conn.channel()
                ch.queue_declare(queue, auto_delete=True)
                ch.basic_qos(prefetch_count=PREFETCH)

                def on_message(
                    ch: pika.adapters.blocking_connection.BlockingChannel,
                    method: pika.spec.Basic.Deliver,
                    _properties: pika.BasicProperties,
                    _body: bytes,
                ) -> None:
                    ch.basic_ack(method.delivery_tag)
                    got.set()

                ch.basic_consume(queue, on_message)
                ready.set()
                while not stop.is_set():
                    conn.process_data_events(time_limit=0.1)
        except BaseException as e:  # reported by the caller
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    if not ready.wait(SCENARIO_LIMIT_S) or failed:
        raise RuntimeError(f"the lockstep consumer did not start: {failed}")
    body = b"x" * 100
    start = time.perf_counter()
    sent = 0
    try:
        with contextlib.closing(pika.BlockingConnection(params)) as conn:
            ch = conn.channel()
            while sent < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
                got.clear()
                ch.basic_publish("", queue, body)
                if not got.wait(SCENARIO_LIMIT_S):
                    raise RuntimeError(f"message {sent} was not delivered")
                sent += 1
        return sent, time.perf_counter() - start
    finally:
        stop.set()
        thread.join(SCENARIO_LIMIT_S)


def run_lockstep(host: str, port: int, meter: Meter, count: int) -> None:
    """``--lockstep``: only the lockstep case, without and with heartbeats."""
    print(f"{'scenario':<34} {'msgs':>7} {'msgs/s':>9} {'cpu us/msg':>10}")
    for heartbeat in (0, 60):
        lockstep(host, port, min(count, 200), heartbeat)  # warm-up, not measured
        cpu = meter.cpu()
        sent, elapsed = lockstep(host, port, count, heartbeat)
        used = meter.cpu() - cpu
        name = f"lockstep, heartbeat {heartbeat} s"
        print(f"{name:<34} {sent:>7} {sent / elapsed:>9.0f} {used / sent * 1e6:>10.0f}", flush=True)


def run(host: str, port: int, meter: Meter, label: str) -> None:
    print(f"# AMQP benchmark against {label} at {host}:{port} (pika {pika.__version__})")
    print(
        f"{'scenario':<34} {'size':>6} {'msgs':>7} {'msgs/s':>9} {'MB/s':>7} {'cpu%':>6}"
        f" {'cpu us/msg':>10}"
    )
    with Progress(len(SIZES) * 4, "bench.amqp") as progress:
        for size in SIZES:
            _run_size(host, port, meter, size, progress)
    print(f"server RSS: {meter.rss_mib():.0f} MiB")


def _run_size(host: str, port: int, meter: Meter, size: int, progress: Progress) -> None:
    """The table's rows for one body size."""
    queue = f"bench-{size}-{uuid.uuid4().hex[:8]}"
    scenarios: list[tuple[str, Callable[[], tuple[int, float]]]] = [
        (
            "publish, no confirms",
            partial(publish, host, port, queue, size, PUBLISH_COUNT, False),
        ),
        (
            "publish, confirms (one at a time)",
            partial(publish, host, port, queue + "-c", size, CONFIRM_COUNT, True),
        ),
        ("consume, prefetch 500, acks", partial(consume, host, port, queue, PUBLISH_COUNT)),
    ]
    for name, scenario in scenarios:
        progress.step(f"{name}, {size} B")
        cpu = meter.cpu()
        count, elapsed = scenario()
        used = meter.cpu() - cpu
        cpu_pct = used / elapsed * 100 if elapsed else 0.0
        per_msg = used / count * 1e6 if count else 0.0
        rate = count / elapsed if elapsed else 0.0
        mb_s = rate * size / 1e6
        print(
            f"{name:<34} {size:>6} {count:>7} {rate:>9.0f} {mb_s:>7.1f} {cpu_pct:>6.0f}"
            f" {per_msg:>10.0f}",
            flush=True,
        )
    progress.step(f"end-to-end latency, {size} B")
    cpu = meter.cpu()
    p50, p99, n = latency(host, port, queue + "-lat", size)
    used = meter.cpu() - cpu
    cpu_pct = used / LATENCY_SECONDS * 100
    per_msg = used / n * 1e6 if n else 0.0
    name = "end-to-end @1000/s p50/p99 ms"
    print(
        f"{name:<34} {size:>6} {n:>7} {p50:>9.2f} {p99:>7.2f} {cpu_pct:>6.0f} {per_msg:>10.0f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_options(parser)
    parser.add_argument(
        "--lockstep",
        type=int,
        metavar="N",
        help="only publish N messages one at a time, each consumed and acked before the next",
    )
    args = parser.parse_args()
    with server_under_test("amqp", target=args.target, server_pid=args.server_pid) as server:
        if args.lockstep:
            run_lockstep(server.host, server.port, Meter(server.pid), args.lockstep)
        else:
            run(server.host, server.port, Meter(server.pid), server.label)


if __name__ == "__main__":
    main()
