"""RocketMQ 5 gRPC benchmark with rocketmq-python-client on loopback.

For 100 B and 4 KiB bodies: send msgs/s one at a time (``send``; ``raw``: the same
through a bare grpc stub, whose client costs little) and pipelined (``send_async``, a
window of futures), SimpleConsumer receive (batches of 32) + ack
msgs/s, and end-to-end latency p50/p99 at a paced 1,000 msgs/s (and 200 msgs/s); plus
the server's CPU and RSS, and this process's CPU (the client's: one sync producer is
limited by the client's own work as much as by the server's). Every scenario is
bounded in count and time.

    .venv/bin/python -m bench.rocketmq                          # starts polymq itself
    .venv/bin/python -m bench.rocketmq --scenarios sync,async --sizes 100
    .venv/bin/python -m bench.rocketmq --flush sync             # sends wait for fsync
    .venv/bin/python -m bench.rocketmq --target 127.0.0.1:8081 [--server-pid PID]

A live progress line goes to stderr on a terminal (none off a terminal or with ``CI``).

With ``--target`` it measures whatever listens there (Apache RocketMQ's proxy, say);
pass ``--server-pid`` to get that server's CPU and RSS too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from bench._server import Meter, add_target_options, server_under_test
from bench._stats import p50_p99_ms
from polymq.gateway.progress import Progress

SIZES = (100, 4096)
SCENARIOS = ("sync", "raw", "async", "receive", "latency")

SYNC_COUNT = 3_000
ASYNC_COUNT = 10_000
ASYNC_WINDOW = 256
# The 1,000 msgs/s, and a rate this 2-core machine sustains with room to spare.
LATENCY_RATES = (1_000, 200)
LATENCY_SECONDS = 4.0
SCENARIO_LIMIT_S = 20.0
ACK_THREADS = 8  # the client's ack is a blocking call; ack_async needs an asyncio loop


def _config(endpoint: str) -> Any:
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(endpoint, Credentials(), request_timeout=10)


def _message(topic: str, body: bytes) -> Any:
    from rocketmq import Message

    msg = Message()
    msg.topic = topic
    msg.body = body
    return msg


@contextlib.contextmanager
def _started(client: Any) -> Iterator[Any]:
    client.startup()
    try:
        yield client
    finally:
        client.shutdown()


def send_sync(endpoint: str, topic: str, size: int) -> tuple[int, float]:
    from rocketmq import Producer

    body = b"x" * size
    with _started(Producer(_config(endpoint), (topic,))) as producer:
        producer.send(_message(topic, body))  # route and connection warm
        sent = 0
        start = time.perf_counter()
        while sent < SYNC_COUNT and time.perf_counter() - start < SCENARIO_LIMIT_S:
            producer.send(_message(topic, body))
            sent += 1
        return sent, time.perf_counter() - start


def send_raw(endpoint: str, topic: str, size: int) -> tuple[int, float]:
    """Sync sends through a bare grpc stub (grpcio's C-core channel, signed as the
    official clients sign): one producer whose client costs little, so the rate shows
    what the server allows one at a time (the official Python client's own CPU per
    send is as large as the server's)."""
    import grpc
    from rocketmq.grpc_protocol import definition_pb2, service_pb2
    from rocketmq.grpc_protocol.service_pb2_grpc import MessagingServiceStub

    from polymq.protocols.rocketmq.auth import sign

    def metadata() -> list[tuple[str, str]]:
        date_time = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return [
            ("x-mq-date-time", date_time),
            ("x-mq-client-id", "bench-raw"),
            (
                "authorization",
                "MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, "
                f"Signature={sign('', date_time)}",
            ),
        ]

    def request() -> Any:
        msg = definition_pb2.Message(body=b"x" * size)
        msg.topic.name = topic
        msg.system_properties.message_id = uuid.uuid4().hex
        msg.system_properties.message_type = definition_pb2.NORMAL
        return service_pb2.SendMessageRequest(messages=[msg])

    with grpc.insecure_channel(endpoint) as channel:
        stub = MessagingServiceStub(channel)
        stub.SendMessage(request(), metadata=metadata(), timeout=10)  # creates the topic
        sent = 0
        start = time.perf_counter()
        while sent < SYNC_COUNT and time.perf_counter() - start < SCENARIO_LIMIT_S:
            answer = stub.SendMessage(request(), metadata=metadata(), timeout=10)
            if answer.status.code != definition_pb2.OK:
                raise RuntimeError(f"send failed: {answer.status}")
            sent += 1
        return sent, time.perf_counter() - start


def send_async(endpoint: str, topic: str, size: int) -> tuple[int, float]:
    from rocketmq import Producer

    body = b"x" * size
    with _started(Producer(_config(endpoint), (topic,))) as producer:
        producer.send(_message(topic, body))
        window: deque[Future[Any]] = deque()
        sent = 0
        start = time.perf_counter()
        while sent < ASYNC_COUNT and time.perf_counter() - start < SCENARIO_LIMIT_S:
            if len(window) >= ASYNC_WINDOW:
                window.popleft().result(30)
            window.append(producer.send_async(_message(topic, body)))
            sent += 1
        for future in window:
            future.result(30)
        return sent, time.perf_counter() - start


def receive_ack(endpoint: str, topic: str, count: int) -> tuple[int, float]:
    from rocketmq import FilterExpression, SimpleConsumer

    group = f"bench-{uuid.uuid4().hex[:8]}"
    consumer = SimpleConsumer(_config(endpoint), group, {topic: FilterExpression()}, 2)
    with _started(consumer), ThreadPoolExecutor(ACK_THREADS) as acker:
        got = 0
        start = time.perf_counter()
        while got < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
            messages = consumer.receive(32, 30)
            if not messages:
                break
            list(acker.map(consumer.ack, messages))  # acks in parallel, all done
            got += len(messages)
        return got, time.perf_counter() - start


def latency(endpoint: str, topic: str, size: int, rate: int) -> tuple[float, float, int]:
    from rocketmq import FilterExpression, Producer, SimpleConsumer

    stamp = struct.Struct(">d")
    latencies: list[float] = []
    total = int(rate * LATENCY_SECONDS)
    padding = b"x" * max(0, size - stamp.size)
    group = f"bench-lat-{uuid.uuid4().hex[:8]}"
    with _started(Producer(_config(endpoint), (topic,))) as producer:
        producer.send(_message(topic, stamp.pack(time.perf_counter()) + padding))  # creates it
        consumer = SimpleConsumer(_config(endpoint), group, {topic: FilterExpression()}, 2)
        with _started(consumer), ThreadPoolExecutor(ACK_THREADS) as acker:
            consumer.receive(32, 30)  # drain the warm-up message
            done = threading.Event()

            def consume() -> None:
                deadline = time.monotonic() + LATENCY_SECONDS + 15
                while len(latencies) < total and time.monotonic() < deadline:
                    for m in consumer.receive(32, 30):
                        latencies.append(time.perf_counter() - stamp.unpack_from(m.body)[0])
                        acker.submit(consumer.ack, m)
                done.set()

            thread = threading.Thread(target=consume, daemon=True)
            thread.start()
            start = time.perf_counter()
            for i in range(total):
                due = start + i / rate
                while (now := time.perf_counter()) < due:
                    time.sleep(min(0.001, due - now))
                producer.send_async(_message(topic, stamp.pack(time.perf_counter()) + padding))
            done.wait(LATENCY_SECONDS + 30)
    if not latencies:
        return 0.0, 0.0, 0
    p50, p99 = p50_p99_ms(latencies)
    return p50, p99, len(latencies)


def _client_cpu() -> float:
    """This process's CPU seconds so far (every thread: the client's event loop too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_NAMES = {
    "sync": "send (sync, one at a time)",
    "raw": "send (sync, raw grpc stub)",
    "async": f"send_async (window {ASYNC_WINDOW})",
    "receive": "SimpleConsumer receive 32 + ack",
}


def run(
    host: str,
    port: int,
    meter: Meter,
    label: str,
    *,
    sizes: tuple[int, ...] = SIZES,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> None:
    endpoint = f"{host}:{port}"
    print(f"# RocketMQ 5 gRPC benchmark against {label} at {endpoint} (rocketmq-python-client)")
    print(f"# load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'scenario':<34} {'size':>6} {'msgs':>7} {'msgs/s':>9} {'MB/s':>7} "
        f"{'cpu%':>6} {'cpu us/msg':>10} {'client us/msg':>13}"
    )
    steps = len(sizes) * (
        sum(1 for name in scenarios if name != "latency")
        + (len(LATENCY_RATES) if "latency" in scenarios else 0)
    )
    with Progress(steps, "bench.rocketmq") as progress:
        for size in sizes:
            topic = f"bench-{size}-{uuid.uuid4().hex[:8]}"
            sent_total = 0
            for scenario in (name for name in SCENARIOS if name in scenarios and name in _NAMES):
                name = _NAMES[scenario]
                progress.step(f"{name} {size} B")
                cpu, client = meter.cpu(), _client_cpu()
                if scenario == "sync":
                    count, elapsed = send_sync(endpoint, topic, size)
                elif scenario == "raw":
                    count, elapsed = send_raw(endpoint, topic, size)
                elif scenario == "async":
                    count, elapsed = send_async(endpoint, topic, size)
                else:
                    count, elapsed = receive_ack(endpoint, topic, sent_total)
                if scenario != "receive":
                    sent_total += count + 1  # the warm-up message too
                used, client_used = meter.cpu() - cpu, _client_cpu() - client
                cpu_pct = used / elapsed * 100 if elapsed else 0.0
                rate = count / elapsed if elapsed else 0.0
                per_msg = used / count * 1e6 if count else 0.0
                client_per_msg = client_used / count * 1e6 if count else 0.0
                print(
                    f"{name:<34} {size:>6} {count:>7} {rate:>9.0f} {rate * size / 1e6:>7.1f} "
                    f"{cpu_pct:>6.0f} {per_msg:>10.0f} {client_per_msg:>13.0f}",
                    flush=True,
                )
            if "latency" not in scenarios:
                continue
            for rate in LATENCY_RATES:
                progress.step(f"end-to-end @{rate}/s {size} B")
                cpu = meter.cpu()
                p50, p99, n = latency(endpoint, f"{topic}-lat{rate}", size, rate)
                cpu_pct = (meter.cpu() - cpu) / LATENCY_SECONDS * 100
                row = f"end-to-end @{rate}/s p50/p99 ms"
                print(
                    f"{row:<34} {size:>6} {n:>7} {p50:>9.2f} {p99:>7.2f} {cpu_pct:>6.0f}",
                    flush=True,
                )
    print(f"server RSS: {meter.rss_mib():.0f} MiB")


def _names(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_options(parser)
    parser.add_argument(
        "--scenarios",
        type=lambda text: _names(text, SCENARIOS),
        default=SCENARIOS,
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--sizes",
        type=lambda text: tuple(int(part) for part in text.split(",")),
        default=SIZES,
        help="body sizes in bytes, comma-separated (default: 100,4096)",
    )
    parser.add_argument(
        "--flush",
        choices=("async", "sync"),
        default="async",
        help="polymq's rocketmq.flush: async answers a send once written (the default), "
        "sync once fsynced",
    )
    args = parser.parse_args()
    logging.getLogger("rocketmq-python-client").setLevel(logging.ERROR)
    with server_under_test(
        "rocketmq",
        target=args.target,
        server_pid=args.server_pid,
        settings={"rocketmq.flush": args.flush},
    ) as server:
        run(
            server.host,
            server.port,
            Meter(server.pid),
            server.label,
            sizes=args.sizes,
            scenarios=args.scenarios,
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
