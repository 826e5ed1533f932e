"""Record the fuzzer's seeds: real clients of every protocol, through a recording
proxy, against a live merged server; what each client sent on each connection is
written to ``sessions/<protocol>/<scenario>-<n>.hex``.

``python -m tests.netfuzz.record [--protocol P ...]`` (re-recording replaces a
protocol's files). The server binds 127.0.0.2 and tells clients it is 127.0.0.1 (its
advertised host), where the proxies listen on the same ports: Kafka's Metadata and
RocketMQ's routes then send the clients' later connections through the proxies too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.netfuzz.probes import CLIENTS, ProbeClient
from tests.netfuzz.proxy import RecordingProxy
from tests.netfuzz.seeds import PROTOCOLS, SESSIONS, Session, dump
from tests.netfuzz.servers import FuzzServer, merged_spec

__all__ = ["SCENARIOS", "main", "record"]

CLIENT_HOST = "127.0.0.1"
SERVER_HOST = "127.0.0.2"
# A session is cut after this many bytes: seeds stay small, and what matters to the
# fuzzer is the framing of the first requests, not a long steady state.
MAX_SESSION_BYTES = 16 << 10
ROUND_TRIPS = 3


def _round_trips(protocol: str) -> Callable[[str, int], None]:
    """The probe's own client doing a few round trips: the sessions the fuzzer's
    well-behaved clients open are among those it mutates."""

    def run(host: str, port: int) -> None:
        client: ProbeClient = CLIENTS[protocol](host, port)
        try:
            for _ in range(ROUND_TRIPS):
                client.round_trip()
        finally:
            client.close()

    return run


def _kafka_group(host: str, port: int) -> None:
    """A consumer group (FindCoordinator, JoinGroup, SyncGroup, OffsetCommit,
    LeaveGroup) and the admin client (CreateTopics, DescribeConfigs)."""
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.admin._config import ConfigResource
    from confluent_kafka.cimpl import NewTopic

    bootstrap = f"{host}:{port}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"rec-{uuid.uuid4().hex[:8]}"
    for future in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        future.result(10)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    for future in admin.describe_configs([resource]).values():
        with contextlib.suppress(Exception):
            future.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "compression.type": "gzip"})
    for i in range(4):
        producer.produce(topic, f"v{i}".encode(), key=f"k{i}".encode(), headers={"h": b"1"})
    producer.flush(10)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rec-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got = 0
    deadline = time.monotonic() + 20
    while got < 4 and time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is not None and message.error() is None:
            got += 1
            consumer.commit(message=message, asynchronous=False)
    consumer.close()


def _amqp_features(host: str, port: int) -> None:
    """Exchanges, bindings with arguments, headers (field tables and arrays),
    consume, ack and nack."""
    import pika

    connection = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
    channel = connection.channel()
    exchange = f"rec-{uuid.uuid4().hex[:8]}"
    channel.exchange_declare(exchange, "headers", auto_delete=True)
    queue = channel.queue_declare("", exclusive=True, arguments={"x-max-length": 100}).method.queue
    channel.queue_bind(queue, exchange, arguments={"x-match": "any", "k": "v", "n": 7})
    props = pika.BasicProperties(
        headers={"k": "v", "n": 7, "nested": {"a": [1, "two", {"b": True}]}, "big": 2**40},
        content_type="text/plain",
        delivery_mode=2,
        priority=3,
        correlation_id="c-1",
    )
    for i in range(3):
        channel.basic_publish(exchange, "", f"m{i}".encode(), props)
    seen: list[int] = []

    def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
        seen.append(method.delivery_tag)
        if len(seen) == 2:
            ch.basic_nack(method.delivery_tag, requeue=False)
        else:
            ch.basic_ack(method.delivery_tag)

    tag = channel.basic_consume(queue, on_message)
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        connection.process_data_events(0.05)
    channel.basic_cancel(tag)
    channel.close()
    connection.close()


def _mqtt_v5(websocket: bool) -> Callable[[str, int], None]:
    """MQTT 5: properties, a will, a retained message, QoS 2, unsubscribe."""

    def run(host: str, port: int) -> None:
        import threading

        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        topic = f"rec/{uuid.uuid4().hex[:8]}/a"
        done = threading.Event()
        connected = threading.Event()
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"rec-{uuid.uuid4().hex[:8]}",
            transport="websockets" if websocket else "tcp",
            protocol=paho.MQTTv5,
        )
        if websocket:
            client.ws_set_options(path="/mqtt")
        client.will_set(f"{topic}/will", b"gone", qos=1, retain=False)
        client.on_connect = lambda c, u, f, rc, p: connected.set()
        client.on_message = lambda c, u, m: done.set()
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 60
        client.connect(host, port, keepalive=20, clean_start=True, properties=props)
        client.loop_start()
        try:
            connected.wait(10)
            client.subscribe([("rec/+/a", 2), ("rec/#", 1)])
            publish = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            publish.UserProperty = ("k", "v")
            publish.MessageExpiryInterval = 30
            publish.ContentType = "text/plain"
            client.publish(topic, b"retained", qos=1, retain=True, properties=publish)
            client.publish(topic, b"qos2", qos=2).wait_for_publish(10)
            done.wait(10)
            client.publish(topic, b"", qos=0, retain=True)
            client.unsubscribe(["rec/+/a", "rec/#"])
        finally:
            client.disconnect()
            client.loop_stop()

    return run


def _rocketmq_consume(host: str, port: int) -> None:
    """A producer with tags and keys, a simple consumer with a SQL92 filter: receive,
    ack, change invisible duration."""
    from rocketmq import (
        ClientConfiguration,
        Credentials,
        FilterExpression,
        Message,
        Producer,
        SimpleConsumer,
    )

    topic = f"rec-{uuid.uuid4().hex[:8]}"
    config = ClientConfiguration(f"{host}:{port}", Credentials("", ""), "")
    producer = Producer(config, (topic,))
    producer.startup()
    try:
        for i in range(3):
            message = Message()
            message.topic = topic
            message.body = f"m{i}".encode()
            message.tag = "tagA"
            message.keys = f"key{i}"
            message.add_property("n", str(i))
            producer.send(message)
    finally:
        producer.shutdown()
    sql = FilterExpression("n >= 1 AND (TAGS IS NOT NULL OR n BETWEEN 0 AND 5)", 2)
    consumer = SimpleConsumer(config, f"rec-{uuid.uuid4().hex[:8]}", {topic: sql}, await_duration=2)
    consumer.startup()
    try:
        for message in consumer.receive(8, 15):
            consumer.ack(message)
    finally:
        consumer.shutdown()


def _http_calls(host: str, port: int) -> None:
    """The MNS batch calls and topics through the SDK, the admin API through httpx."""
    import httpx
    from mns.account import Account
    from mns.queue import Message, QueueMeta
    from mns.topic import TopicMessage, TopicMeta

    account = Account(f"http://{host}:{port}", "rec", "rec")
    queue = account.get_queue(f"rec-{uuid.uuid4().hex[:8]}")
    queue.create(QueueMeta())
    queue.batch_send_message([Message(f"m{i}") for i in range(4)])
    got = queue.batch_receive_message(4, wait_seconds=1)
    queue.batch_delete_message([m.receipt_handle for m in got])
    topic = account.get_topic(f"rec-{uuid.uuid4().hex[:8]}")
    topic.create(TopicMeta())
    topic.publish_message(TopicMessage("hello"))
    topic.delete()
    queue.delete()
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=10) as client:
        client.get("/healthz")
        client.get("/admin/topics")
        client.get("/admin/connections")
        client.post("/admin/namespaces", json={"name": "rec", "nested": {"a": [1, {"b": 2}]}})


SCENARIOS: Mapping[str, Mapping[str, Callable[[str, int], None]]] = {
    "kafka": {"roundtrip": _round_trips("kafka"), "group": _kafka_group},
    "amqp": {"roundtrip": _round_trips("amqp"), "features": _amqp_features},
    "mqtt": {"roundtrip": _round_trips("mqtt"), "v5": _mqtt_v5(False)},
    "mqtt_ws": {"roundtrip": _round_trips("mqtt_ws"), "v5": _mqtt_v5(True)},
    "rocketmq": {"roundtrip": _round_trips("rocketmq"), "consume": _rocketmq_consume},
    "http": {"roundtrip": _round_trips("http"), "calls": _http_calls},
}


def _ports(count: int) -> list[int]:
    """Ports free on both loopback addresses (the server's and the proxies')."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as a:
            a.bind((CLIENT_HOST, 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b, contextlib.suppress(OSError):
                b.bind((SERVER_HOST, port))
                ports.append(port)
    return ports


def _cut(chunks: list[bytes]) -> tuple[bytes, ...]:
    kept: list[bytes] = []
    size = 0
    for chunk in chunks:
        if size + len(chunk) > MAX_SESSION_BYTES:
            kept.append(chunk[: MAX_SESSION_BYTES - size])
            break
        kept.append(chunk)
        size += len(chunk)
    return tuple(c for c in kept if c)


async def record(protocols: list[str], out: Path = SESSIONS) -> dict[str, int]:
    """Record ``protocols``' scenarios; returns the number of sessions written each."""
    ports = dict(zip(PROTOCOLS, _ports(len(PROTOCOLS)), strict=True))
    written: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as data:
        spec = merged_spec(Path(data), host=SERVER_HOST, ports=ports)
        server = FuzzServer(
            "merged",
            Path(data),
            specs=[spec],
            settings={"cluster.advertised_host": CLIENT_HOST},
        )
        await server.start()
        try:
            for protocol in protocols:
                written[protocol] = await _record_one(protocol, ports[protocol], out)
        finally:
            await server.stop()
    return written


async def _record_one(protocol: str, port: int, out: Path) -> int:
    folder = out / protocol
    for old in folder.glob("*.hex"):
        old.unlink()
    count = 0
    seen: set[bytes] = set()
    for scenario, run in SCENARIOS[protocol].items():
        proxy = RecordingProxy((CLIENT_HOST, port), (SERVER_HOST, port))
        await proxy.start()
        try:
            await asyncio.to_thread(run, CLIENT_HOST, port)
        finally:
            await proxy.stop()
        for i, connection in enumerate(proxy.connections):
            chunks = _cut(connection.chunks)
            data = b"".join(chunks)
            if not data or data in seen:
                continue
            seen.add(data)
            name = f"{scenario}-{i + 1}"
            comment = f"{protocol} {scenario}: connection {i + 1}, {len(data)} bytes, by record.py"
            dump(Session(protocol, name, chunks, comment), folder / f"{name}.hex")
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.netfuzz.record", description=__doc__)
    parser.add_argument("--protocol", action="append", choices=PROTOCOLS, help="[all]")
    parser.add_argument("--out", type=Path, default=SESSIONS, help="[tests/netfuzz/sessions]")
    args = parser.parse_args(argv)
    written = asyncio.run(record(args.protocol or list(PROTOCOLS), args.out))
    for protocol, count in written.items():
        print(f"{protocol:<9} {count} sessions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
