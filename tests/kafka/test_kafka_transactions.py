"""Transactions with confluent-kafka: committed records reach read_committed consumers,
aborted ones never do, and offsets sent with a transaction commit with it."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import TopicPartition

from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer

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
