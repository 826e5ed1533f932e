"""MQTT benchmark with paho-mqtt on loopback, 100 B payloads.

Scenarios, each bounded in count and time: QoS 0 and QoS 1 publish msgs/s (one
publisher, one subscriber counting deliveries), fan-in (20 publishers -> 1
subscriber) and fan-out (1 publisher -> 100 subscribers) delivered msgs/s, end-to-end
latency p50/p99 at a paced 1,000 msgs/s, and the RSS of many idle connections; with
the server's CPU seconds per scenario and its RSS.

    .venv/bin/python -m bench.mqtt                          # starts polymq itself
    .venv/bin/python -m bench.mqtt --target 127.0.0.1:1883 [--server-pid PID]
    .venv/bin/python -m bench.mqtt --mosquitto              # both, with the ratio

With ``--target`` it measures whatever broker listens there (Mosquitto, say); pass
``--server-pid`` for that server's CPU and RSS too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from bench._reference import mosquitto_server
from bench._server import Meter, add_target_options, server_under_test
from bench._stats import p50_p99_ms
from polymq.gateway.progress import Progress

PAYLOAD = 100
PUBLISH_COUNT = 20_000
QOS1_COUNT = 10_000
FAN_IN_PUBLISHERS = 20
FAN_IN_EACH = 1_000
FAN_OUT_SUBSCRIBERS = 100
FAN_OUT_COUNT = 500
LATENCY_RATE = 1_000
LATENCY_SECONDS = 5.0
IDLE_CONNECTIONS = 10_000
SCENARIO_LIMIT_S = 40.0
# A QoS 0 case ends this long after its subscriber last received a message: the rest
# was dropped (a broker drops QoS 0 for a subscriber too far behind: Mosquitto past
# max_queued_messages, polymq past qos0_drop_bytes), and the rate counts what was
# received over the time until the last of it, not a wait for what will not come.
QUIET_S = 5.0


class Counter:
    def __init__(self) -> None:
        self.count = 0
        self.latencies: list[float] = []
        self.cond = threading.Condition()
        self.last_at = 0.0  # perf_counter() of the last delivery

    def on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.cond:
            self.count += 1
            self.last_at = time.perf_counter()
            if len(msg.payload) >= 8 and msg.payload[:1] == b"T":
                sent = struct.unpack_from(">d", msg.payload, 1)[0]
                self.latencies.append(time.perf_counter() - sent)
            self.cond.notify_all()

    def wait(self, count: int, limit_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= count, limit_s)

    def settle(self, count: int, limit_s: float, quiet_s: float = QUIET_S) -> int:
        """Until ``count`` arrived, or nothing arrived for ``quiet_s`` (since the last
        delivery, or this call), or ``limit_s`` passed: how many arrived."""
        now = time.perf_counter()
        deadline, waiting_from = now + limit_s, now
        with self.cond:
            while self.count < count:
                now = time.perf_counter()
                quiet_until = max(self.last_at, waiting_from) + quiet_s
                if now >= deadline or now >= quiet_until:
                    break
                self.cond.wait(min(deadline, quiet_until) - now)
            return self.count

    def seconds_since(self, start: float) -> float:
        """From ``start`` to the last delivery (to now if none came)."""
        with self.cond:
            end = self.last_at if self.count else time.perf_counter()
        return end - start


def _report_lost(name: str, received: int, sent: int) -> None:
    """Say when the subscriber received fewer than were sent (QoS 0 dropped by the
    broker): the rate counts only what it received."""
    if received < sent:
        print(f"# {name}: the subscriber received {received:,} of {sent:,}", file=sys.stderr)


def _client(
    host: str, port: int, counter: Counter | None = None, *, persistent: bool = False
) -> paho.Client:
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"b-{uuid.uuid4().hex[:10]}",
        protocol=paho.MQTTv311,
        clean_session=not persistent,
    )
    client.max_inflight_messages_set(100)
    client.max_queued_messages_set(0)
    if counter is not None:
        client.on_message = counter.on_message
    connected = threading.Event()
    client.on_connect = lambda *args: connected.set()
    client.connect(host, port, keepalive=120)
    client.loop_start()
    if not connected.wait(30):
        raise RuntimeError("no CONNACK")
    sock = client.socket()
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


def _subscribe(client: paho.Client, topic: str, qos: int) -> None:
    done = threading.Event()
    client.on_subscribe = lambda *args: done.set()
    client.subscribe(topic, qos)
    if not done.wait(30):
        raise RuntimeError("no SUBACK")


def _stop(*clients: paho.Client) -> None:
    for client in clients:
        client.disconnect()
        client.loop_stop()


Row = dict[str, Any]


def _measure(meter: Meter, name: str, body: Callable[[], tuple[int, float]]) -> Row:
    cpu0 = meter.cpu()
    delivered, seconds = body()
    cpu = meter.cpu() - cpu0
    row: Row = {
        "scenario": name,
        "delivered": delivered,
        "seconds": round(seconds, 3),
        "msgs_per_s": round(delivered / seconds) if seconds else 0,
        "server_cpu_s": round(cpu, 2),
        "server_cpu_us_per_msg": round(cpu / delivered * 1e6, 1) if delivered else 0,
        "server_rss_mib": round(meter.rss_mib(), 1),
    }
    print(json.dumps(row), flush=True)
    return row


def one_to_one(
    host: str,
    port: int,
    qos: int,
    count: int,
    *,
    persistent: bool = False,
    size: int = PAYLOAD,
) -> tuple[int, float]:
    """One publisher, one subscriber; a persistent subscriber's QoS 1 messages go
    through its storage queue (pop, ack) in polymq."""
    counter = Counter()
    sub = _client(host, port, counter, persistent=persistent)
    _subscribe(sub, "bench/one", qos)
    pub = _client(host, port)
    payload = b"x" * size
    start = time.perf_counter()
    infos = [pub.publish("bench/one", payload, qos) for _ in range(count)]
    if qos:
        for info in infos:
            info.wait_for_publish(SCENARIO_LIMIT_S)
    received = counter.settle(count, SCENARIO_LIMIT_S)
    seconds = counter.seconds_since(start)
    _stop(pub, sub)
    _report_lost(f"one-to-one qos {qos}, {size} B", received, count)
    return received, seconds


def fan_in(
    host: str,
    port: int,
    publishers: int = FAN_IN_PUBLISHERS,
    each: int = FAN_IN_EACH,
    qos: int = 0,
) -> tuple[int, float]:
    """``publishers`` clients, a thread each, ``each`` publishes at ``qos`` to topics
    of their own, one subscriber to all of them at the same QoS."""
    counter = Counter()
    sub = _client(host, port, counter)
    _subscribe(sub, "fanin/#", qos)
    pubs = [_client(host, port) for _ in range(publishers)]
    payload = b"x" * PAYLOAD
    start = time.perf_counter()

    def run(i: int, client: paho.Client) -> None:
        infos = [client.publish(f"fanin/{i}", payload, qos) for _ in range(each)]
        if qos:
            for info in infos:
                info.wait_for_publish(SCENARIO_LIMIT_S)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(pubs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    received = counter.settle(publishers * each, SCENARIO_LIMIT_S)
    seconds = counter.seconds_since(start)
    _stop(*pubs, sub)
    _report_lost(f"fan-in qos {qos}", received, publishers * each)
    return received, seconds


def fan_out(host: str, port: int) -> tuple[int, float]:
    counter = Counter()
    subs = [_client(host, port, counter) for _ in range(FAN_OUT_SUBSCRIBERS)]
    for sub in subs:
        _subscribe(sub, "fanout/t", 0)
    pub = _client(host, port)
    payload = b"x" * PAYLOAD
    start = time.perf_counter()
    for _ in range(FAN_OUT_COUNT):
        pub.publish("fanout/t", payload, 0)
    counter.wait(FAN_OUT_COUNT * FAN_OUT_SUBSCRIBERS, SCENARIO_LIMIT_S)
    seconds = time.perf_counter() - start
    _stop(pub, *subs)
    return counter.count, seconds


def latency(host: str, port: int) -> tuple[float, float, int]:
    counter = Counter()
    sub = _client(host, port, counter)
    _subscribe(sub, "lat/t", 0)
    pub = _client(host, port)
    pad = b"x" * (PAYLOAD - 9)
    total = int(LATENCY_RATE * LATENCY_SECONDS)
    start = time.perf_counter()
    for i in range(total):
        due = start + i / LATENCY_RATE
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        pub.publish("lat/t", b"T" + struct.pack(">d", time.perf_counter()) + pad, 0)
    counter.wait(total, SCENARIO_LIMIT_S)
    _stop(pub, sub)
    if not counter.latencies:
        return 0.0, 0.0, 0
    p50, p99 = p50_p99_ms(counter.latencies)
    return p50, p99, len(counter.latencies)


def idle_connections(host: str, port: int, meter: Meter, wanted: int) -> Row:
    """Open ``wanted`` MQTT connections (a CONNECT each, 200 at a time, asyncio
    streams so the client stays small), hold them, and read the server's RSS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = min(wanted, soft - 200)
    connect = bytes.fromhex("100c00044d5154540402012c0000")  # v3.1.1, clean, ka 300
    before = meter.rss_mib()

    async def hold() -> tuple[int, float, float]:
        gate = asyncio.Semaphore(200)

        async def one() -> asyncio.StreamWriter:
            async with gate:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(connect)
                if (await reader.readexactly(4))[:1] != b"\x20":
                    raise RuntimeError("no CONNACK")
                return writer

        start = time.perf_counter()
        writers = await asyncio.gather(*(one() for _ in range(limit)))
        seconds = time.perf_counter() - start
        await asyncio.sleep(1)
        after = meter.rss_mib()
        for writer in writers:
            writer.close()
        return len(writers), seconds, after

    opened, seconds, after = asyncio.run(hold())
    row: Row = {
        "scenario": "idle connections",
        "connections": opened,
        "wanted": wanted,
        "open_seconds": round(seconds, 2),
        "server_rss_before_mib": round(before, 1),
        "server_rss_after_mib": round(after, 1),
        "kib_per_connection": round((after - before) * 1024 / max(1, opened), 1),
    }
    print(json.dumps(row), flush=True)
    return row


def topic_index(subscriptions: int = 100_000, lookups: int = 20_000) -> Row:
    """The topic-filter index alone, in this process: build time and matches/s with
    ``subscriptions`` filters (70% exact, 30% with + or #)."""
    import random

    from polymq.protocols.mqtt.topic_filter_index import TopicFilterIndex

    rng = random.Random(1)
    index: TopicFilterIndex[int] = TopicFilterIndex()
    start = time.perf_counter()
    for i in range(subscriptions):
        b, f, r = rng.randrange(50), rng.randrange(20), rng.randrange(100)
        shapes = (f"b{b}/f{f}/r{r}/temp", f"b{b}/+/r{r}/temp", f"b{b}/f{f}/#")
        shape = shapes[(i % 10 >= 7) + (i % 10 == 9)]
        index.add(shape, i, i)
    built = time.perf_counter() - start
    topics = [
        f"b{rng.randrange(50)}/f{rng.randrange(20)}/r{rng.randrange(100)}/temp"
        for _ in range(lookups)
    ]
    start = time.perf_counter()
    found = sum(len(index.match(topic)) for topic in topics)
    seconds = time.perf_counter() - start
    row: Row = {
        "scenario": "topic index",
        "subscriptions": subscriptions,
        "build_seconds": round(built, 2),
        "matches_per_s": round(lookups / seconds),
        "avg_matched": round(found / lookups, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def run(host: str, port: int, meter: Meter, label: str) -> dict[str, Row]:
    print(f"# {label} at {host}:{port}", flush=True)
    with Progress(7, f"bench.mqtt {label}") as progress:
        return _run(host, port, meter, progress)


def _run(host: str, port: int, meter: Meter, progress: Progress) -> dict[str, Row]:
    scenarios: list[tuple[str, str, Callable[[], tuple[int, float]]]] = [
        ("qos0", "publish qos0", lambda: one_to_one(host, port, 0, PUBLISH_COUNT)),
        ("qos1", "publish qos1", lambda: one_to_one(host, port, 1, QOS1_COUNT)),
        (
            "qos1-persistent",
            "publish qos1, persistent subscriber",
            lambda: one_to_one(host, port, 1, QOS1_COUNT, persistent=True),
        ),
        ("fan-in", "fan-in 20->1", lambda: fan_in(host, port)),
        ("fan-out", "fan-out 1->100", lambda: fan_out(host, port)),
    ]
    rows: dict[str, Row] = {}
    for key, name, body in scenarios:
        progress.step(name)
        rows[key] = _measure(meter, name, body)
    progress.step("latency")
    cpu0 = meter.cpu()
    p50, p99, n = latency(host, port)
    row: Row = {
        "scenario": f"latency at {LATENCY_RATE}/s",
        "samples": n,
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "server_cpu_s": round(meter.cpu() - cpu0, 2),
    }
    print(json.dumps(row), flush=True)
    rows["latency"] = row
    progress.step("idle connections")
    rows["idle"] = idle_connections(host, port, meter, IDLE_CONNECTIONS)
    return rows


def _ratios(ours: dict[str, Row], theirs: dict[str, Row]) -> None:
    print("# polymq / mosquitto", flush=True)
    for key in ("qos0", "qos1", "qos1-persistent", "fan-in", "fan-out"):
        a, b = ours[key]["msgs_per_s"], theirs[key]["msgs_per_s"]
        print(json.dumps({"scenario": key, "ratio_msgs_per_s": round(a / b, 2) if b else None}))
    lat_a, lat_b = ours["latency"], theirs["latency"]
    print(
        json.dumps(
            {
                "scenario": "latency",
                "ratio_p50": round(lat_a["p50_ms"] / lat_b["p50_ms"], 2)
                if lat_b["p50_ms"]
                else None,
                "ratio_p99": round(lat_a["p99_ms"] / lat_b["p99_ms"], 2)
                if lat_b["p99_ms"]
                else None,
            }
        )
    )
    idle_a, idle_b = ours["idle"], theirs["idle"]
    per_b = idle_b["kib_per_connection"]
    print(
        json.dumps(
            {
                "scenario": "idle connections",
                "ratio_kib_per_connection": round(idle_a["kib_per_connection"] / per_b, 2)
                if per_b
                else None,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_options(parser)
    parser.add_argument("--mosquitto", action="store_true", help="also run against mosquitto")
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test)")
    args = parser.parse_args()
    if args.quick:
        global PUBLISH_COUNT, QOS1_COUNT, FAN_IN_EACH, FAN_OUT_COUNT, LATENCY_SECONDS
        global IDLE_CONNECTIONS
        PUBLISH_COUNT, QOS1_COUNT, FAN_IN_EACH, FAN_OUT_COUNT = 500, 200, 20, 5
        LATENCY_SECONDS, IDLE_CONNECTIONS = 0.2, 50
    topic_index(1_000 if args.quick else 100_000, 1_000 if args.quick else 20_000)
    # Room for the idle-connections scenario beyond the default limits (10,000 in all,
    # 5,000 per protocol, 1,000 per address: the bench connects from one address).
    room = str(IDLE_CONNECTIONS + 1_000)
    settings = {
        "limits.max_connections": room,
        "limits.max_connections_per_protocol": room,
        "limits.max_connections_per_address": room,
    }
    with server_under_test(
        "mqtt", target=args.target, server_pid=args.server_pid, settings=settings
    ) as server:
        ours = run(server.host, server.port, Meter(server.pid), server.label)
    if args.target:
        return
    if args.mosquitto:
        with mosquitto_server() as server:
            theirs = run(server.host, server.port, Meter(server.pid), server.label)
        _ratios(ours, theirs)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
