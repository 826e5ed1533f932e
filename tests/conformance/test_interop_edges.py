"""The losses docs/interop.md states, shown with real clients: what a target cannot
carry arrives as the page says (the matrix checks the lossless fields)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from kafka import KafkaProducer

from polymq.conformance.interop.drive_kafka import KafkaDriver
from polymq.conformance.interop.drive_mns import MnsDriver
from polymq.conformance.interop.drive_mqtt import MqttDriver
from polymq.conformance.interop.drive_rocketmq import RocketMQDriver
from polymq.protocols import interop
from tests.live_server import LiveServer, live_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LISTENERS = ("kafka", "amqp", "mqtt", "rocketmq", "http")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("edges"), LISTENERS) as live:
        yield live


@pytest.fixture(scope="module")
def kafka(server: LiveServer) -> Iterator[KafkaProducer]:
    producer = KafkaProducer(bootstrap_servers=f"{server.host}:{server.port('kafka')}")
    yield producer
    producer.close(timeout=5)


def _topic() -> str:
    return f"edge-{uuid.uuid4().hex[:8]}"


def _create_one_queue(server: LiveServer, topic: str) -> None:
    """The topic made the way a Kafka admin makes it: one partition."""
    kafka = KafkaDriver(server.host, server.port("kafka"))
    try:
        kafka.prepare(topic)
    finally:
        kafka.close()


def _send(producer: KafkaProducer, topic: str, body: bytes, **fields: Any) -> None:
    producer.send(topic, body, **fields).get(timeout=20)


def test_a_binary_body_reaches_mns_as_replacement_characters(
    server: LiveServer, kafka: KafkaProducer
) -> None:
    mns = MnsDriver(server.host, server.port("http"))
    try:
        topic = _topic()
        mns.prepare(topic)
        _send(kafka, topic, b"\xff\x00ok")  # not UTF-8, and NUL is no XML character
        assert mns.consume(topic, 20).body == "\ufffd\ufffdok".encode()
    finally:
        mns.close()


def test_rocketmq_splits_a_key_at_its_spaces_and_keeps_one_value_per_name(
    server: LiveServer, kafka: KafkaProducer
) -> None:
    rocketmq = RocketMQDriver(server.host, server.port("rocketmq"))
    try:
        topic = _topic()
        _create_one_queue(server, topic)
        headers = [("n", b"1"), ("n", b"2")]
        _send(kafka, topic, b"x", key=b"two keys", headers=headers)
        arrived = rocketmq.consume(topic, 20)
        assert arrived.key == "keys two"  # the keys {"two", "keys"}, sorted by the driver
        assert arrived.properties == {"n": "1"}  # a map: the first value wins
    finally:
        rocketmq.close()


def test_mqtt_keeps_the_order_and_repeats_of_headers(
    server: LiveServer, kafka: KafkaProducer
) -> None:
    mqtt = MqttDriver(server.host, server.port("mqtt"))
    try:
        topic = _topic()
        mqtt.prepare(topic)
        _send(kafka, topic, b"x", headers=[("n", b"2"), ("m", b"0"), ("n", b"1")])
        message = mqtt.next_message(topic, 20)
        user = message.properties.UserProperty
        assert [p for p in user if not interop.is_private(p[0])] == [
            ("n", "2"),
            ("m", "0"),
            ("n", "1"),
        ]
    finally:
        mqtt.close()


def test_amqp_scalar_headers_arrive_as_text_and_tables_stay_in_amqp(
    server: LiveServer,
) -> None:
    topic = _topic()
    kafka = KafkaDriver(server.host, server.port("kafka"))
    connection = pika.BlockingConnection(
        pika.ConnectionParameters(server.host, server.port("amqp"), heartbeat=0)
    )
    try:
        kafka.prepare(topic)
        channel = connection.channel()
        channel.confirm_delivery()
        channel.exchange_declare(topic, "fanout", arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
        headers = {"n": 7, "flag": True, "table": {"a": 1}, "text": "t"}
        channel.basic_publish(topic, "rk", b"x", pika.BasicProperties(headers=headers))
        arrived = kafka.consume(topic, 20)
        assert arrived.properties == {"n": "7", "flag": "True", "text": "t"}
        assert arrived.key == "rk"
    finally:
        connection.close()
        kafka.close()
