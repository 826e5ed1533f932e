"""``polymq run --workers N``: messages/s and server CPU per message for 1, 2 and N
workers, with the same client load (docs/workers.md).

Each round starts the real server (``python -m polymq.gateway run --workers W`` over
a fresh data directory, every listener on a free port), lets ``--clients`` client
processes (multiprocessing, so the client is as far from the limit as the machine
allows) run one case for ``--seconds``, and reads:

- msgs/s: operations the clients finished inside the window, over the window;
- server CPU per message: user + system time of every process of the server (the
  parent with its engine, and each worker; from /proc through psutil) over the same
  window, divided by the messages; and the parent's alone (with workers: the engine
  and its end of the storage RPC, the one process that does not multiply, so what
  bounds the design on many cores);
- client CPU: the same for the client processes, and how busy the whole machine was
  (server + clients over cores x window): on a small machine the clients share the
  cores, so a figure with the machine near 100 % says the machine, not the server
  design, is the limit.

``--workers 1`` is today's single process (no RPC hop); 2 and more are the parent's
engine behind the storage RPC. Rounds alternate the worker counts (1, 2, N, 1, 2, N,
...) and the medians of ``--rounds`` are printed. ``--merge-appends both`` runs each
count above 1 twice per round, with the workers' appends sent one call each (``off``:
the storage RPC as it was, through ``bench/_unmerged``) and merged while one is out
(``on``, the default: ``storage/remote_appends.py``), side by side. Cases:

- ``mns``: MNS SendMessage over HTTP/1.1 keep-alive (one connection per client);
- ``amqp``: pika publishing to a queue with a confirm per message (one connection
  per client), the broker's whole publish path per message;
- ``kafka``: confluent-kafka produce, acks=all, linger 5 ms, 100-byte records, as fast
  as the client's queue takes them, counted when acknowledged (the C client: cheap on
  the client side; the gateway's work is per request, not per record).

Nothing is asserted: figures vary with the machine and with who else uses it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import psutil

from polymq.storage.replicated.local_nats import free_ports

__all__ = ["main"]

_LISTENERS = ("kafka", "amqp", "mqtt", "mqtt_ws", "rocketmq", "http")
_READY_TIMEOUT_S = 120.0
_BODY = "x" * 100
_UNMERGED = Path(__file__).resolve().parent / "_unmerged"


@dataclass(frozen=True, slots=True)
class Result:
    workers: int
    case: str
    msgs: int
    seconds: float
    server_cpu_s: float
    parent_cpu_s: float  # the parent alone: with workers, the engine and its RPC
    client_cpu_s: float
    merge_appends: bool = True

    @property
    def rate(self) -> float:
        return self.msgs / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.server_cpu_s / max(1, self.msgs) * 1e6

    @property
    def parent_us(self) -> float:
        return self.parent_cpu_s / max(1, self.msgs) * 1e6

    @property
    def machine_busy(self) -> float:
        cores = os.cpu_count() or 1
        return (self.server_cpu_s + self.client_cpu_s) / (cores * self.seconds)


# -- the server ------------------------------------------------------------------------


@contextlib.contextmanager
def server(
    workers: int, durability: str, merge_appends: bool = True
) -> Iterator[tuple[psutil.Process, dict[str, int]]]:
    """``polymq run --workers W`` on free ports until the block ends (SIGTERM).
    ``merge_appends=False``: every process of it starts with ``bench/_unmerged`` first
    on its path, whose ``sitecustomize`` turns the merging of appends off."""
    ports = dict(zip(_LISTENERS, free_ports(len(_LISTENERS)), strict=True))
    with tempfile.TemporaryDirectory(prefix="polymq-workers-bench-") as tmp:
        argv = [sys.executable, "-m", "polymq.gateway", "run", "--workers", str(workers)]
        argv += ["--data-dir", str(Path(tmp) / "data"), "--durability", durability]
        for name, port in ports.items():
            argv += [f"--{name.replace('_', '-')}-port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYMQ_")}
        if not merge_appends:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(_UNMERGED), env.get("PYTHONPATH", "")) if p
            )
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = "polymq.workers: ready (pid" if workers > 1 else "INFO polymq: ready (pid"
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while ready not in log_path.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.05)
            yield psutil.Process(process.pid), ports
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _server_processes(parent: psutil.Process) -> list[psutil.Process]:
    return [parent, *parent.children(recursive=True)]


# -- the clients (each in its own process) -----------------------------------------------


def _mns(ports: dict[str, int], queue: str) -> Callable[[], int]:
    connection = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=30)
    body = json.dumps({"MessageBody": _BODY})
    headers = {"Content-Type": "application/json", "Accept": "application/json"}

    def send() -> int:
        connection.request("POST", f"/queues/{queue}/messages", body, headers)
        response = connection.getresponse()
        response.read()
        if response.status != 201:
            raise RuntimeError(f"SendMessage answered {response.status}")
        return 1

    return send


def _amqp(ports: dict[str, int], queue: str) -> Callable[[], int]:
    import pika

    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", ports["amqp"], heartbeat=0)
    )
    channel = connection.channel()
    channel.confirm_delivery()
    payload = _BODY.encode()

    def publish() -> int:
        channel.basic_publish("", queue, payload)
        return 1

    return publish


def _kafka(ports: dict[str, int], topic: str) -> Callable[[], int]:
    """Records handed to the client 100 at a time, as fast as its queue takes them;
    a call returns how many were acknowledged (acks=all) meanwhile."""
    from confluent_kafka import KafkaError, Message, Producer

    producer = Producer(
        {
            "bootstrap.servers": f"127.0.0.1:{ports['kafka']}",
            "acks": "all",
            "linger.ms": 5,
            "queue.buffering.max.messages": 20_000,
        }
    )
    payload = _BODY.encode()
    acked = [0]

    def delivered(error: KafkaError | None, message: Message) -> None:
        if error is None:
            acked[0] += 1

    def produce() -> int:
        before = acked[0]
        try:
            for _ in range(100):
                producer.produce(topic, payload, on_delivery=delivered)
        except BufferError:
            producer.poll(0.005)
        producer.poll(0)
        return acked[0] - before

    produce()
    producer.flush(30)
    return produce


_CASES: dict[str, Callable[[dict[str, int], str], Callable[[], int]]] = {
    "mns": _mns,
    "amqp": _amqp,
    "kafka": _kafka,
}


def _client(
    case: str,
    ports: dict[str, int],
    target: str,
    start: float,
    end: float,
    out: Connection,
    rate: float = 0.0,
) -> None:
    """Run ``case`` from ``start`` to ``end`` (wall clock), as fast as it goes or at
    ``rate`` messages/s; send the count of operations finished inside the window and
    this process's CPU seconds."""
    operation = _CASES[case](ports, target)
    operation()  # connected and warm before the window opens
    while time.time() < start:
        time.sleep(0.001)
    me = psutil.Process()
    cpu = me.cpu_times()
    done = 0
    while (now := time.time()) < end:
        if rate > 0:  # paced: never ahead of the schedule, catching up when behind
            ahead = start + done / rate - now
            if ahead > 0:
                time.sleep(min(ahead, end - now))
                continue
        done += operation()
    after = me.cpu_times()
    out.send((done, after.user + after.system - cpu.user - cpu.system))
    out.close()


def _prepare(case: str, ports: dict[str, int], target: str) -> None:
    """Create the queue or topic the clients use."""
    if case == "mns":
        connection = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=30)
        connection.request("PUT", f"/queues/{target}")
        connection.getresponse().read()
    elif case == "amqp":
        import pika

        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", ports["amqp"], heartbeat=0)
        )
        connection.channel().queue_declare(target)
        connection.close()
    else:
        from confluent_kafka.admin import AdminClient
        from confluent_kafka.cimpl import NewTopic

        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{ports['kafka']}"})
        for future in admin.create_topics([NewTopic(target, 8, 1)]).values():
            future.result(60)


def run_case(
    workers: int,
    case: str,
    clients: int,
    seconds: float,
    durability: str,
    merge_appends: bool = True,
    rate: float = 0.0,
) -> Result:
    with server(workers, durability, merge_appends) as (parent, ports):
        target = f"bench-{case}"
        _prepare(case, ports, target)
        context = multiprocessing.get_context("spawn")
        start = time.time() + 3.0  # every client connected and warm by then
        end = start + seconds
        pipes, processes = [], []
        for _ in range(clients):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_client,
                args=(case, ports, target, start, end, send, rate / clients),
                daemon=True,
            )
            process.start()
            pipes.append(receive)
            processes.append(process)
        while time.time() < start:
            time.sleep(0.001)
        server_processes = _server_processes(parent)
        cpu_before = _cpu_seconds(server_processes)
        parent_before = _cpu_seconds([parent])
        while time.time() < end:
            time.sleep(0.01)
        cpu_after = _cpu_seconds(server_processes)
        parent_after = _cpu_seconds([parent])
        msgs, client_cpu = 0, 0.0
        for pipe in pipes:
            done, cpu = pipe.recv()
            msgs += done
            client_cpu += cpu
        for process in processes:
            process.join(60)
        return Result(
            workers,
            case,
            msgs,
            seconds,
            cpu_after - cpu_before,
            parent_after - parent_before,
            client_cpu,
            merge_appends,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers",
        default=f"1,2,{os.cpu_count() or 2}",
        help="worker counts, comma-separated [1,2,<cores>]",
    )
    parser.add_argument("--cases", default="mns,amqp,kafka", help="[mns,amqp,kafka]")
    parser.add_argument("--clients", type=int, default=8, help="client processes [8]")
    parser.add_argument("--seconds", type=float, default=8.0, help="window per round [8]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, medians printed [3]")
    parser.add_argument("--durability", choices=("sync", "async"), default="async")
    parser.add_argument(
        "--merge-appends",
        choices=("on", "off", "both"),
        default="on",
        help="the workers' appends merged while one is out (storage/remote_appends.py) [on]",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="messages/s offered by all clients together; 0: as fast as they go [0]. "
        "At one rate CPU per message compares setups whatever the machine's other load",
    )
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    args = parser.parse_args(argv)
    counts = sorted({int(w) for w in args.workers.split(",")})
    cases = [c for c in args.cases.split(",") if c]
    merges = {"on": (True,), "off": (False,), "both": (False, True)}[args.merge_appends]
    # (workers, merged): one process has no storage RPC, so nothing to merge
    setups = [(w, m) for w in counts for m in ((True,) if w == 1 else merges)]
    results: list[Result] = []
    for case in cases:
        for round_ in range(args.rounds):
            for workers, merge in setups:  # alternating: 1, 2, N, 1, 2, N, ...
                result = run_case(
                    workers, case, args.clients, args.seconds, args.durability, merge, args.rate
                )
                results.append(result)
                print(
                    f"  {case} round {round_ + 1} workers {workers}"
                    f"{'' if workers == 1 else ' merged' if merge else ' unmerged'}: "
                    f"{result.rate:,.0f} msgs/s, {result.cpu_us:,.0f} us server CPU/msg, "
                    f"of which the parent {result.parent_us:,.0f}, "
                    f"machine {result.machine_busy:.0%}",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\n{os.cpu_count()} cores, {args.clients} client processes, {args.seconds:g} s "
        f"windows, durability {args.durability}, "
        f"{f'{args.rate:,.0f} msgs/s offered' if args.rate else 'as fast as they go'}, "
        f"medians of {args.rounds}\n"
    )
    print(
        "| case | workers | appends merged | msgs/s | x 1 worker | server CPU us/msg "
        "| of which the parent | client CPU s | machine busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        base = None
        for workers, merge in setups:
            rows = [
                r
                for r in results
                if r.case == case and r.workers == workers and r.merge_appends == merge
            ]
            rate = statistics.median(r.rate for r in rows)
            base = base or rate
            merged = "-" if workers == 1 else "yes" if merge else "no"
            print(
                f"| {case} | {workers} | {merged} | {rate:,.0f} | {rate / base:.2f} | "
                f"{statistics.median(r.cpu_us for r in rows):,.0f} | "
                f"{statistics.median(r.parent_us for r in rows):,.0f} | "
                f"{statistics.median(r.client_cpu_s for r in rows):.1f} | "
                f"{statistics.median(r.machine_busy for r in rows):.0%} |"
            )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "case": r.case,
                        "workers": r.workers,
                        "merge_appends": r.merge_appends,
                        "msgs": r.msgs,
                        "seconds": r.seconds,
                        "msgs_per_s": r.rate,
                        "server_cpu_s": r.server_cpu_s,
                        "server_cpu_us_per_msg": r.cpu_us,
                        "parent_cpu_s": r.parent_cpu_s,
                        "client_cpu_s": r.client_cpu_s,
                        "machine_busy": r.machine_busy,
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
