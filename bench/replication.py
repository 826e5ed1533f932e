"""What replication costs: the same clients, in one run, against four forms.

1. merged, local log (``polymq run`` over a temporary data dir);
2. merged over the replicated log (``polymq run --storage nats://…?replicas=3``,
   three local NATS servers);
3. separated, ``--replicas 1`` (nameserver, navigation, one storage node, one gateway);
4. separated, ``--replicas 3`` (three NATS servers, three storage processes each
   preferring one of three shards, one gateway).

Kafka (confluent-kafka, 1 KiB records, acks=all): produce records/s and MB/s (linger
5 ms), then the same records consumed, and end-to-end latency p50/p99 at a paced
1,000 records/s with linger 0. AMQP (pika, 1 KiB): confirmed publishes/s, one at a time,
on a durable queue with persistent messages, then consumed, and end-to-end latency
p50/p99 at a paced 1,000 msgs/s. Server CPU per message is that of every process of the
form (polymq and nats-server) read with psutil. Ratios are against the merged form over
its local log. Then the takeover time in form 4 (bench/replication_takeover.py).

The measurement loops are bench/kafka.py's and bench/amqp.py's, called as they are.

    .venv/bin/python -m bench.replication            # 6-12 minutes on 2 busy cores
    .venv/bin/python -m bench.replication --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import confluent_kafka
import pika
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench import amqp as amqp_bench
from bench import kafka as kafka_bench
from bench.replication_forms import FORMS, Cpu, Form, running
from bench.replication_takeover import Takeovers, measure_takeovers

SIZE = 1024
LATENCY_RATE = 1_000
TAKEOVER_FORM = "separated-r3"
KAFKA_LINGERS = (0, 5)  # the latency case as asked (0), and bench/kafka.py's producer (5)


def _counts(quick: bool) -> dict[str, float]:
    if quick:
        return {"kafka": 1_000, "amqp": 200, "latency_s": 0.5, "limit_s": 15.0}
    return {"kafka": 30_000, "amqp": 2_000, "latency_s": 3.0, "limit_s": 20.0}


@contextlib.contextmanager
def _linger(ms: int) -> Iterator[None]:
    """bench/kafka.py's latency loop with a producer lingering ``ms`` (its own: 5)."""
    original = kafka_bench._producer

    def producer(bootstrap: str) -> Producer:
        return Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": ms})

    kafka_bench._producer = producer
    try:
        yield
    finally:
        kafka_bench._producer = original


def _per_msg_us(cpu: Cpu, before: float, count: int) -> float:
    return (cpu.seconds() - before) / max(count, 1) * 1e6


def _latency(
    cpu: Cpu, latency_s: float, measure: Callable[[], tuple[float, float, int]]
) -> dict[str, Any]:
    before = cpu.seconds()
    p50, p99, samples = measure()
    return {
        "sent": int(LATENCY_RATE * latency_s),
        "received": samples,
        "p50_ms": p50,
        "p99_ms": p99,
        "cpu_us_per_msg": _per_msg_us(cpu, before, samples),
    }


def kafka_figures(form: Form, count: int, latency_s: float) -> dict[str, Any]:
    host, port = form.address("kafka")
    bootstrap = f"{host}:{port}"
    topic = f"repl-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the result
    admin.create_topics([NewTopic(topic, 1)])[topic].result(30)
    cpu = form.cpu()
    before = cpu.seconds()
    acked, seconds = kafka_bench.produce(bootstrap, topic, SIZE, count)
    produce_us = _per_msg_us(cpu, before, acked)
    consumed, _ = kafka_bench.consume(bootstrap, topic, acked)
    kafka_bench.LATENCY_RATE = LATENCY_RATE
    kafka_bench.LATENCY_SECONDS = latency_s
    latency = {}
    for linger in KAFKA_LINGERS:
        with _linger(linger):
            latency[f"linger {linger} ms"] = _latency(
                cpu,
                latency_s,
                partial(kafka_bench.latency, bootstrap, f"{topic}-lat{linger}", SIZE),
            )
    return {
        "acked": acked,
        "consumed": consumed,
        "per_s": acked / seconds if seconds else 0.0,
        "mb_per_s": acked * SIZE / seconds / 1e6 if seconds else 0.0,
        "cpu_us_per_msg": produce_us,
        "latency": latency,
    }


def amqp_figures(form: Form, count: int, latency_s: float) -> dict[str, Any]:
    host, port = form.address("amqp")
    queue = f"repl-{uuid.uuid4().hex[:8]}"
    cpu = form.cpu()
    before = cpu.seconds()
    acked, seconds = amqp_bench.publish(host, port, queue, SIZE, count, True)
    publish_us = _per_msg_us(cpu, before, acked)
    consumed, _ = amqp_bench.consume(host, port, queue, acked)
    amqp_bench.LATENCY_RATE = LATENCY_RATE
    amqp_bench.LATENCY_SECONDS = latency_s
    measure = partial(amqp_bench.latency, host, port, f"{queue}-lat", SIZE)
    return {
        "acked": acked,
        "consumed": consumed,
        "per_s": acked / seconds if seconds else 0.0,
        "mb_per_s": acked * SIZE / seconds / 1e6 if seconds else 0.0,
        "cpu_us_per_msg": publish_us,
        "latency": {"no confirms": _latency(cpu, latency_s, measure)},
    }


def disk_fsyncs_per_s(directory: Path, count: int = 50) -> float:
    """What the disk under the forms allows: 1 KiB write + fdatasync, one at a time.
    Every form that acknowledges after a local fsync is bounded by it."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(count):
            os.write(fd, b"x" * SIZE)
            os.fdatasync(fd)
        return count / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


_TITLES = {
    "kafka": "Kafka (confluent-kafka {version}), 1 KiB records, acks=all, produce linger 5 ms",
    "amqp": "AMQP (pika {version}), 1 KiB, durable queue, persistent, confirms one at a time",
}
_HEADER = f"{'form':<29} {'msgs/s':>8} {'MB/s':>6} {'cpu us/msg':>10} {'acked':>7} {'consumed':>8}"
_LATENCY_HEADER = (
    f"{'form':<29} {'case':<12} {'sent':>6} {'recvd':>6} {'p50 ms':>8} {'p99 ms':>8}"
    f" {'cpu us/msg':>10}"
)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "n/a"


def print_tables(figures: dict[str, dict[str, dict[str, Any]]]) -> None:
    versions = {"kafka": confluent_kafka.version()[0], "amqp": pika.__version__}
    for protocol, title in _TITLES.items():
        rows = {key: forms[protocol] for key, forms in figures.items() if protocol in forms}
        if not rows:
            continue
        print(f"\n## {title.format(version=versions[protocol])}")
        print(_HEADER)
        for key, f in rows.items():
            print(
                f"{FORMS[key]:<29} {f['per_s']:>8,.0f} {f['mb_per_s']:>6.1f}"
                f" {f['cpu_us_per_msg']:>10.0f} {f['acked']:>7} {f['consumed']:>8}"
            )
        print(f"end-to-end latency at a paced {LATENCY_RATE:,}/s")
        print(_LATENCY_HEADER)
        for key, f in rows.items():
            for case, lat in f["latency"].items():
                print(
                    f"{FORMS[key]:<29} {case:<12} {lat['sent']:>6} {lat['received']:>6}"
                    f" {lat['p50_ms']:>8.2f} {lat['p99_ms']:>8.2f} {lat['cpu_us_per_msg']:>10.0f}"
                )
        base = rows.get("merged")
        if base is None:
            continue
        cases = list(base["latency"])
        print(f"ratios to {FORMS['merged']}")
        print(
            f"{'form':<29} {'msgs/s':>7} {'cpu/msg':>7}"
            + "".join(f" {'p50 ' + c:>17} {'p99':>6}" for c in cases)
        )
        for key, f in rows.items():
            line = (
                f"{FORMS[key]:<29} {_ratio(f['per_s'], base['per_s']):>7}"
                f" {_ratio(f['cpu_us_per_msg'], base['cpu_us_per_msg']):>7}"
            )
            for c in cases:
                mine, theirs = f["latency"][c], base["latency"][c]
                line += f" {_ratio(mine['p50_ms'], theirs['p50_ms']):>17}"
                line += f" {_ratio(mine['p99_ms'], theirs['p99_ms']):>6}"
            print(line)
    sys.stdout.flush()


def print_takeovers(t: Takeovers) -> None:
    print(f"\n## takeover, {FORMS[TAKEOVER_FORM]}: MNS sends (httpx) at {t.rate}/s")
    print("SIGKILL the storage process serving the queue's shard, restart it, wait for the")
    print("hand-back; takeover: from the kill to the first acknowledged send after it")
    print(f"{'kills':>5} {'median s':>9} {'max s':>7} {'hand-back median s':>19} {'max s':>7}")
    if t.takeover_s:
        print(
            f"{len(t.takeover_s):>5} {statistics.median(t.takeover_s):>9.2f}"
            f" {max(t.takeover_s):>7.2f} {statistics.median(t.handback_s or [0.0]):>19.2f}"
            f" {max(t.handback_s or [0.0]):>7.2f}"
        )
    print("each takeover s: " + ", ".join(f"{s:.2f}" for s in t.takeover_s))
    if t.away:
        print("killed away from its preferred shard (no hand-back): " + ", ".join(t.away))
    print(
        f"acknowledged {t.acknowledged}, failed (not acknowledged) {t.failed},"
        f" in the queue at the end {t.received}, acknowledged and lost {t.lost}"
    )
    sys.stdout.flush()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    counts = _counts(args.quick)
    kafka_bench.SCENARIO_LIMIT_S = amqp_bench.SCENARIO_LIMIT_S = counts["limit_s"]
    forms = [key.strip() for key in args.forms.split(",") if key.strip()]
    unknown = [key for key in forms if key not in FORMS]
    if unknown:
        raise SystemExit(f"unknown forms {unknown}; known: {', '.join(FORMS)}")
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    takeovers: Takeovers | None = None
    started = time.monotonic()
    fsyncs = disk_fsyncs_per_s(Path(tempfile.gettempdir()))
    print(f"# disk: {fsyncs:,.0f} x (1 KiB write + fdatasync)/s in {tempfile.gettempdir()}")
    print(f"# NATS servers' fsync: {args.nats_sync} (--nats-sync)")
    for key in forms:
        with tempfile.TemporaryDirectory(prefix="polymq-bench-repl-") as temp:
            up = time.monotonic()
            sync = args.nats_sync == "always"
            async with running(key, Path(temp), nats_sync_always=sync) as form:
                print(f"# {form.label}: up in {time.monotonic() - up:.0f} s", flush=True)
                figures[key] = {
                    "kafka": await asyncio.to_thread(
                        kafka_figures, form, int(counts["kafka"]), counts["latency_s"]
                    ),
                    "amqp": await asyncio.to_thread(
                        amqp_figures, form, int(counts["amqp"]), counts["latency_s"]
                    ),
                }
                if key == TAKEOVER_FORM and args.kills > 0:
                    takeovers = await measure_takeovers(
                        form, args.kills, args.rate, 1.0 if args.quick else 3.0
                    )
    print_tables(figures)
    if takeovers is not None:
        print_takeovers(takeovers)
    print(f"\n(whole run {time.monotonic() - started:.0f} s)")
    return {
        "meta": {
            "size": SIZE,
            "latency_rate": LATENCY_RATE,
            "quick": args.quick,
            "counts": counts,
            "forms": {key: FORMS[key] for key in forms},
            "disk_fsyncs_per_s": fsyncs,
            "nats_sync": args.nats_sync,
        },
        "figures": figures,
        "takeover": None if takeovers is None else asdict(takeovers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts, a smoke run")
    parser.add_argument(
        "--forms", default=",".join(FORMS), help=f"which forms, in order [{','.join(FORMS)}]"
    )
    parser.add_argument("--kills", type=int, default=5, help="takeover kills (0: none) [5]")
    parser.add_argument("--rate", type=int, default=100, help="takeover sends/s [100]")
    parser.add_argument(
        "--nats-sync",
        choices=("default", "always"),
        default="default",
        help="always: the NATS servers fsync every write [default: JetStream's interval]",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
