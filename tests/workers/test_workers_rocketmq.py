"""RocketMQ 5 over ``polymq run --workers 2`` with the official Python client: the
gRPC port is shared too (the workers' grpc servers bind it with SO_REUSEPORT), and a
producer and a simple consumer, whose connections land on either worker, exchange
every message (RocketMQ's state is storage's: any worker serves any call)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

from tests.workers.helpers import TIMEOUT, Workers, running_workers

ONE_FORM = True  # starts its own server processes


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with running_workers(tmp_path_factory.mktemp("rocketmq-workers") / "data") as running:
        yield running


def test_producer_and_simple_consumer(workers: Workers) -> None:
    topic, group = f"rt-{uuid.uuid4().hex[:8]}", f"rg-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{workers.port('kafka')}"})
    for future in admin.create_topics([NewTopic(topic, 4, 1)]).values():
        future.result(TIMEOUT)
    config = ClientConfiguration(f"127.0.0.1:{workers.port('rocketmq')}", Credentials("", ""))
    consumer = SimpleConsumer(config, group, {topic: FilterExpression()}, await_duration=3)
    consumer.startup()
    producer = Producer(config, (topic,))
    producer.startup()
    try:
        for i in range(10):
            message = Message()
            message.topic, message.body = topic, f"r{i}".encode()
            producer.send(message)
        got: list[Any] = []
        deadline = time.monotonic() + TIMEOUT
        while len(got) < 10:
            assert time.monotonic() < deadline, f"received {len(got)} of 10"
            for received in consumer.receive(32, 15):
                got.append(received)
                consumer.ack(received)
        assert sorted(m.body for m in got) == [f"r{i}".encode() for i in range(10)]
    finally:
        producer.shutdown()
        consumer.shutdown()
