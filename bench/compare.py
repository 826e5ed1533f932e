"""polymq beside the reference brokers, in one run: issue 21's table, re-measured.

The same Python clients (pika, paho-mqtt) run the same cases against polymq and
against RabbitMQ (AMQP) or Mosquitto (MQTT), every broker started here on free
loopback ports over a throwaway directory (``bench/_server.py``, ``bench/_reference.py``)
and stopped at the end. The machine is shared and noisy, so the two sides of a case
run back to back, the one going first alternating from case to case and round to
round, and the table shows the median of ``--runs`` rounds (3 by default) with
polymq / reference ratios: above 1 is more messages per second, or more milliseconds
or CPU per message, than the reference. Server CPU is the broker process's time on a
CPU (all its threads, ``bench/_cpu.py``) over the case, per message it carried.

    make bench-compare                              # installs the brokers if missing
    .venv/bin/python -m bench.compare               # about 5 minutes on 2 busy cores
    .venv/bin/python -m bench.compare --quick       # smoke run: small counts, 1 round
    .venv/bin/python -m bench.compare --protocols mqtt --json out.json

The cases are the loops of ``bench/latency.py`` (a paced 1,000 msgs/s, 100 B,
send-to-receive p50/p99), ``bench/amqp.py`` and ``bench/mqtt.py``, called as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import paho.mqtt
import pika

from bench import amqp as amqp_bench
from bench import latency as latency_bench
from bench import mqtt as mqtt_bench
from bench._cpu import CpuSpan
from bench._reference import (
    mosquitto_installed,
    mosquitto_server,
    rabbitmq_installed,
    rabbitmq_server,
)
from bench._server import Server, polymq_server
from polymq.gateway.progress import Progress

__all__ = ["CASES", "Case", "Counts", "Figures", "main", "table_rows"]

PROTOCOLS = ("amqp", "mqtt")
REFERENCE = {"amqp": "RabbitMQ", "mqtt": "Mosquitto"}
TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class Counts:
    """How much each case does: the full run, or ``--quick``'s smoke sizes."""

    latency_s: float = 5.0
    publish: int = 20_000
    confirms: int = 3_000
    consume: int = 20_000
    mqtt_qos0: int = 20_000
    mqtt_qos1: int = 10_000
    fan_in_each: int = 2_500
    mqtt_4k: int = 20_000


QUICK = Counts(
    latency_s=0.3,
    publish=500,
    confirms=100,
    consume=500,
    mqtt_qos0=500,
    mqtt_qos1=200,
    fan_in_each=50,
    mqtt_4k=300,
)


@dataclass
class Figures:
    """What one run of a case measured on one broker. A throughput case fills
    ``msgs_per_s``, a latency case ``p50_ms``/``p99_ms``; both the CPU."""

    msgs: int
    seconds: float
    cpu_s: float
    msgs_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None

    @property
    def cpu_us_per_msg(self) -> float:
        return self.cpu_s / self.msgs * 1e6 if self.msgs else 0.0

    @property
    def cpu_pct(self) -> float:
        return self.cpu_s / self.seconds * 100 if self.seconds else 0.0


class Outcome(NamedTuple):
    """What a case's loop returns: messages and seconds, p50/p99 for a latency case,
    and the server CPU seconds when the loop measured them itself (over part of what
    it did); otherwise the CPU is read around the whole call."""

    msgs: int
    seconds: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_s: float | None = None


@dataclass(frozen=True)
class Case:
    """One measurement, run against polymq and the reference of ``protocol``."""

    key: str
    protocol: str
    run: Callable[[Server, Counts], Outcome]


def _latency(case: str) -> Callable[[Server, Counts], Outcome]:
    def run(server: Server, counts: Counts) -> Outcome:
        start = time.perf_counter()
        result = latency_bench.measure(case, server, counts.latency_s)
        return Outcome(result.received, time.perf_counter() - start, result.p50_ms, result.p99_ms)

    return run


def _throughput(
    body: Callable[[Server, Counts], tuple[int, float]],
) -> Callable[[Server, Counts], Outcome]:
    def run(server: Server, counts: Counts) -> Outcome:
        return Outcome(*body(server, counts))

    return run


def _amqp_publish(
    server: Server, counts: Counts, *, confirms: bool, durable: bool
) -> tuple[int, float]:
    queue = f"cmp-{uuid.uuid4().hex[:8]}"
    count = counts.confirms if confirms else counts.publish
    try:
        return amqp_bench.publish(
            server.host, server.port, queue, 100, count, confirms, durable=durable
        )
    finally:
        amqp_bench.delete_queue(server.host, server.port, queue)


def _amqp_consume(server: Server, counts: Counts) -> Outcome:
    """Fill a durable queue (neither timed nor metered), then consume it with
    prefetch 500 and one ``multiple`` ack per 250 deliveries."""
    queue = f"cmp-{uuid.uuid4().hex[:8]}"
    try:
        amqp_bench.publish(server.host, server.port, queue, 100, counts.consume, False)
        span = CpuSpan(server.pid)
        got, seconds = amqp_bench.consume(
            server.host, server.port, queue, counts.consume, ack_every=amqp_bench.PREFETCH // 2
        )
        return Outcome(got, seconds, cpu_s=span.seconds())
    finally:
        amqp_bench.delete_queue(server.host, server.port, queue)


CASES: tuple[Case, ...] = (
    Case("amqp-latency", "amqp", _latency("amqp")),
    Case("amqp-latency-durable", "amqp", _latency("amqp-durable")),
    Case("mqtt1-latency", "mqtt", _latency("mqtt1")),
    Case(
        "amqp-publish",
        "amqp",
        _throughput(partial(_amqp_publish, confirms=False, durable=True)),
    ),
    Case(
        "amqp-confirm-durable",
        "amqp",
        _throughput(partial(_amqp_publish, confirms=True, durable=True)),
    ),
    Case(
        "amqp-confirm-transient",
        "amqp",
        _throughput(partial(_amqp_publish, confirms=True, durable=False)),
    ),
    Case("amqp-consume", "amqp", _amqp_consume),
    Case(
        "mqtt-qos0",
        "mqtt",
        _throughput(lambda s, c: mqtt_bench.one_to_one(s.host, s.port, 0, c.mqtt_qos0)),
    ),
    Case(
        "mqtt-qos1",
        "mqtt",
        _throughput(lambda s, c: mqtt_bench.one_to_one(s.host, s.port, 1, c.mqtt_qos1)),
    ),
    Case(
        "mqtt-fan-in",
        "mqtt",
        _throughput(lambda s, c: mqtt_bench.fan_in(s.host, s.port, 4, c.fan_in_each, qos=1)),
    ),
    Case(
        "mqtt-qos0-4k",
        "mqtt",
        _throughput(lambda s, c: mqtt_bench.one_to_one(s.host, s.port, 0, c.mqtt_4k, size=4096)),
    ),
)

# The table's rows, in the order: (label, case key, what the row shows).
ROWS: tuple[tuple[str, str, str], ...] = (
    (
        "AMQP end-to-end latency at 1,000 msg/s (pika publisher, consumer acks each), p50 / p99",
        "amqp-latency",
        "latency",
    ),
    ("same, durable queue and persistent messages", "amqp-latency-durable", "latency"),
    ("server CPU at that 1,000 msg/s (transient AMQP)", "amqp-latency", "cpu"),
    ("MQTT QoS 1 latency at 1,000 msg/s, p50 / p99", "mqtt1-latency", "latency"),
    ("server CPU at that rate", "mqtt1-latency", "cpu"),
    ("AMQP publish, no confirms", "amqp-publish", "rate"),
    ("AMQP publish with a confirm each, persistent, durable queue", "amqp-confirm-durable", "rate"),
    (
        "AMQP publish with a confirm each, transient messages, transient queue",
        "amqp-confirm-transient",
        "rate",
    ),
    ("AMQP consume, prefetch 500, ack multiple", "amqp-consume", "rate"),
    ("MQTT QoS 0 publish", "mqtt-qos0", "rate"),
    ("MQTT QoS 1 publish", "mqtt-qos1", "rate"),
    ("MQTT fan-in 4→1, QoS 1", "mqtt-fan-in", "rate"),
    ("MQTT QoS 0 publish, 4 KiB", "mqtt-qos0-4k", "rate"),
)


def _measure(case: Case, server: Server, counts: Counts) -> Figures:
    span = CpuSpan(server.pid)
    out = case.run(server, counts)
    used = span.seconds() if out.cpu_s is None else out.cpu_s
    return Figures(
        msgs=out.msgs,
        seconds=out.seconds,
        cpu_s=used,
        msgs_per_s=out.msgs / out.seconds if out.p50_ms is None and out.seconds else None,
        p50_ms=out.p50_ms,
        p99_ms=out.p99_ms,
    )


@dataclass
class Results:
    """Every run's figures, by case key and side (``polymq`` or ``reference``)."""

    runs: dict[tuple[str, str], list[Figures]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    pids: dict[str, int | None] = field(default_factory=dict)
    """The brokers measured, by label (for a check that none outlived the run)."""

    def add(self, key: str, side: str, figures: Figures) -> None:
        self.runs.setdefault((key, side), []).append(figures)

    def median(self, key: str, side: str, attr: str) -> float | None:
        values = [getattr(f, attr) for f in self.runs.get((key, side), [])]
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None


def _rate(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1000:.1f}k/s" if value >= 1000 else f"{value:.0f}/s"


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    if a is None or b is None or not b:
        return "n/a"
    return f"{a / b:.{digits}f}{TIMES}"


def table_rows(results: Results, protocols: Sequence[str]) -> list[dict[str, str]]:
    """The table as cells: case, polymq, reference, ratio, CPU µs/msg both sides and
    their ratio. Only rows of ``protocols``."""
    protocol_of = {c.key: c.protocol for c in CASES}
    rows = []
    for label, key, shows in ROWS:
        protocol = protocol_of[key]
        if protocol not in protocols:
            continue
        name = REFERENCE[protocol]

        def med(side: str, attr: str, key: str = key) -> float | None:
            return results.median(key, side, attr)

        cpu = {side: med(side, "cpu_us_per_msg") for side in ("polymq", "reference")}
        if shows == "latency":
            cells = {
                side: "n/a"
                if med(side, "p50_ms") is None
                else f"{med(side, 'p50_ms'):.2f} / {med(side, 'p99_ms'):.2f} ms"
                for side in ("polymq", "reference")
            }
            ratio = (
                f"{_ratio(med('polymq', 'p50_ms'), med('reference', 'p50_ms'), 1)} / "
                f"{_ratio(med('polymq', 'p99_ms'), med('reference', 'p99_ms'), 1)}"
            )
        elif shows == "cpu":
            cells = {
                side: "n/a"
                if cpu[side] is None
                else f"{med(side, 'cpu_pct'):.0f} % of a core ({cpu[side]:.0f} µs/msg)"
                for side in ("polymq", "reference")
            }
            ratio = _ratio(cpu["polymq"], cpu["reference"], 1)
        else:
            cells = {side: _rate(med(side, "msgs_per_s")) for side in ("polymq", "reference")}
            ratio = _ratio(med("polymq", "msgs_per_s"), med("reference", "msgs_per_s"))
        rows.append(
            {
                "case": label,
                "key": key,
                "polymq": cells["polymq"],
                "reference": f"{name} {cells['reference']}",
                "ratio": ratio,
                "polymq_cpu_us": "n/a" if cpu["polymq"] is None else f"{cpu['polymq']:.0f}",
                "reference_cpu_us": "n/a"
                if cpu["reference"] is None
                else f"{cpu['reference']:.0f}",
                "cpu_ratio": _ratio(cpu["polymq"], cpu["reference"], 1),
            }
        )
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    lines = [
        "| case (100 B unless said) | polymq | reference | ratio | polymq CPU µs/msg"
        " | reference CPU µs/msg | CPU ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['polymq']} | {r['reference']} | {r['ratio']}"
            f" | {r['polymq_cpu_us']} | {r['reference_cpu_us']} | {r['cpu_ratio']} |"
        )
    return "\n".join(lines)


def _sample_line(key: str, side: str, label: str, f: Figures) -> str:
    if f.p50_ms is not None:
        what = f"p50 {f.p50_ms:.2f} ms p99 {f.p99_ms or 0:.2f} ms"
    else:
        what = f"{f.msgs_per_s or 0:.0f} msgs/s"
    return (
        f"# {key:<24} {side:<9} {label:<9} {f.msgs:>6} msgs {what:<28}"
        f" cpu {f.cpu_us_per_msg:.0f} us/msg ({f.cpu_pct:.0f} %)"
    )


def _package_version(name: str) -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", name],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "?"
    return out.stdout.strip() or "?"


@contextlib.contextmanager
def _brokers(protocols: Sequence[str]) -> Iterator[dict[str, dict[str, Server]]]:
    """Per protocol, polymq (only that listener on, fsync by default as shipped)
    and the reference, all running until the block ends."""
    start = {
        "amqp": (partial(polymq_server, "amqp"), rabbitmq_server),
        "mqtt": (partial(polymq_server, "mqtt"), mosquitto_server),
    }
    with contextlib.ExitStack() as stack:
        servers = {}
        for protocol in protocols:
            ours, theirs = start[protocol]
            servers[protocol] = {
                "polymq": stack.enter_context(ours()),
                "reference": stack.enter_context(theirs()),
            }
        yield servers


def run(
    protocols: Sequence[str], runs: int, counts: Counts, *, stream: Any = sys.stdout
) -> Results:
    """Every case of ``protocols`` against both sides, ``runs`` rounds, alternating."""
    cases = [c for c in CASES if c.protocol in protocols]
    results = Results()
    with (
        _brokers(protocols) as servers,
        Progress(runs * len(cases) * 2, "bench.compare") as progress,
    ):
        for protocol, by_side in servers.items():
            for server in by_side.values():
                results.pids[f"{protocol} {server.label}"] = server.pid
        for round_ in range(runs):
            for index, case in enumerate(cases):
                sides = ["polymq", "reference"]
                if (round_ + index) % 2:
                    sides.reverse()
                for side in sides:
                    server = servers[case.protocol][side]
                    progress.step(f"round {round_ + 1}/{runs}: {case.key} on {server.label}")
                    try:
                        figures = _measure(case, server, counts)
                    except Exception as e:  # one failed run leaves a gap, not a lost run
                        message = f"{case.key} on {server.label}: {type(e).__name__}: {e}"
                        results.errors.append(message)
                        progress.note(f"# error: {message}")
                        traceback.print_exc(file=sys.stderr)
                        continue
                    results.add(case.key, side, figures)
                    print(_sample_line(case.key, side, server.label, figures), file=stream)
                    stream.flush()
    return results


def _polymq_source() -> str:
    """Which polymq is measured: the checkout's commit, and whether its product code
    has uncommitted changes (another engineer's edits in a shared checkout), or the
    directory it was imported from when that is not this checkout (a snapshot put
    first on PYTHONPATH)."""
    module = sys.modules[Progress.__module__].__file__  # <polymq>/gateway/progress.py
    where = Path(module or ".").resolve().parents[1]
    root = Path(__file__).resolve().parents[1]
    if where != root:
        return f"polymq from {where}"
    git = ["git", "-C", str(root)]
    try:
        rev = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench", ":!docs"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"polymq from {where}"
    return f"polymq {rev or '?'}{' with uncommitted changes' if dirty else ''}"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts and 1 round: smoke")
    parser.add_argument("--runs", type=int, help="rounds, the median shown (default 3; quick 1)")
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="amqp (RabbitMQ), mqtt (Mosquitto)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures")
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        parser.error(f"--protocols: known are {','.join(PROTOCOLS)}")
    missing = [
        name
        for protocol, name, installed in (
            ("amqp", "rabbitmq-server", rabbitmq_installed),
            ("mqtt", "mosquitto", mosquitto_installed),
        )
        if protocol in protocols and not installed()
    ]
    if missing:
        print(
            f"not installed: {' '.join(missing)} (make bench-compare installs them)",
            file=sys.stderr,
        )
        return 2
    counts = QUICK if args.quick else Counts()
    runs = args.runs or (1 if args.quick else 3)
    started = datetime.datetime.now(datetime.UTC)
    load_before = _load()
    print(
        f"# bench.compare {started:%Y-%m-%d %H:%M} UTC, {runs} round(s), {os.cpu_count()} cores,"
        f" load average {load_before}; python {platform.python_version()},"
        f" pika {pika.__version__}, paho-mqtt {paho.mqtt.__version__}; {_polymq_source()}",
        flush=True,
    )
    results = run(protocols, runs, counts)
    load_after = _load()
    rows = table_rows(results, protocols)
    versions = {"amqp": "rabbitmq-server", "mqtt": "mosquitto"}
    refs = ", ".join(f"{REFERENCE[p]} {_package_version(versions[p])}" for p in protocols)
    print()
    print(
        f"Medians of {runs} round(s); ratio = polymq / reference (throughput: above 1 is"
        " faster; latency and CPU: above 1 is slower or costlier). "
        f"{refs}. Load average before {load_before}, after {load_after}."
    )
    print()
    print(markdown(rows), flush=True)
    if results.errors:
        print(f"\n{len(results.errors)} run(s) failed:", *results.errors, sep="\n- ")
    if args.json:
        data = {
            "started": started.isoformat(),
            "runs": runs,
            "load_before": load_before,
            "load_after": load_after,
            "references": refs,
            "rows": rows,
            "samples": [
                {"case": key, "side": side, **vars(f)}
                for (key, side), figures in results.runs.items()
                for f in figures
            ],
            "errors": results.errors,
            "pids": results.pids,
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if results.errors else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
