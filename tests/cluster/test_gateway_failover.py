"""Kill a gateway (SIGKILL) while Kafka clients produce and consume through it: they
find the other gateway in the Metadata answers (which come from navigation), carry on
there, and every acknowledged record is still consumed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from polymq.gateway.cluster_tool import LocalCluster

_TIMEOUT_S = 90.0


def _bootstrap(cluster: LocalCluster, gateway: str) -> str:
    host, port = cluster.address(gateway, "kafka")
    return f"{host}:{port}"


def _produce(producer: Producer, topic: str, values: range, acked: set[bytes]) -> None:
    def delivered(err: KafkaError | None, msg: object) -> None:
        if err is None:
            acked.add(msg.value())  # type: ignore[attr-defined]

    for i in values:
        producer.produce(topic, f"v{i}".encode(), on_delivery=delivered)
        producer.poll(0)
    deadline = time.monotonic() + _TIMEOUT_S
    while len(producer) and time.monotonic() < deadline:
        producer.flush(1.0)


def _consume_until(consumer: Consumer, wanted: set[bytes], seen: set[bytes]) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not wanted <= seen and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None and (value := msg.value()) is not None:
            seen.add(value)
            with contextlib.suppress(KafkaException):  # mid-rebalance: the next one lands
                consumer.commit(asynchronous=False)


def _wait_for_brokers(bootstrap: str, count: int) -> None:
    """Until Metadata through ``bootstrap`` lists ``count`` gateways (navigation has
    told it of the others)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + _TIMEOUT_S
    while len(admin.list_topics(timeout=10).brokers) < count:
        assert time.monotonic() < deadline, "Metadata never listed every gateway"
        time.sleep(0.1)


async def test_kafka_clients_move_to_the_other_gateway(cluster: LocalCluster) -> None:
    topic = f"failover-{uuid.uuid4().hex[:8]}"
    # Both clients know only gateway-1: gateway-2 reaches them through Metadata.
    bootstrap = _bootstrap(cluster, "gateway-1")
    await asyncio.to_thread(_wait_for_brokers, bootstrap, 2)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": int(_TIMEOUT_S * 1000),
            "topic.metadata.refresh.interval.ms": 1000,
            "reconnect.backoff.max.ms": 500,
        }
    )
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "topic.metadata.refresh.interval.ms": 1000,
            "reconnect.backoff.max.ms": 500,
            "session.timeout.ms": 6000,
        }
    )
    acked: set[bytes] = set()
    seen: set[bytes] = set()
    try:
        await asyncio.to_thread(_produce, producer, topic, range(200), acked)
        assert len(acked) == 200
        consumer.subscribe([topic])
        await asyncio.to_thread(_consume_until, consumer, set(list(acked)[:1]), seen)
        assert seen, "the consumer read nothing before the kill"

        await cluster.kill("gateway-1")

        await asyncio.to_thread(_produce, producer, topic, range(200, 400), acked)
        assert len(acked) == 400, "records produced after the kill were not acknowledged"
        await asyncio.to_thread(_consume_until, consumer, acked, seen)
        assert acked <= seen, f"{len(acked - seen)} acknowledged records never arrived"
    finally:
        consumer.close()
