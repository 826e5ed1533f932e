"""SASL PLAIN and SCRAM-SHA-256/512 against the gateway's accounts: the user decides
the namespace; wrong passwords and requests before authentication are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from kafka import KafkaConsumer, KafkaProducer
from kio.schema.errors import ErrorCode

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.protocols.kafka.listener import kafka_listener
from polymq.storage.model import QueueRef
from tests.kafka.clients import (
    confluent_consume,
    confluent_consumer,
    confluent_producer,
    run_node,
)
from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer, live_server, server_config

NAMESPACE = "tenant-k"
ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(AccountConfig(user="alice", password="alice-secret", namespaces=(NAMESPACE,)),),
)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("kafka-sasl")
    config = dataclasses.replace(server_config(data_dir, ("kafka",)), auth=ACCOUNTS)
    with live_server(data_dir, ("kafka",), config=config, factories={"kafka": kafka_listener}) as s:
        yield s


def _sasl(secure: LiveServer, mechanism: str, password: str = "alice-secret") -> dict[str, Any]:
    host, port = secure.address("kafka")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": "alice",
        "sasl.password": password,
    }


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_confluent_authenticates_into_the_users_namespace(
    secure: LiveServer, topic: str, mechanism: str
) -> None:
    options = _sasl(secure, mechanism)
    bootstrap = options.pop("bootstrap.servers")
    producer = confluent_producer(bootstrap, **options)
    producer.produce(topic, value=b"secret")
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}", **options)
    consumer.subscribe([topic])
    try:
        assert confluent_consume(consumer, 1)[0].value() == b"secret"
    finally:
        consumer.close()
    queue = QueueRef(NAMESPACE, topic, 0)
    offsets = secure.call(lambda: secure.gateway.storage.queue_offsets(queue))
    assert offsets.latest == 1


def test_wrong_password_is_refused(secure: LiveServer) -> None:
    admin = AdminClient({**_sasl(secure, "SCRAM-SHA-256", "wrong"), "socket.timeout.ms": 3000})
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=3)


def _python_client_sasl(secure: LiveServer, mechanism: str) -> dict[str, Any]:
    """kafka-python's and aiokafka's spelling of the same settings."""
    host, port = secure.address("kafka")
    return dict(
        bootstrap_servers=f"{host}:{port}",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism,
        sasl_plain_username="alice",
        sasl_plain_password="alice-secret",
    )


def test_kafka_python_sasl(secure: LiveServer, topic: str) -> None:
    options = _python_client_sasl(secure, "SCRAM-SHA-512")
    producer = KafkaProducer(**options)
    assert producer.send(topic, b"v").get(10).offset == 0
    producer.close()
    consumer = KafkaConsumer(
        topic, auto_offset_reset="earliest", consumer_timeout_ms=3000, **options
    )
    assert [m.value for m in consumer] == [b"v"]
    consumer.close()


def test_requests_before_authentication_close_the_connection(secure: LiveServer) -> None:
    with RawKafka(*secure.address("kafka")) as client:
        versions = client.request(18, 3, {})
        assert versions.error_code is ErrorCode.none  # allowed before SASL
        client.send_bytes(client.frame(3, 12, {"topics": None}))
        assert client.closed_by_server()
    with RawKafka(*secure.address("kafka")) as client:
        answer = client.request(17, 1, {"mechanism": "GSSAPI"})
        assert answer.error_code is ErrorCode.unsupported_sasl_mechanism
        assert "PLAIN" in answer.mechanisms
    with RawKafka(*secure.address("kafka")) as client:
        assert client.request(17, 1, {"mechanism": "PLAIN"}).error_code is ErrorCode.none
        failed = client.request(36, 2, {"auth_bytes": b"\0alice\0wrong"})
        assert failed.error_code is ErrorCode.sasl_authentication_failed
        assert client.closed_by_server()


async def test_aiokafka_scram(secure: LiveServer, topic: str) -> None:
    options = _python_client_sasl(secure, "SCRAM-SHA-256")
    producer = AIOKafkaProducer(**options)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"async-secret")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, auto_offset_reset="earliest", **options)
    await consumer.start()
    try:
        async with asyncio.timeout(30):
            message = await consumer.getone()
    finally:
        await consumer.stop()
    assert message.value == b"async-secret"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize("mechanism", ["plain", "scram-sha-256", "scram-sha-512"])
def test_kafkajs_sasl(secure: LiveServer, topic: str, mechanism: str) -> None:
    host, port = secure.address("kafka")
    args = [f"{host}:{port}", topic, mechanism, "alice", "alice-secret"]
    done = run_node("kafka_sasl.js", *args)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"value": f"via-{mechanism}"}
    refused = run_node("kafka_sasl.js", f"{host}:{port}", topic, mechanism, "alice", "wrong")
    assert refused.returncode == 1
    assert "SASL" in refused.stderr or "uthentication" in refused.stderr


def test_authenticated_connections_are_identified(secure: LiveServer) -> None:
    with RawKafka(*secure.address("kafka")) as client:
        client.request(17, 1, {"mechanism": "PLAIN"})
        assert client.request(36, 2, {"auth_bytes": b"\0alice\0alice-secret"}).error_code is (
            ErrorCode.none
        )
        connections = secure.gateway.connections.list(protocol="kafka")
        assert [(c.principal.name if c.principal else None, c.namespace) for c in connections] == [
            ("alice", NAMESPACE)
        ]
