"""The kill-loop chaos bench: the separated form under real clients of every protocol
while a random storage node or gateway is SIGKILLed every few seconds and restarted,
then a checker compares what producers were promised with what consumers got.

Every process is real (``gateway.cluster_tool.LocalCluster``, free ports, short
heartbeats and expiries as in ``tests/cluster/fast_failure.py``). Each protocol runs
producers and consumers with its own client library, each in its own thread, at a
modest paced rate; every message carries a unique id (producer, sequence). At the end
the producers stop, the consumers drain (bounded), and per protocol the table gives
acknowledged, delivered, lost (acknowledged, never delivered), redeliveries, stored
duplicates (Kafka: one id at two offsets), reordered, the longest outage (longest gap
between acknowledgements) and the kill before it. Exit code 1 if anything
acknowledged was lost, 2 if the run itself could not be made.

    .venv/bin/python -m bench.chaos                          # 100 kills, 3-6 s apart
    .venv/bin/python -m bench.chaos --kills 100 --interval 2-4 --json chaos.json
    .venv/bin/python -m bench.chaos --kills 3 --interval 1-2 --protocols kafka,amqp
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import chaos_amqp, chaos_kafka, chaos_mns, chaos_mqtt, chaos_rocketmq
from bench.chaos_checker import Figures, check
from bench.chaos_client import Context, Worker, join_all
from bench.chaos_history import History
from bench.chaos_killer import Kill, KillPlan, Span, kill_loop, victims
from bench.chaos_ports import fixed_ports
from bench.chaos_report import print_report, write_histories, write_json
from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, layout
from polymq.gateway.config import ENV_PREFIX

log = logging.getLogger("bench.chaos")
_AUDIT_CAP_S = 600.0

# As tests/cluster/fast_failure.py: a death is noticed within seconds.
_FAST_FAILURE = {
    "CLUSTER__HEARTBEAT_MS": "200",
    "NAVIGATION__GATEWAY_EXPIRY_MS": "2000",
    "NAMESERVER__NODE_EXPIRY_MS": "2000",
}


@dataclass(frozen=True, slots=True)
class Protocol:
    """One protocol's clients: the listener they use, what to create first, and
    whether producers must wait for the consumer's subscription (MQTT's persistent
    session and RocketMQ's group keep only what arrives after it)."""

    listener: str
    workers: Callable[[Context], list[Worker]]
    setup: Callable[[Context], None] | None = None
    waits_for_subscriber: bool = False
    audit: Callable[[Context], None] | None = None  # a re-read of all that is stored


PROTOCOLS = {
    "kafka": Protocol("kafka", chaos_kafka.workers, chaos_kafka.setup, audit=chaos_kafka.audit),
    "amqp": Protocol("amqp", chaos_amqp.workers),
    "mqtt": Protocol("mqtt", chaos_mqtt.workers, waits_for_subscriber=True),
    "rocketmq": Protocol("rocketmq", chaos_rocketmq.workers, waits_for_subscriber=True),
    "mns": Protocol("http", chaos_mns.workers),
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + k: v for k, v in _FAST_FAILURE.items()})
    return env


def _layout(args: argparse.Namespace, data_dir: Path) -> list[ProcessSpec]:
    """``replicas`` goes to ``layout()`` only when asked for, so an unreplicated run
    works today and ``--replicas 3`` fails clearly until the layout knows it."""
    extra: dict[str, Any] = {} if args.replicas == 1 else {"replicas": args.replicas}
    specs = layout(
        storage=args.storage,
        gateways=args.gateways,
        data_dir=data_dir,
        port_offset=None,
        **extra,
    )
    return fixed_ports(specs)


def _gateways(cluster: LocalCluster) -> dict[str, tuple[tuple[str, int], ...]]:
    names = [n for n in cluster.children if n.startswith("gateway-")]
    listeners = {p.listener for p in PROTOCOLS.values()}
    return {lst: tuple(cluster.address(n, lst) for n in names) for lst in listeners}


class _Run:
    """The clients of every chosen protocol and their histories."""

    def __init__(self, args: argparse.Namespace, cluster: LocalCluster) -> None:
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        run_id = uuid.uuid4().hex[:6]
        gateways = _gateways(cluster)
        self.histories: dict[str, History] = {}
        self.producers: list[Worker] = []
        self.consumers: list[Worker] = []
        self.contexts: list[tuple[Protocol, Context]] = []
        for name in args.protocols:
            protocol = PROTOCOLS[name]
            history = History(name)
            self.histories[name] = history
            subscribed = threading.Event()
            if not protocol.waits_for_subscriber:
                subscribed.set()
            self.contexts.append(
                (
                    protocol,
                    Context(
                        run=run_id,
                        protocol=name,
                        gateways=gateways,
                        rate=args.rate,
                        producers=args.producers,
                        history=history,
                        stop_producing=self.stop_producing,
                        stop_consuming=self.stop_consuming,
                        subscribed=subscribed,
                    ),
                )
            )

    def start(self) -> None:
        for protocol, context in self.contexts:
            if protocol.setup is not None:
                protocol.setup(context)
            for worker in protocol.workers(context):
                side = self.producers if "-producer" in worker.name else self.consumers
                side.append(worker)
                worker.start()

    def warmed_up(self) -> list[str]:
        """The protocols that have not yet had one acknowledgement and one delivery."""
        return [name for name, h in self.histories.items() if not (h.acked and h.deliveries)]

    def drained(self) -> bool:
        return not any(h.missing() for h in self.histories.values())

    def status(self) -> str:
        return "  ".join(
            f"{name} {len(h.acked)}/{len(h.deliveries)}" for name, h in self.histories.items()
        )

    def audit(self, seconds: float) -> None:
        """After the consumers stopped: Kafka re-reads every partition; the others get
        a fresh consumer (same queue, group or session) for what is still queued, if
        anything acknowledged is missing, until it is found or ``seconds`` pass (long
        enough for a dead gateway's leases to run out). All protocols at once."""
        threads = []
        for protocol, context in self.contexts:
            if protocol.audit is not None:
                threads.append(threading.Thread(target=protocol.audit, args=(context,)))
            elif context.history.missing():
                threads.append(
                    threading.Thread(target=_fresh_consumers, args=(protocol, context, seconds))
                )
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def mark_stuck(self, workers: Sequence[Worker]) -> None:
        for worker in workers:
            worker.history.on_stuck(f"{worker.name} still in a client call at the end")


def _fresh_consumers(protocol: Protocol, context: Context, seconds: float) -> None:
    found = History(context.protocol)
    stop = threading.Event()
    fresh = dataclasses.replace(
        context, history=found, stop_consuming=stop, subscribed=threading.Event()
    )
    missing = context.history.missing()
    workers = [w for w in protocol.workers(fresh) if "-consumer" in w.name]
    for worker in workers:
        worker.start()
    # Until all is found, or nothing new came for ``seconds`` (a backlog is read to
    # its end however long it is, up to a cap).
    cap, quiet_since, count = time.monotonic() + _AUDIT_CAP_S, time.monotonic(), 0
    while not missing <= found.delivered_ids() and time.monotonic() < cap:
        if len(found.deliveries) != count:
            count, quiet_since = len(found.deliveries), time.monotonic()
        elif time.monotonic() - quiet_since > seconds:
            break
        time.sleep(0.2)
    stop.set()
    for worker in join_all(workers, 20.0):
        context.history.on_stuck(f"audit {worker.name} still in a client call at the end")
    context.history.record_audit(found.snapshot()[1])


async def _until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def _progress(run: _Run, kills: list[Kill], every: float) -> None:
    while True:
        await asyncio.sleep(every)
        print(f"  [{len(kills)} kills] acked/delivered: {run.status()}", file=sys.stderr)


async def _chaos(args: argparse.Namespace, cluster: LocalCluster) -> int:
    origin = time.monotonic()
    try:
        victims(cluster, args.roles)  # a role this layout lacks fails now, not mid-run
    except ValueError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 2
    await cluster.start()
    print(f"cluster up: {', '.join(cluster.children)}", file=sys.stderr)
    run = _Run(args, cluster)
    await asyncio.to_thread(run.start)
    if not await _until(lambda: not run.warmed_up(), args.warmup_seconds):
        print(f"chaos: no traffic from {run.warmed_up()} before the kills", file=sys.stderr)
        return 2
    print(f"clients running ({run.status()}); killing", file=sys.stderr)
    kills: list[Kill] = []
    plan = KillPlan(tuple(args.roles), args.kills, args.seconds, args.interval, args.downtime)
    progress = asyncio.create_task(_progress(run, kills, 15.0))
    begin = time.monotonic()
    failed: str | None = None
    try:
        await kill_loop(cluster, plan, random.Random(args.seed), kills, Counter())
    except RuntimeError as e:  # a process that would not come back: report what we have
        failed = str(e)
        print(f"chaos: {failed}", file=sys.stderr)
    end = time.monotonic()
    run.stop_producing.set()
    run.mark_stuck(await asyncio.to_thread(join_all, run.producers, 45.0))
    print(f"producers stopped; draining ({run.status()})", file=sys.stderr)
    await _until(run.drained, args.drain_seconds)
    run.stop_consuming.set()
    run.mark_stuck(await asyncio.to_thread(join_all, run.consumers, 20.0))
    await asyncio.to_thread(run.audit, args.audit_seconds)
    progress.cancel()
    figures: list[Figures] = [
        check(h, kills, begin=begin, end=end, origin=origin) for h in run.histories.values()
    ]
    print_report(figures, kills, end - begin)
    if args.json is not None:
        meta = {
            "storage": args.storage,
            "gateways": args.gateways,
            "replicas": args.replicas,
            "roles": list(args.roles),
            "rate": args.rate,
            "producers": args.producers,
            "interval": str(args.interval),
            "downtime": str(args.downtime),
            "seed": args.seed,
            "seconds": round(end - begin, 1),
            "aborted": failed,
        }
        write_json(args.json, figures, kills, meta)
    if args.histories is not None:
        write_histories(args.histories, list(run.histories.values()), kills, origin)
    if failed is not None:
        return 2
    return 1 if any(f.lost for f in figures) else 0


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="polymq-chaos-") as temp:
        data_dir = Path(args.data_dir or temp)
        try:
            specs = _layout(args, data_dir)
        except TypeError as e:
            print(f"chaos: --replicas {args.replicas} is not supported yet: {e}", file=sys.stderr)
            return 2
        cluster = LocalCluster(specs, env=_env(), echo=_logging(args.log_file))
        try:
            return await _chaos(args, cluster)
        finally:
            await cluster.stop()


def _logging(path: Path | None) -> Callable[[str], None] | None:
    """The bench's own errors on stderr; with ``path``, everything the clients and the
    processes log into that file too (client libraries log every refused connection,
    too much for a terminal). Returns the processes' echo."""
    stderr = logging.StreamHandler()
    stderr.setLevel(logging.ERROR)
    stderr.addFilter(lambda r: r.name == "bench.chaos")
    root = logging.getLogger()
    root.addHandler(stderr)
    root.setLevel(logging.INFO)
    if path is None:
        return None
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
    root.addHandler(handler)
    cluster_log = logging.getLogger("cluster")
    return lambda line: cluster_log.info(line)


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {unknown} (known: {list(choices)})")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--storage", type=int, default=3, help="storage nodes [3]")
    parser.add_argument("--gateways", type=int, default=2, help="gateways [2]")
    parser.add_argument("--replicas", type=int, default=1, help="passed to layout() if not 1")
    parser.add_argument("--kills", type=int, default=100, help="kill cycles [100]")
    parser.add_argument("--seconds", type=float, help="or stop killing after this long")
    parser.add_argument(
        "--interval", type=Span.parse, default=Span(3, 6), help="restart to next kill [3-6]"
    )
    parser.add_argument(
        "--downtime", type=Span.parse, default=Span(1, 3), help="kill to restart [1-3]"
    )
    parser.add_argument(
        "--roles",
        type=_names(("storage", "gateway", "nameserver", "navigation", "nats")),
        default=["storage", "gateway"],
        help="what may be killed [storage,gateway]",
    )
    parser.add_argument(
        "--protocols", type=_names(tuple(PROTOCOLS)), default=list(PROTOCOLS), help="[all]"
    )
    parser.add_argument("--rate", type=float, default=25.0, help="msgs/s per producer [25]")
    parser.add_argument("--producers", type=int, default=1, help="per protocol [1]")
    parser.add_argument("--warmup-seconds", type=float, default=90.0)
    parser.add_argument("--drain-seconds", type=float, default=60.0)
    parser.add_argument(
        "--audit-seconds",
        type=float,
        default=40.0,
        help="a fresh consumer looks for what is missing until this long without news [40]",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, help="write the figures there")
    parser.add_argument("--histories", type=Path, help="every ack and delivery, JSON lines")
    parser.add_argument("--log-file", type=Path, help="clients' and processes' logs")
    parser.add_argument("--data-dir", type=Path, help="keep the nodes' data there")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return args


def main() -> None:
    args = parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
