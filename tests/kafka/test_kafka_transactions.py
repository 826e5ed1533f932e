"""Transactions with confluent-kafka: committed records reach read_committed consumers,
aborted ones never do, and offsets sent with a transaction commit with it."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import TopicPartition

from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer

READ_COMMITTED = {"isolation.level": "read_committed"}


def test_commit_and_abort_with_read_committed(bootstrap: str, topic: str) -> None:
    producer = confluent_producer(bootstrap, **{"transactional.id": f"tx-{topic}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"committed-%d" % i)
    producer.commit_transaction(10)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"aborted-%d" % i)
    producer.flush(10)
    producer.abort_transaction(10)
    producer.begin_transaction()
    producer.produce(topic, value=b"after")
    producer.commit_transaction(10)

    committed = confluent_consumer(bootstrap, f"rc-{topic}", **READ_COMMITTED)
    committed.assign([TopicPartition(topic, 0, 0)])
    try:
        values = [m.value() for m in confluent_consume(committed, 4)]
        assert committed.poll(1.0) is None  # nothing else: the aborted ones are skipped
    finally:
        committed.close()
    assert values == [b"committed-0", b"committed-1", b"committed-2", b"after"]

    everything = confluent_consumer(
        bootstrap, f"ru-{topic}", **{"isolation.level": "read_uncommitted"}
    )
    everything.assign([TopicPartition(topic, 0, 0)])
    try:
        values = [m.value() for m in confluent_consume(everything, 7)]
    finally:
        everything.close()
    assert b"aborted-1" in values


def test_open_transaction_holds_back_read_committed(bootstrap: str, topic: str) -> None:
    plain = confluent_producer(bootstrap)
    plain.produce(topic, value=b"before")
    assert plain.flush(10) == 0
    producer = confluent_producer(bootstrap, **{"transactional.id": f"tx-{topic}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    producer.produce(topic, value=b"pending")
    producer.flush(10)
    consumer = confluent_consumer(bootstrap, f"rc-{topic}", **READ_COMMITTED)
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        assert [m.value() for m in confluent_consume(consumer, 1)] == [b"before"]
        assert consumer.poll(1.0) is None  # the open transaction is not stable yet
        producer.commit_transaction(10)
        assert [m.value() for m in confluent_consume(consumer, 1)] == [b"pending"]
    finally:
        consumer.close()


def test_offsets_commit_with_the_transaction(bootstrap: str, topic: str) -> None:
    group = f"g-{topic}"
    producer = confluent_producer(bootstrap, **{"transactional.id": f"tx-{topic}"})
    producer.init_transactions(10)
    consumer = confluent_consumer(bootstrap, group)
    try:
        for commit, offset in ((False, 3), (True, 5)):
            producer.begin_transaction()
            producer.produce(topic, value=b"x")
            producer.send_offsets_to_transaction(
                [TopicPartition(topic, 0, offset)], consumer.consumer_group_metadata(), 10
            )
            if commit:
                producer.commit_transaction(10)
            else:
                producer.abort_transaction(10)
        committed = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        assert committed[0].offset == 5
    finally:
        consumer.close()


async def test_aiokafka_transactions(bootstrap: str, topic: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"tx-{topic}")
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
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    values: list[bytes | None] = []
    try:
        async with asyncio.timeout(30):
            while len(values) < 2:
                batches = await consumer.getmany(timeout_ms=200)
                values += [m.value for messages in batches.values() for m in messages]
        assert await consumer.getmany(timeout_ms=500) == {}
    finally:
        await consumer.stop()
    assert values == [b"kept", b"kept-too"]


def _list_latest(client: RawKafka, topic: str, isolation: int) -> int:
    body = {
        "replica_id": -1,
        "isolation_level": isolation,
        "topics": [{"name": topic, "partitions": [{"partition_index": 0, "timestamp": -1}]}],
    }
    return int(client.request(2, 5, body).topics[0].partitions[0].offset)


def _fetch_committed(client: RawKafka, topic: str) -> Any:
    body = {
        "replica_id": -1,
        "max_wait": 0,
        "min_bytes": 0,
        "max_bytes": 1 << 20,
        "isolation_level": 1,
        "topics": [
            {
                "topic": topic,
                "partitions": [{"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}],
            }
        ],
    }
    return client.request(1, 11, body).responses[0].partitions[0]


def test_last_stable_offset_and_aborted_ranges_on_the_wire(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    """Fetch's last_stable_offset and aborted_transactions, and ListOffsets' latest
    for read_committed (the last stable offset), while a transaction is open and
    after it aborted."""
    plain = confluent_producer(bootstrap)
    plain.produce(topic, value=b"before")  # offset 0
    assert plain.flush(10) == 0
    producer = confluent_producer(bootstrap, **{"transactional.id": f"tx-{topic}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    producer.produce(topic, value=b"pending")  # offset 1
    producer.flush(10)
    with RawKafka(*server.address("kafka")) as client:
        assert (_list_latest(client, topic, 0), _list_latest(client, topic, 1)) == (2, 1)
        open_fetch = _fetch_committed(client, topic)
        assert (open_fetch.high_watermark, open_fetch.last_stable_offset) == (2, 1)
        producer.abort_transaction(10)  # its marker at offset 2
        assert (_list_latest(client, topic, 0), _list_latest(client, topic, 1)) == (3, 3)
        aborted = _fetch_committed(client, topic)
    assert (aborted.high_watermark, aborted.last_stable_offset) == (3, 3)
    [abort] = aborted.aborted_transactions
    assert abort.producer_id >= 0 and abort.first_offset <= 1
