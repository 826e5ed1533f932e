"""Kafka benchmark with confluent-kafka (librdkafka) on loopback.

For 100 B and 1 KiB records, acks=all, linger 5 ms: produce records/s and MB/s,
consume records/s, end-to-end latency p50/p99 at a paced 10,000 records/s, and the
server's CPU and RSS. Then, with the server stopped, the very batches it stored are
appended again straight into a fresh storage engine (same durability, one append at a
time as one connection does), so the difference is what the protocol layer costs.
Every scenario is bounded in count and time.

    .venv/bin/python -m bench.kafka                    # starts polymq itself
    .venv/bin/python -m bench.kafka --quick            # small counts (smoke run)
    .venv/bin/python -m bench.kafka --target 127.0.0.1:9092 [--server-pid PID]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench._server import Meter, add_target_options, polymq_server
from bench._stats import p50_p99_ms
from polymq.gateway.progress import Progress

SIZES = (100, 1024)

PRODUCE_COUNT = {100: 200_000, 1024: 100_000}
LATENCY_RATE = 10_000
LATENCY_SECONDS = 3.0
SCENARIO_LIMIT_S = 30.0


def _producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "queue.buffering.max.messages": 1_000_000,
        }
    )


def produce(bootstrap: str, topic: str, size: int, count: int) -> tuple[int, float]:
    producer = _producer(bootstrap)
    value = b"x" * size
    delivered = 0

    def on_delivery(error: KafkaError | None, _: object) -> None:
        nonlocal delivered
        if error is None:
            delivered += 1

    start = time.perf_counter()
    sent = 0
    while sent < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
        try:
            producer.produce(topic, value=value, partition=0, on_delivery=on_delivery)
            sent += 1
        except BufferError:
            producer.poll(0.01)
    producer.flush(SCENARIO_LIMIT_S)
    return delivered, time.perf_counter() - start


def consume(bootstrap: str, topic: str, count: int) -> tuple[int, float]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}"}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    got = 0
    start = time.perf_counter()
    try:
        while got < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
            for message in consumer.consume(min(count - got, 10_000), timeout=1.0):
                if message.error() is None:
                    got += 1
    finally:
        consumer.close()
    return got, time.perf_counter() - start


def latency(bootstrap: str, topic: str, size: int) -> tuple[float, float, int]:
    stamp = struct.Struct(">d")
    total = int(LATENCY_RATE * LATENCY_SECONDS)
    latencies: list[float] = []
    ready = threading.Event()

    def consumer_loop() -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                "fetch.wait.max.ms": 100,
                "fetch.min.bytes": 1,
            }
        )
        consumer.assign([TopicPartition(topic, 0, 0)])
        ready.set()
        deadline = time.monotonic() + LATENCY_SECONDS + 20
        try:
            while len(latencies) < total and time.monotonic() < deadline:
                # poll, not consume(n): consume waits to fill its batch, adding delay
                message = consumer.poll(0.2)
                if message is None or message.error() is not None:
                    continue
                value = message.value()
                if value is not None:
                    latencies.append(time.perf_counter() - stamp.unpack_from(value)[0])
        finally:
            consumer.close()

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1)])[topic].result(30)
    thread = threading.Thread(target=consumer_loop)
    thread.start()
    ready.wait(30)
    time.sleep(0.5)  # let the consumer's first fetch reach the server
    producer = _producer(bootstrap)
    padding = b"x" * max(0, size - stamp.size)
    start = time.perf_counter()
    for i in range(total):
        due = start + i / LATENCY_RATE
        while (now := time.perf_counter()) < due:
            time.sleep(min(0.0005, due - now))
        producer.produce(topic, value=stamp.pack(time.perf_counter()) + padding, partition=0)
        producer.poll(0)
    producer.flush(30)
    thread.join(LATENCY_SECONDS + 30)
    if not latencies:
        return 0.0, 0.0, 0
    p50, p99 = p50_p99_ms(latencies)
    return p50, p99, len(latencies)


def run(bootstrap: str, meter: Meter, produce_counts: dict[int, int]) -> list[str]:
    """Run the client scenarios; return the topics written (for the engine replay)."""
    print(f"{'scenario':<36} {'size':>5} {'records':>8} {'rec/s':>9} {'MB/s':>7} {'cpu%':>5}")
    with Progress(len(SIZES) * 3, "bench.kafka") as progress:
        topics = [
            _run_size(bootstrap, meter, size, produce_counts[size], progress) for size in SIZES
        ]
    print(f"server RSS: {meter.rss_mib():.0f} MiB", flush=True)
    return topics


def _run_size(bootstrap: str, meter: Meter, size: int, count: int, progress: Progress) -> str:
    """The rows of one record size; returns the topic written."""
    topic = f"bench-{size}-{uuid.uuid4().hex[:8]}"
    scenarios: tuple[tuple[str, Callable[[], tuple[int, float]]], ...] = (
        ("produce acks=all linger=5ms", partial(produce, bootstrap, topic, size, count)),
        ("consume (assign, from 0)", partial(consume, bootstrap, topic, count)),
    )
    for name, fn in scenarios:
        progress.step(f"{name}, {size} B")
        cpu = meter.cpu()
        done, elapsed = fn()
        cpu_pct = (meter.cpu() - cpu) / elapsed * 100 if elapsed else 0.0
        rate = done / elapsed if elapsed else 0.0
        print(
            f"{name:<36} {size:>5} {done:>8} {rate:>9.0f} "
            f"{rate * size / 1e6:>7.1f} {cpu_pct:>5.0f}",
            flush=True,
        )
    progress.step(f"end-to-end latency, {size} B")
    cpu = meter.cpu()
    p50, p99, n = latency(bootstrap, topic + "-lat", size)
    cpu_pct = (meter.cpu() - cpu) / LATENCY_SECONDS * 100
    label = f"end-to-end @{LATENCY_RATE}/s p50 / p99 ms"
    print(f"{label:<36} {size:>5} {n:>8} {p50:>9.2f} {p99:>7.2f} {cpu_pct:>5.0f}", flush=True)
    return topic


async def engine_replay(data_dir: Path, topics: list[str]) -> None:
    """Append the batches the server stored, as stored, into a fresh engine."""
    import polymq.protocols.kafka  # noqa: F401  (the kafka.v2 expander)
    from polymq.storage.engine import Engine, EngineConfig
    from polymq.storage.model import AppendRequest, BatchEntry, QueueRef

    print(f"{'engine raw append (same batches)':<36} {'size':>5} {'batches':>8} {'MB/s':>9}")
    for size, topic in zip(SIZES, topics, strict=True):
        raws: list[tuple[bytes, int]] = []
        async with Engine(EngineConfig(data_dir=data_dir)) as source:
            queue = QueueRef("default", topic, 0)
            offset = 0
            latest = (await source.queue_offsets(queue)).latest
            while offset < latest:
                batches = await source.read_batches(queue, offset, max_bytes=8 << 20)
                for batch in batches:
                    if batch.raw is not None:
                        raws.append((batch.raw, batch.count))
                offset = batches[-1].base_offset + batches[-1].count
        with tempfile.TemporaryDirectory(prefix="polymq-bench-kafka-engine-") as fresh:
            async with Engine(EngineConfig(data_dir=Path(fresh))) as engine:
                await engine.create_topic("default", topic)
                target = QueueRef("default", topic, 0)
                start = time.perf_counter()
                nbytes = 0
                for raw, count in raws:
                    entry = BatchEntry(format="kafka.v2", raw=raw, count=count)
                    await engine.append([AppendRequest(entry=entry, queues=(target,))])
                    nbytes += len(raw)
                    if time.perf_counter() - start > SCENARIO_LIMIT_S:
                        break
                elapsed = time.perf_counter() - start
        rate = nbytes / elapsed / 1e6 if elapsed else 0.0
        print(f"{'':<36} {size:>5} {len(raws):>8} {rate:>9.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_options(parser)
    parser.add_argument("--quick", action="store_true", help="small counts, a smoke run")
    args = parser.parse_args()
    counts = {size: 2_000 for size in SIZES} if args.quick else dict(PRODUCE_COUNT)
    if args.quick:
        global LATENCY_SECONDS
        LATENCY_SECONDS = 0.5
    import confluent_kafka

    print(f"# Kafka benchmark (confluent-kafka {confluent_kafka.version()[0]})")
    if args.target:
        run(args.target, Meter(args.server_pid), counts)
        return
    with tempfile.TemporaryDirectory(prefix="polymq-bench-kafka-") as data_dir:
        with polymq_server("kafka", data_dir=Path(data_dir)) as server:
            topics = run(server.address, Meter(server.pid), counts)
        asyncio.run(engine_replay(Path(data_dir), topics))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
