"""Kafka transactions in the separated form (issue 17, item 4): 3 storage nodes, 2
gateways, the transaction coordinator on one gateway and the partition leader on the
other, topics on different nodes. read_committed consumers see committed records once
the transaction commits, never aborted ones, and nothing of an open transaction;
read_uncommitted consumers see everything at once. With confluent-kafka and aiokafka.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from polymq.gateway.cluster_tool import LocalCluster
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.kafka.cluster_form import bootstrap, kafka_cluster, node_of, owner, unique_name

pytestmark = pytest.mark.asyncio(loop_scope="module")

READ_COMMITTED = {"isolation.level": "read_committed"}
READ_UNCOMMITTED = {"isolation.level": "read_uncommitted"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    async with kafka_cluster(tmp_path_factory.mktemp("kafka-txn")) as local:
        yield local


def _split_roles(prefix: str) -> tuple[str, str]:
    """A topic and a transactional id whose leader and coordinator are different
    gateways."""
    while True:
        topic = unique_name(prefix)
        txn = f"tx-{topic}"
        if owner(f"{topic}/0") != owner(txn):
            return topic, txn


async def _create(cluster: LocalCluster, *topics: str) -> dict[str, str]:
    """Create 1-partition topics; topic -> the storage node holding it."""
    admin = AdminClient({"bootstrap.servers": bootstrap(cluster)})
    futures = admin.create_topics([NewTopic(t, num_partitions=1) for t in topics])
    for future in futures.values():
        await asyncio.to_thread(future.result, 30)
    return {t: await node_of(cluster, t) for t in topics}


def _values(servers: str, topic: str, isolation: dict[str, str], count: int) -> list[bytes | None]:
    consumer = confluent_consumer(servers, unique_name("g"), **isolation)
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        values = [m.value() for m in confluent_consume(consumer, count)]
        assert consumer.poll(1.0) is None  # nothing more (aborted records skipped)
    finally:
        consumer.close()
    return values


async def test_committed_then_aborted_with_confluent(cluster: LocalCluster) -> None:
    topic, txn = _split_roles("txa")
    await _create(cluster, topic)
    servers = bootstrap(cluster)

    def produce() -> None:
        producer = confluent_producer(servers, **{"transactional.id": txn})
        producer.init_transactions(30)
        producer.begin_transaction()
        for i in range(3):
            producer.produce(topic, value=b"committed-%d" % i)
        producer.commit_transaction(30)
        producer.begin_transaction()
        for i in range(3):
            producer.produce(topic, value=b"aborted-%d" % i)
        producer.flush(30)
        producer.abort_transaction(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"after")
        producer.commit_transaction(30)

    await asyncio.to_thread(produce)
    for gateway in ("gateway-1", "gateway-2"):
        committed = await asyncio.to_thread(
            _values, bootstrap(cluster, gateway), topic, READ_COMMITTED, 4
        )
        assert committed == [b"committed-0", b"committed-1", b"committed-2", b"after"]
    everything = await asyncio.to_thread(_values, servers, topic, READ_UNCOMMITTED, 7)
    assert b"aborted-1" in everything


async def test_open_then_committed_over_two_nodes_with_confluent(cluster: LocalCluster) -> None:
    topic, txn = _split_roles("txo")
    for _ in range(20):  # a second topic, on another node than the first
        other = unique_name("txo")
        # The first topic once; then only the new candidate (the same name twice in
        # one CreateTopics gets two answers for it, which librdkafka cannot parse).
        nodes = await _create(cluster, *((topic, other) if _ == 0 else (other,)))
        if len(set(await asyncio.gather(node_of(cluster, topic), node_of(cluster, other)))) == 2:
            break
    else:
        raise AssertionError(f"no topic placed on another node than {topic}: {nodes}")
    servers = bootstrap(cluster)
    plain = confluent_producer(servers)
    for name in (topic, other):
        plain.produce(name, value=b"before")
    assert await asyncio.to_thread(plain.flush, 30) == 0
    producer = confluent_producer(servers, **{"transactional.id": txn})

    def begin() -> None:
        producer.init_transactions(30)
        producer.begin_transaction()
        for name in (topic, other):
            producer.produce(name, value=b"pending")
        producer.flush(30)

    await asyncio.to_thread(begin)

    def hold_back_then_see() -> None:
        consumers = []
        try:
            for name in (topic, other):
                consumer = confluent_consumer(servers, unique_name("g"), **READ_COMMITTED)
                consumer.assign([TopicPartition(name, 0, 0)])
                consumers.append(consumer)
                assert [m.value() for m in confluent_consume(consumer, 1)] == [b"before"]
                assert consumer.poll(1.0) is None  # the open transaction is not stable
            producer.commit_transaction(30)
            for consumer in consumers:
                assert [m.value() for m in confluent_consume(consumer, 1)] == [b"pending"]
        finally:
            for consumer in consumers:
                consumer.close()

    await asyncio.to_thread(hold_back_then_see)


async def test_aiokafka_transactions(cluster: LocalCluster) -> None:
    topic, txn = _split_roles("txk")
    await _create(cluster, topic)
    servers = bootstrap(cluster)
    producer = AIOKafkaProducer(bootstrap_servers=servers, transactional_id=txn)
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"kept")
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"dropped")
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send_and_wait(topic, b"kept-too")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=servers,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    values: list[bytes | None] = []
    try:
        async with asyncio.timeout(60):
            while len(values) < 2:
                batches = await consumer.getmany(timeout_ms=200)
                values += [m.value for messages in batches.values() for m in messages]
        assert await consumer.getmany(timeout_ms=500) == {}
    finally:
        await consumer.stop()
    assert values == [b"kept", b"kept-too"]
