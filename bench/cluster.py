"""The separated form against the merged one, with Kafka (confluent-kafka) on loopback.

One run, 100 B records, acks=all, linger 5 ms:

1. the same workload on the merged server (``polymq run``) and on the separated form
   with one storage node behind one gateway: produce records/s, and end-to-end latency
   p50/p99 at a paced 2,000 records/s; the difference is what separation adds (a
   gateway-to-node round trip on the produce and on the fetch);
2. throughput of the separated form with 1, 2 and 3 storage nodes behind 2 gateways:
   six topics (spread over the nodes by the nameserver), six producers, three through
   each gateway, records/s together, and the CPU every process of the form used.

Every process is real (``python -m polymq.gateway ...``), on free ports; each scenario is
bounded in count and time. On a 2-core machine the nodes, gateways and clients share
the same cores: more nodes cannot add CPU, so compare the cost per record.

    .venv/bin/python -m bench.cluster            # about 2-3 minutes
    .venv/bin/python -m bench.cluster --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench import kafka as kafka_bench
from bench._server import polymq_server
from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.gateway.config import ENV_PREFIX

SIZE = 100
PRODUCE_COUNT = 100_000
SPREAD_COUNT = 30_000  # per producer, six producers
LATENCY_RATE = 2_000
LATENCY_SECONDS = 3.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env[f"{ENV_PREFIX}CLUSTER__HEARTBEAT_MS"] = "500"
    return env


class _Cpu:
    """CPU seconds of a set of processes (all of a cluster's), summed."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]

    def seconds(self) -> float:
        total = 0.0
        for proc in self._procs:
            times = proc.cpu_times()
            total += float(times.user + times.system)
        return total

    def rss_mib(self) -> float:
        return float(sum(proc.memory_info().rss for proc in self._procs)) / (1 << 20)


def _produce_and_latency(bootstrap: str, cpu: _Cpu, count: int) -> list[str]:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the result
    admin.create_topics([NewTopic(topic, 1)])[topic].result(30)
    before = cpu.seconds()
    delivered, seconds = kafka_bench.produce(bootstrap, topic, SIZE, count)
    used = cpu.seconds() - before
    kafka_bench.LATENCY_RATE = LATENCY_RATE
    kafka_bench.LATENCY_SECONDS = LATENCY_SECONDS
    p50, p99, n = kafka_bench.latency(bootstrap, f"{topic}-lat", SIZE)
    return [
        f"{delivered / seconds:>12,.0f}",
        f"{used / max(delivered, 1) * 1e6:>9.1f}",
        f"{p50:>7.2f}",
        f"{p99:>7.2f}",
        f"{n:>6}",
    ]


async def _cluster(data_dir: Path, storage: int, gateways: int) -> LocalCluster:
    specs = layout(storage=storage, gateways=gateways, data_dir=data_dir, port_offset=None)
    cluster = LocalCluster(specs, env=_env())
    await cluster.start()
    return cluster


def _pids(cluster: LocalCluster) -> list[int]:
    return [c.process.pid for c in cluster.children.values() if c.process is not None]


def _spread(bootstraps: Sequence[str], count: int) -> tuple[int, float]:
    """Six topics, six producers (round-robin over the gateways), all at once."""
    topics = [f"spread-{uuid.uuid4().hex[:8]}" for _ in range(6)]
    for i, topic in enumerate(topics):
        admin = AdminClient({"bootstrap.servers": bootstraps[i % len(bootstraps)]})
        admin.create_topics([NewTopic(topic, 1)])[topic].result(30)
    results: list[tuple[int, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        result = kafka_bench.produce(bootstraps[i % len(bootstraps)], topics[i], SIZE, count)
        with lock:
            results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(topics))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(d for d, _ in results), time.perf_counter() - start


async def main_async(quick: bool) -> None:
    count = 2_000 if quick else PRODUCE_COUNT
    spread_count = 1_000 if quick else SPREAD_COUNT
    header = "form                         records/s  cpu us/rec  p50 ms  p99 ms  samples"
    print("## merged vs separated (1 node, 1 gateway), 100 B, acks=all")
    print(header)
    with polymq_server("kafka") as server:
        assert server.pid is not None  # started here, not a --target
        row = await asyncio.to_thread(
            _produce_and_latency, server.address, _Cpu([server.pid]), count
        )
        print(f"{'merged (polymq run)':<26} " + "  ".join(row))
    with tempfile.TemporaryDirectory(prefix="polymq-bench-cluster-") as temp:
        cluster = await _cluster(Path(temp), 1, 1)
        try:
            host, port = cluster.address("gateway-1", "kafka")
            row = await asyncio.to_thread(
                _produce_and_latency, f"{host}:{port}", _Cpu(_pids(cluster)), count
            )
            print(f"{'separated (1 node, 1 gw)':<26} " + "  ".join(row))
        finally:
            await cluster.stop()

    print("\n## separated, 2 gateways, six topics, six producers, 100 B, acks=all")
    print("storage nodes   records/s  cpu us/rec (all processes)  rss MiB (all)")
    for nodes in (1, 2, 3):
        with tempfile.TemporaryDirectory(prefix="polymq-bench-cluster-") as temp:
            cluster = await _cluster(Path(temp), nodes, 2)
            try:
                bootstraps = [
                    "{}:{}".format(*cluster.address(f"gateway-{i}", "kafka")) for i in (1, 2)
                ]
                cpu = _Cpu(_pids(cluster))
                before = cpu.seconds()
                delivered, seconds = await asyncio.to_thread(_spread, bootstraps, spread_count)
                used = cpu.seconds() - before
                print(
                    f"{nodes:>13}  {delivered / seconds:>10,.0f}  "
                    f"{used / max(delivered, 1) * 1e6:>26.1f}  {cpu.rss_mib():>13.0f}"
                )
            finally:
                await cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts, a smoke run")
    args = parser.parse_args()
    asyncio.run(main_async(args.quick))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
