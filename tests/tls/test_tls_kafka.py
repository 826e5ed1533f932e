"""Kafka over TLS (``kafka_tls``): confluent-kafka and kafka-python with ``SSL`` (a
client certificate naming the account, Kafka's SSL principal) and ``SASL_SSL`` (a
password over TLS, the existing SASL code); Metadata names the TLS port to a client
that came in over TLS."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from kafka import KafkaConsumer, KafkaProducer

from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.live_server import LiveServer, live_gateways, server_config
from tests.tls.conftest import ACCOUNTS, PASSWORD, USER, Certs, tls_overrides, tls_server

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("kafka-tls")
    with tls_server(data_dir, certs, ("kafka", "kafka_tls")) as s:
        yield s


def _ssl(server: LiveServer, certs: Certs) -> dict[str, Any]:
    """librdkafka's SSL with a client certificate: no SASL, the CN is the account."""
    host, port = server.address("kafka_tls")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SSL",
        "ssl.ca.location": str(certs.ca),
        "ssl.certificate.location": str(certs.client_chain),
        "ssl.key.location": str(certs.client_key),
    }


def _sasl_ssl(server: LiveServer, certs: Certs) -> dict[str, Any]:
    host, port = server.address("kafka_tls")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(certs.ca),
        "sasl.mechanism": "PLAIN",
        "sasl.username": USER,
        "sasl.password": PASSWORD,
    }


def test_confluent_ssl_certificate_then_sasl_ssl_password(server: LiveServer, certs: Certs) -> None:
    """Produced as the certificate's account (SSL), consumed as the same account with a
    password (SASL_SSL): one namespace, so the certificate named the account."""
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    ssl = _ssl(server, certs)
    producer = confluent_producer(ssl.pop("bootstrap.servers"), **ssl)
    for i in range(3):
        producer.produce(topic, f"m{i}".encode())
    assert producer.flush(TIMEOUT_S) == 0
    sasl = _sasl_ssl(server, certs)
    consumer = confluent_consumer(sasl.pop("bootstrap.servers"), f"g-{topic}", **sasl)
    try:
        consumer.subscribe([topic])
        got = confluent_consume(consumer, 3, timeout=TIMEOUT_S)
    finally:
        consumer.close()
    assert [m.value() for m in got] == [b"m0", b"m1", b"m2"]


def test_metadata_names_the_tls_port_to_a_tls_client(server: LiveServer, certs: Certs) -> None:
    admin = AdminClient(_sasl_ssl(server, certs))
    brokers = admin.list_topics(timeout=TIMEOUT_S).brokers
    assert {b.port for b in brokers.values()} == {server.port("kafka_tls")}
    plain = AdminClient(
        {
            "bootstrap.servers": "{}:{}".format(*server.address("kafka")),
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.username": USER,
            "sasl.password": PASSWORD,
        }
    )
    brokers = plain.list_topics(timeout=TIMEOUT_S).brokers
    assert {b.port for b in brokers.values()} == {server.port("kafka")}


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
def test_kafka_python_round_trip(server: LiveServer, certs: Certs, protocol: str) -> None:
    topic = f"kp-{protocol.lower()}-{uuid.uuid4().hex[:6]}"
    common: dict[str, Any] = {
        "bootstrap_servers": "{}:{}".format(*server.address("kafka_tls")),
        "security_protocol": protocol,
        "ssl_cafile": str(certs.ca),
        "request_timeout_ms": 20_000,
    }
    if protocol == "SSL":
        common.update(ssl_certfile=str(certs.client_chain), ssl_keyfile=str(certs.client_key))
    else:
        common.update(
            sasl_mechanism="PLAIN", sasl_plain_username=USER, sasl_plain_password=PASSWORD
        )
    producer = KafkaProducer(**common)
    try:
        producer.send(topic, b"over tls").get(timeout=TIMEOUT_S)
    finally:
        producer.close()
    consumer = KafkaConsumer(
        topic, auto_offset_reset="earliest", consumer_timeout_ms=int(TIMEOUT_S * 1000), **common
    )
    try:
        values = [next(consumer).value]
    finally:
        consumer.close()
    assert values == [b"over tls"]


def test_two_gateways_metadata_lists_each_tls_port(
    tmp_path: Path, certs: Certs, server_form: str
) -> None:
    """Over two gateways, a TLS client is told both gateways' TLS ports (their
    plaintext ports to a plaintext client), and produces through whichever leads."""
    listeners = ("kafka", "kafka_tls")
    config = dataclasses.replace(
        server_config(tmp_path, listeners, tls_overrides(certs)), auth=ACCOUNTS
    )
    with live_gateways(tmp_path, listeners, 2, config=config) as gateways:
        first = gateways[0]
        admin = AdminClient(_sasl_ssl(first, certs))
        brokers = admin.list_topics(timeout=TIMEOUT_S).brokers
        assert {b.port for b in brokers.values()} == {g.port("kafka_tls") for g in gateways}
        topic = f"two-{uuid.uuid4().hex[:8]}"
        ssl = _ssl(first, certs)
        producer = confluent_producer(ssl.pop("bootstrap.servers"), **ssl)
        producer.produce(topic, b"via either")
        assert producer.flush(TIMEOUT_S) == 0
