"""MNS HTTP API benchmark with httpx keep-alive connections on loopback.

SendMessage, BatchSendMessage (16 per request) and Receive+Delete (ReceiveMessage then
DeleteMessage per message, and BatchReceive 16 + BatchDelete) in msgs/s, request
latency p50/p99, and the server's CPU seconds and RSS. The server is polymq with only
the HTTP listener, in a subprocess of this script, in open auth mode (unsigned
requests) with sync (then async) durability. Every scenario stops at its message count or its time
limit, whichever comes first.

    .venv/bin/python -m bench.http            # about two minutes
    .venv/bin/python -m bench.http --quick    # a smoke run of a few seconds
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as a file, this script's folder would shadow the standard library's ``http``.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench._server import Meter, polymq_server  # noqa: E402
from bench._stats import p50_p99_ms  # noqa: E402
from polymq.gateway.progress import Progress  # noqa: E402

BODY = "x" * 256

CONCURRENCY = 16  # keep-alive connections in all
CLIENTS = 2  # client processes sharing them
XMLNS = "http://mns.aliyuncs.com/doc/v1/"


@dataclass
class Row:
    scenario: str
    msgs: int
    requests: int
    seconds: float
    latencies: list[float]
    cpu_s: float
    rss_mib: float

    def line(self) -> str:
        p50, p99 = p50_p99_ms(self.latencies)
        return (
            f"{self.scenario:<28} {self.msgs:>7} {self.msgs / self.seconds:>10.0f} "
            f"{self.requests / self.seconds:>9.0f} {p50:>8.2f} {p99:>8.2f} "
            f"{self.cpu_s:>7.2f} {self.cpu_s / max(1, self.msgs) * 1e6:>8.0f} {self.rss_mib:>7.1f}"
        )


HEADER = (
    f"{'scenario':<28} {'msgs':>7} {'msgs/s':>10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'cpu s':>7} {'us/msg':>8} {'rss MiB':>7}"
)


def message_xml(body: str) -> str:
    return f"<Message><MessageBody>{body}</MessageBody></Message>"


BATCH_XML = (
    f"<Messages xmlns='{XMLNS}'>" + "".join(message_xml(BODY) for _ in range(16)) + "</Messages>"
).encode()
SINGLE_XML = f"<Message xmlns='{XMLNS}'><MessageBody>{BODY}</MessageBody></Message>".encode()


STEPS: dict[str, Callable[[httpx.AsyncClient], Awaitable[int]]] = {}


async def client_loop(
    step: Callable[[httpx.AsyncClient], Awaitable[int]],
    *,
    base: str,
    connections: int,
    max_msgs: int,
    max_seconds: float,
) -> dict[str, Any]:
    """``connections`` tasks, each on its own keep-alive connection, repeating ``step``
    (one or two requests, returning the messages it moved) until ``max_msgs`` or
    ``max_seconds``."""
    latencies: list[float] = []
    moved = requests = 0
    began = time.time()
    deadline = time.perf_counter() + max_seconds

    async def worker() -> None:
        nonlocal moved, requests
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
            while moved < max_msgs and time.perf_counter() < deadline:
                t0 = time.perf_counter()
                count = await step(client)
                latencies.append(time.perf_counter() - t0)
                requests += 1
                if count == 0:
                    return
                moved += count

    await asyncio.gather(*(worker() for _ in range(connections)))
    return {
        "moved": moved,
        "requests": requests,
        "began": began,
        "ended": time.time(),
        "latencies": latencies,
    }


def run(name: str, step: str, meter: Meter, *, base: str, max_msgs: int, max_seconds: float) -> Row:
    """``CLIENTS`` client processes (one Python client cannot keep the server busy),
    ``CONCURRENCY`` connections in all."""
    cpu_before = meter.cpu()
    share = str(max_msgs // CLIENTS)
    args = [base, str(CONCURRENCY // CLIENTS), share, str(max_seconds)]
    clients = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.http", "--client", step, *args],
            cwd=_HERE.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(CLIENTS)
    ]
    results = [json.loads(c.communicate(timeout=max_seconds + 60)[0]) for c in clients]
    cpu = meter.cpu() - cpu_before
    seconds = max(r["ended"] for r in results) - min(r["began"] for r in results)
    return Row(
        name,
        sum(r["moved"] for r in results),
        sum(r["requests"] for r in results),
        seconds,
        [latency for r in results for latency in r["latencies"]],
        cpu,
        meter.rss_mib(),
    )


async def send(client: httpx.AsyncClient) -> int:
    response = await client.post("/queues/bench/messages", content=SINGLE_XML)
    response.raise_for_status()
    return 1


async def batch_send(client: httpx.AsyncClient) -> int:
    response = await client.post("/queues/bench/messages", content=BATCH_XML)
    response.raise_for_status()
    return 16


async def receive_delete(client: httpx.AsyncClient) -> int:
    got = await client.get("/queues/bench/messages", headers={"accept": "application/json"})
    if got.status_code == 404:
        return 0
    got.raise_for_status()
    handle = got.json()["ReceiptHandle"]
    deleted = await client.delete("/queues/bench/messages", params={"ReceiptHandle": handle})
    deleted.raise_for_status()
    return 1


async def batch_receive_delete(client: httpx.AsyncClient) -> int:
    got = await client.get(
        "/queues/bench/messages?numOfMessages=16", headers={"accept": "application/json"}
    )
    if got.status_code == 404:
        return 0
    got.raise_for_status()
    handles = [m["ReceiptHandle"] for m in got.json()["Messages"]]
    doc = (
        f"<ReceiptHandles xmlns='{XMLNS}'>"
        + "".join(f"<ReceiptHandle>{h}</ReceiptHandle>" for h in handles)
        + "</ReceiptHandles>"
    )
    deleted = await client.request("DELETE", "/queues/bench/messages", content=doc.encode())
    deleted.raise_for_status()
    return len(handles)


STEPS.update(
    send=send,
    batch_send=batch_send,
    receive_delete=receive_delete,
    batch_receive_delete=batch_receive_delete,
)


async def main_async(quick: bool, durability: str) -> None:
    single = 500 if quick else 20_000
    batched = 2_000 if quick else 100_000
    limit = 3.0 if quick else 15.0
    with polymq_server("http", durability=durability) as server:
        base, meter = f"http://{server.address}", Meter(server.pid)
        async with httpx.AsyncClient(base_url=base) as admin:
            (await admin.put("/queues/bench")).raise_for_status()
        from polymq.protocols.http.listener import HTTP_PARSER

        print(
            f"server pid {server.pid}; durability {durability}; {CONCURRENCY} keep-alive "
            f"connections from {CLIENTS} client processes; body 256 B; "
            f"http parser {HTTP_PARSER}"
        )
        print(HEADER)
        scenarios = (
            ("SendMessage", "send", single),
            ("Receive+Delete", "receive_delete", single),
            ("BatchSendMessage (16)", "batch_send", batched),
            ("BatchReceive+BatchDelete (16)", "batch_receive_delete", batched),
        )
        rows = []
        with Progress(len(scenarios), f"bench.http {durability}") as progress:
            for name, step, count in scenarios:
                progress.step(name)
                rows.append(run(name, step, meter, base=base, max_msgs=count, max_seconds=limit))
        for row in rows:
            print(row.line())
        print("p50/p99: per step (Receive+Delete: both requests); cpu: server process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    parser.add_argument(
        "--durability",
        choices=("sync", "async", "both"),
        default="both",
        help="the server's storage durability (default: a run of each)",
    )
    parser.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        step, base, connections, max_msgs, max_seconds = args.client
        result = asyncio.run(
            client_loop(
                STEPS[step],
                base=base,
                connections=int(connections),
                max_msgs=int(max_msgs),
                max_seconds=float(max_seconds),
            )
        )
        print(json.dumps(result))
        return
    for durability in ("sync", "async") if args.durability == "both" else (args.durability,):
        asyncio.run(main_async(args.quick, durability))


if __name__ == "__main__":
    main()
