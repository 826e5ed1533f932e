"""Natural names (docs/interop.md): exchange ``T`` is storage topic ``T`` both ways,
and ``amq.topic`` follows RabbitMQ's MQTT convention, with unmodified clients (pika,
kafka-python, paho-mqtt) and no polymq-specific argument, across two gateways."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pika
import pytest
from kafka import KafkaConsumer, KafkaProducer
from paho.mqtt.enums import CallbackAPIVersion
from pika.adapters.blocking_connection import BlockingChannel

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.storage.model import DEFAULT_NAMESPACE
from tests.live_server import LiveServer, live_gateways

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WAIT_S = 30.0
CALLER = Caller(principal=ANONYMOUS, namespace=DEFAULT_NAMESPACE, protocol="test")


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[list[LiveServer]]:
    with live_gateways(tmp_path_factory.mktemp("natural"), ("amqp", "kafka", "mqtt"), 2) as servers:
        yield servers


def _channel(server: LiveServer) -> tuple[pika.BlockingConnection, BlockingChannel]:
    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", server.port("amqp"), heartbeat=0)
    )
    channel = connection.channel()
    channel.confirm_delivery()
    return connection, channel


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _drain(
    channel: BlockingChannel, queue: str, want: int, settle_s: float = 2.0
) -> list[tuple[pika.spec.Basic.GetOk, bytes]]:
    """Every message of ``queue``: ``want`` of them, then ``settle_s`` more to see
    any duplicate arrive."""
    got: list[tuple[pika.spec.Basic.GetOk, bytes]] = []
    deadline = time.monotonic() + WAIT_S
    quiet_until: float | None = None
    while time.monotonic() < deadline:
        method, _, body = channel.basic_get(queue, auto_ack=True)
        if method is not None:
            got.append((method, body))
            continue
        if len(got) >= want:
            if quiet_until is None:
                quiet_until = time.monotonic() + settle_s
            elif time.monotonic() >= quiet_until:
                break
        time.sleep(0.05)
    return got


def test_kafka_records_reach_the_queues_bound_to_the_exchange_once_each(
    gateways: list[LiveServer],
) -> None:
    """Kafka topic T -> exchange T's bindings, the record key as routing key; both
    gateways run the feed, each record reaches each bound queue once."""
    topic = _name("orders")
    conns = [_channel(server) for server in gateways]
    try:
        ch = conns[0][1]
        ch.exchange_declare(topic, "topic", durable=True)
        eu, everything, us = _name("eu"), _name("all"), _name("us")
        for queue, key in ((eu, "eu.*"), (everything, "#"), (us, "us.*")):
            ch.queue_declare(queue, durable=True)
            ch.queue_bind(queue, topic, key)
        conns[1][1].queue_declare(eu, passive=True)  # the second gateway serves the vhost
        producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{gateways[1].port('kafka')}")
        try:
            for i in range(5):
                producer.send(topic, key=b"eu.new", value=f"r{i}".encode())
            producer.flush(timeout=WAIT_S)
        finally:
            producer.close()
        got_eu = _drain(ch, eu, 5)
        assert sorted(body for _, body in got_eu) == [f"r{i}".encode() for i in range(5)]
        method = got_eu[0][0]
        assert (method.exchange, method.routing_key) == (topic, "eu.new")
        assert len(_drain(ch, everything, 5)) == 5
        assert _drain(ch, us, 0, settle_s=0.5) == []
    finally:
        for connection, _ in conns:
            connection.close()


def test_amqp_publishes_to_an_exchange_reach_kafka_and_mqtt_consumers_of_the_topic(
    gateways: list[LiveServer],
) -> None:
    """Exchange T -> Kafka topic T (record key = routing key) and MQTT ``T/#`` (routing
    key ``a.b`` as ``T/a/b``), with no binding at all."""
    topic = _name("events")
    received: list[tuple[str, bytes]] = []
    subscribed = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = lambda _c, _u, m: received.append((m.topic, bytes(m.payload)))
    client.connect("127.0.0.1", gateways[1].port("mqtt"))
    client.loop_start()
    connection, ch = _channel(gateways[0])
    try:
        client.subscribe(f"{topic}/#", qos=1)
        assert subscribed.wait(WAIT_S)
        ch.exchange_declare(topic, "direct", durable=True)
        ch.basic_publish(topic, "eu.new", b"hello")
        consumer = KafkaConsumer(
            topic,
            bootstrap_servers=f"127.0.0.1:{gateways[1].port('kafka')}",
            auto_offset_reset="earliest",
            consumer_timeout_ms=int(WAIT_S * 1000),
        )
        try:
            record = next(iter(consumer))
        finally:
            consumer.close()
        assert (record.key, record.value) == (b"eu.new", b"hello")
        deadline = time.monotonic() + WAIT_S
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        assert received == [(f"{topic}/eu/new", b"hello")]
    finally:
        connection.close()
        client.loop_stop()
        client.disconnect()


def test_rabbitmq_mqtt_convention_on_amq_topic(gateways: list[LiveServer]) -> None:
    """MQTT ``a/b/c`` is routing key ``a.b.c`` on ``amq.topic``: a queue bound with
    ``a.#`` gets MQTT publishes, an AMQP publish to ``amq.topic`` reaches MQTT."""
    first = _name("sensors")
    received: list[tuple[str, bytes]] = []
    subscribed = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = lambda _c, _u, m: received.append((m.topic, bytes(m.payload)))
    client.connect("127.0.0.1", gateways[1].port("mqtt"))
    client.loop_start()
    connection, ch = _channel(gateways[0])
    try:
        queue = _name("q")
        ch.queue_declare(queue, durable=True)
        ch.queue_bind(queue, "amq.topic", f"{first}.#")
        client.subscribe(f"{first}/#", qos=1)
        assert subscribed.wait(WAIT_S)
        client.publish(f"{first}/room1/temp", b"21", qos=1).wait_for_publish(WAIT_S)
        [(method, body)] = _drain(ch, queue, 1)
        assert (method.exchange, method.routing_key, body) == (
            "amq.topic",
            f"{first}.room1.temp",
            b"21",
        )
        ch.basic_publish("amq.topic", f"{first}.room2.temp", b"19")
        deadline = time.monotonic() + WAIT_S
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(received) == [
            (f"{first}/room1/temp", b"21"),
            (f"{first}/room2/temp", b"19"),
        ]
        # The AMQP publish was routed by AMQP itself: the bound queue has it once.
        [(again, body)] = _drain(ch, queue, 1)
        assert (again.routing_key, body) == (f"{first}.room2.temp", b"19")
    finally:
        connection.close()
        client.loop_stop()
        client.disconnect()


def test_the_operator_excludes_exchanges_by_pattern_without_client_changes(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> None:
    """``[amqp] natural_topics_exclude``: an excluded exchange makes no topic and is
    not fed; the others still are."""
    overrides = {"amqp.natural_topics_exclude": "private-*"}
    with live_gateways(
        tmp_path_factory.mktemp("natural-exclude"), ("amqp", "kafka"), 1, overrides=overrides
    ) as (server,):
        connection, ch = _channel(server)
        try:
            hidden, shown = _name("private"), _name("public")
            for exchange in (hidden, shown):
                ch.exchange_declare(exchange, "fanout", durable=True)
                ch.basic_publish(exchange, "k", b"x")
            topics = server.call(lambda: server.gateway.processor.list_topics(CALLER))
            names = {t.name for t in topics}
            assert shown in names and hidden not in names
        finally:
            connection.close()


def test_natural_names_can_be_turned_off(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> None:
    overrides = {"amqp.natural_topics": "false"}
    with live_gateways(
        tmp_path_factory.mktemp("natural-off"), ("amqp",), 1, overrides=overrides
    ) as (server,):
        connection, ch = _channel(server)
        try:
            exchange = _name("plain")
            ch.exchange_declare(exchange, "fanout", durable=True)
            ch.basic_publish(exchange, "k", b"x")
            ch.basic_publish("amq.topic", f"{exchange}.a", b"x")
            topics = server.call(lambda: server.gateway.processor.list_topics(CALLER))
            assert exchange not in {t.name for t in topics}
        finally:
            connection.close()
