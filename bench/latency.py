"""End-to-end latency and server CPU per message at an everyday rate (issue 21).

A publisher paced at 1,000 msgs/s, a consumer receiving each message (and acking
each one where the protocol has acks), 100 B bodies stamped with the send time;
prints p50/p99 of send-to-receive in ms and the server's CPU (user + system, all
threads, from psutil) per message over the scenario. Cases:

- ``amqp``: pika, transient queue, delivery_mode 1, consumer prefetch 500, basic.ack each
- ``amqp-durable``: the same with a durable queue and persistent messages (mode 2)
- ``mqtt0`` / ``mqtt1``: paho 3.1.1, publisher and subscriber at QoS 0 / QoS 1
- ``kafka``: confluent-kafka, producer ``linger.ms=0`` and ``acks=all``, an assigned
  consumer polling (librdkafka's default ``fetch.wait.max.ms``, 500)
- ``mns``: ``http.client`` against the MNS-style API: SendMessage each; a receiver
  long-polling BatchReceiveMessage (16, ``waitseconds=30``) while a deleter thread
  sends BatchDeleteMessage of what it got (bodies base64, as the SDK sends them)
- ``rocketmq``: rocketmq-python-client 5.x over gRPC: ``send_async`` each, a
  SimpleConsumer long-polling ``receive`` and acking each message

    .venv/bin/python -m bench.latency                       # polymq, every case, 3 runs
    .venv/bin/python -m bench.latency --cases amqp --runs 5 --seconds 5
    .venv/bin/python -m bench.latency --amqp 127.0.0.1:5672 --amqp-pid PID  # RabbitMQ
    .venv/bin/python -m bench.latency --mqtt 127.0.0.1:1883 --mqtt-pid PID  # Mosquitto
    .venv/bin/python -m bench.latency --cases kafka,mns,rocketmq --runs 3 --seconds 5

Each run starts fresh clients; the medians of the runs are printed last. Without
``--amqp``/``--mqtt``/``--kafka``/``--http``/``--rocketmq`` polymq is started once per
listener (``bench/_server.py``) and serves every run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import logging
import queue
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import pika

from bench._server import HOST, Meter, Server, polymq_server
from bench._stats import p50_p99_ms
from bench.mqtt import Counter, _client, _stop, _subscribe
from polymq.gateway.progress import Progress

__all__ = ["CASES", "Result", "measure"]

RATE = 1_000
BODY = 100
_STAMP = struct.Struct(">d")


@dataclass(frozen=True)
class Result:
    case: str
    server: str
    received: int
    p50_ms: float
    p99_ms: float
    cpu_us_per_msg: float
    cpu_pct: float


def _paced(total: int, send: Callable[[int], object]) -> float:
    """Call ``send(i)`` at RATE per second; returns the seconds it took."""
    start = time.perf_counter()
    for i in range(total):
        due = start + i / RATE
        while (now := time.perf_counter()) < due:
            time.sleep(min(0.001, due - now))
        send(i)
    return time.perf_counter() - start


def _amqp(server: Server, total: int, durable: bool) -> list[float]:
    params = pika.ConnectionParameters(server.host, server.port, heartbeat=0)
    queue = f"lat-{uuid.uuid4().hex[:8]}"
    latencies: list[float] = []
    ready = threading.Event()

    def consumer() -> None:
        with contextlib.closing(pika.BlockingConnection(params)) as conn:
            ch = conn.channel()
            ch.queue_declare(queue, durable=durable, auto_delete=not durable)
            ch.basic_qos(prefetch_count=500)
            ready.set()
            deadline = time.monotonic() + total / RATE + 20
            for method, _, body in ch.consume(queue, inactivity_timeout=1):
                if method is not None:
                    latencies.append(time.perf_counter() - _STAMP.unpack_from(body)[0])
                    ch.basic_ack(method.delivery_tag)
                if len(latencies) >= total or time.monotonic() > deadline:
                    break
            ch.cancel()
            if durable:
                ch.queue_delete(queue)

    thread = threading.Thread(target=consumer)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the AMQP consumer did not start")
    pad = b"x" * (BODY - _STAMP.size)
    props = pika.BasicProperties(delivery_mode=2 if durable else 1)
    with contextlib.closing(pika.BlockingConnection(params)) as conn:
        ch = conn.channel()
        _paced(
            total,
            lambda _: ch.basic_publish("", queue, _STAMP.pack(time.perf_counter()) + pad, props),
        )
        thread.join(total / RATE + 30)
    return latencies


def _mqtt(server: Server, total: int, qos: int) -> list[float]:
    counter = Counter()
    topic = f"lat/{uuid.uuid4().hex[:8]}"
    sub = _client(server.host, server.port, counter)
    _subscribe(sub, topic, qos)
    pub = _client(server.host, server.port)
    pad = b"x" * (BODY - 1 - _STAMP.size)
    _paced(total, lambda _: pub.publish(topic, b"T" + _STAMP.pack(time.perf_counter()) + pad, qos))
    counter.wait(total, total / RATE + 30)
    _stop(pub, sub)
    return list(counter.latencies)


def _kafka(server: Server, total: int) -> list[float]:
    """confluent-kafka: a producer with ``linger.ms=0`` and ``acks=all`` (each record
    sent as soon as produced, answered after its fsync), an assigned consumer polling
    one record at a time with librdkafka's default ``fetch.wait.max.ms`` (500): a
    fetch that waited on its timer instead of the append would show at once."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    bootstrap = server.address
    topic = f"lat-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1)])[topic].result(30)
    latencies: list[float] = []
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"lat-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "fetch.min.bytes": 1,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    ready = threading.Event()

    def consume() -> None:
        deadline = time.monotonic() + total / RATE + 30
        try:
            while len(latencies) < total and time.monotonic() < deadline:
                message = consumer.poll(0.1)
                if message is None or message.error() is not None:
                    continue
                value = message.value()
                if not ready.is_set():
                    ready.set()  # the warm-up record: connected, fetching
                elif value is not None:
                    latencies.append(time.perf_counter() - _STAMP.unpack_from(value)[0])
        finally:
            consumer.close()

    thread = threading.Thread(target=consume)
    thread.start()
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
    pad = b"x" * (BODY - _STAMP.size)
    try:
        producer.produce(topic, b"warm-up", partition=0)
        producer.flush(30)
        if not ready.wait(30):
            raise RuntimeError("the Kafka consumer did not get the warm-up record")

        def send(_: int) -> None:
            producer.produce(topic, _STAMP.pack(time.perf_counter()) + pad, partition=0)
            producer.poll(0)

        _paced(total, send)
        producer.flush(30)
    finally:
        thread.join(total / RATE + 40)
    return latencies


def _mns(server: Server, total: int) -> list[float]:
    """The MNS-style API (unsigned: polymq's open auth mode) through the standard
    library's ``http.client`` on keep-alive connections: SendMessage per message; a
    receiver long-polling BatchReceiveMessage (``numOfMessages=16``,
    ``waitseconds=30``: one message at this rate unless it fell behind) that hands
    the receipt handles to a deleter (BatchDeleteMessage on its own connection) and
    polls again at once, as a consumer keeping up with a queue does. httpx cost this
    process about 1 ms of CPU per request, so with it the client, not the server,
    made the latency (three requests per message on one interpreter)."""
    path = f"/queues/lat-{uuid.uuid4().hex[:8]}/messages"
    receive_path = f"{path}?numOfMessages=16&waitseconds=30"
    json_accept = {"accept": "application/json"}
    latencies: list[float] = []
    ready = threading.Event()
    handles: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()

    def receiver() -> None:
        deadline = time.monotonic() + total / RATE + 30
        with contextlib.closing(_http_connection(server)) as conn:
            while len(latencies) < total and time.monotonic() < deadline:
                status, data = _request(conn, "GET", receive_path, headers=json_accept)
                if status == 404:
                    continue
                messages = json.loads(data)["Messages"]
                now = time.perf_counter()
                for m in messages:
                    body = base64.b64decode(m["MessageBody"])
                    if not ready.is_set():
                        ready.set()  # the warm-up message
                    else:
                        latencies.append(now - _STAMP.unpack_from(body)[0])
                handles.put([m["ReceiptHandle"] for m in messages])
        handles.put(None)

    def deleter() -> None:
        with contextlib.closing(_http_connection(server)) as conn:
            while (batch := handles.get()) is not None:
                if batch:
                    listed = "".join(f"<ReceiptHandle>{h}</ReceiptHandle>" for h in batch)
                    body = f"<ReceiptHandles>{listed}</ReceiptHandles>"
                    _request(conn, "DELETE", path, body=body)

    pad = b"x" * (BODY - _STAMP.size)
    with contextlib.closing(_http_connection(server)) as conn:
        _request(conn, "PUT", path.removesuffix("/messages"))

        def send(_: int) -> None:
            body = base64.b64encode(_STAMP.pack(time.perf_counter()) + pad).decode()
            _request(
                conn, "POST", path, body=f"<Message><MessageBody>{body}</MessageBody></Message>"
            )

        threads = [threading.Thread(target=receiver), threading.Thread(target=deleter)]
        for thread in threads:
            thread.start()
        try:
            send(-1)
            if not ready.wait(30):
                raise RuntimeError("the MNS receiver did not get the warm-up message")
            _paced(total, send)
        finally:
            for thread in threads:
                thread.join(total / RATE + 40)
    return latencies


def _http_connection(server: Server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(server.host, server.port, timeout=60)


def _request(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    *,
    body: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request on a keep-alive connection: its status (404 passed through,
    other errors raised) and body."""
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    if response.status >= 400 and response.status != 404:
        raise RuntimeError(f"{method} {path}: {response.status} {data[:200]!r}")
    return response.status, data


def _rocketmq(server: Server, total: int) -> list[float]:
    """rocketmq-python-client (5.x, gRPC): a producer sending asynchronously (a sync
    send of this client costs about as much as the pace allows), a SimpleConsumer
    long-polling ReceiveMessage (32 at most, 20 s long poll) and acking every message
    from a small thread pool (the client's ack is a blocking call)."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, SimpleConsumer
    from rocketmq import Producer as RmqProducer

    logging.getLogger("rocketmq-python-client").setLevel(logging.ERROR)
    config = ClientConfiguration(server.address, Credentials(), request_timeout=10)
    topic = f"lat-{uuid.uuid4().hex[:8]}"
    pad = b"x" * (BODY - _STAMP.size)

    def message() -> Any:
        msg = Message()
        msg.topic = topic
        msg.body = _STAMP.pack(time.perf_counter()) + pad
        return msg

    latencies: list[float] = []
    producer = RmqProducer(config, (topic,))
    producer.startup()
    try:
        producer.send(message())  # creates the topic before the consumer subscribes
        consumer = SimpleConsumer(
            config, f"lat-{uuid.uuid4().hex[:8]}", {topic: FilterExpression()}, 20
        )
        consumer.startup()
        try:
            consumer.receive(32, 30)  # the warm-up message; the route is known
            with ThreadPoolExecutor(8) as acker:

                def consume() -> None:
                    deadline = time.monotonic() + total / RATE + 20
                    while len(latencies) < total and time.monotonic() < deadline:
                        for m in consumer.receive(32, 30):
                            latencies.append(time.perf_counter() - _STAMP.unpack_from(m.body)[0])
                            acker.submit(consumer.ack, m)

                thread = threading.Thread(target=consume)
                thread.start()
                sent: list[Future[Any]] = []
                _paced(total, lambda _: sent.append(producer.send_async(message())))
                for future in sent:
                    future.result(30)
                thread.join(total / RATE + 30)
        finally:
            consumer.shutdown()
    finally:
        producer.shutdown()
    return latencies


CASES: dict[str, tuple[str, Callable[[Server, int], list[float]]]] = {
    "amqp": ("amqp", lambda s, n: _amqp(s, n, durable=False)),
    "amqp-durable": ("amqp", lambda s, n: _amqp(s, n, durable=True)),
    "mqtt0": ("mqtt", lambda s, n: _mqtt(s, n, 0)),
    "mqtt1": ("mqtt", lambda s, n: _mqtt(s, n, 1)),
    "kafka": ("kafka", _kafka),
    "mns": ("http", _mns),
    "rocketmq": ("rocketmq", _rocketmq),
}


def measure(case: str, server: Server, seconds: float) -> Result:
    """One run of ``case`` against ``server``: fresh clients, RATE x seconds messages."""
    _, run = CASES[case]
    meter = Meter(server.pid)
    total = int(RATE * seconds)
    cpu, wall = meter.cpu(), time.perf_counter()
    latencies = run(server, total)
    used, wall = meter.cpu() - cpu, time.perf_counter() - wall
    p50, p99 = p50_p99_ms(latencies) if latencies else (0.0, 0.0)
    n = len(latencies)
    return Result(
        case=case,
        server=server.label,
        received=n,
        p50_ms=p50,
        p99_ms=p99,
        cpu_us_per_msg=used / n * 1e6 if n else 0.0,
        cpu_pct=used / wall * 100 if wall else 0.0,
    )


def median(results: list[Result]) -> Result:
    """The median of each figure over runs of one case on one server."""
    first = results[0]
    return Result(
        case=first.case,
        server=first.server,
        received=int(statistics.median(r.received for r in results)),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        cpu_us_per_msg=statistics.median(r.cpu_us_per_msg for r in results),
        cpu_pct=statistics.median(r.cpu_pct for r in results),
    )


def _line(r: Result, tag: str = "") -> str:
    return (
        f"{r.case:<13} {r.server:<22} {tag:<7} {r.received:>6} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f}"
        f" {r.cpu_us_per_msg:>8.0f} {r.cpu_pct:>6.0f}"
    )


def _header() -> str:
    return (
        f"{'case':<13} {'server':<22} {'run':<7} {'msgs':>6} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'cpu us/m':>8} {'cpu %':>6}"
    )


@contextlib.contextmanager
def _servers(args: argparse.Namespace, listeners: set[str]) -> Iterator[dict[str, Server]]:
    """The brokers to measure, per listener: the given ones, else a polymq each."""
    servers: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        for name in sorted(listeners):
            target = getattr(args, name)
            if target:
                host, _, port = target.rpartition(":")
                servers[name] = Server(
                    host or HOST, int(port), getattr(args, f"{name}_pid"), target
                )
            else:
                servers[name] = stack.enter_context(polymq_server(name, durability=args.durability))
        yield servers


def main() -> None:
    global RATE
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="amqp,amqp-durable", help=f"of {','.join(CASES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--amqp", metavar="HOST:PORT", help="an AMQP broker already running")
    parser.add_argument("--amqp-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--mqtt", metavar="HOST:PORT", help="an MQTT broker already running")
    parser.add_argument("--mqtt-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--kafka", metavar="HOST:PORT", help="a Kafka broker already running")
    parser.add_argument("--kafka-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--http", metavar="HOST:PORT", help="an MNS-style API already running")
    parser.add_argument("--http-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--rocketmq", metavar="HOST:PORT", help="a RocketMQ 5 proxy running")
    parser.add_argument("--rocketmq-pid", type=int, help="its pid, for CPU")
    parser.add_argument("--durability", choices=("sync", "async"), default="sync")
    parser.add_argument(
        "--rate",
        type=int,
        default=RATE,
        help=f"messages per second (default {RATE}, the issue's everyday rate; a lower "
        "one shows the path when the machine is too loaded to keep that pace)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per result")
    args = parser.parse_args()
    RATE = args.rate
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(CASES)}")
    listeners = {CASES[c][0] for c in cases}
    with (
        _servers(args, listeners) as servers,
        Progress(len(cases) * args.runs, "bench.latency") as progress,
    ):
        print(f"# {RATE} msgs/s, {BODY} B, {args.seconds:g} s per run", flush=True)
        print(_header(), flush=True)
        for case in cases:
            server = servers[CASES[case][0]]
            results = []
            for run in range(args.runs):
                progress.step(f"{case} run {run + 1}/{args.runs}")
                result = measure(case, server, args.seconds)
                results.append(result)
                print(_emit(result, f"#{run + 1}", args.json), flush=True)
            print(_emit(median(results), "median", args.json), flush=True)


def _emit(result: Result, tag: str, as_json: bool) -> str:
    if as_json:
        data: dict[str, Any] = asdict(result)
        data["run"] = tag
        return json.dumps(data)
    return _line(result, tag)


if __name__ == "__main__":
    main()
