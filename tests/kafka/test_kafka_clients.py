"""Produce and consume with kafka-python, aiokafka and confluent-kafka against a real
gateway: every compression codec, keys, headers, offsets, timestamps and the storage
view other protocols get."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kafka import KafkaConsumer, KafkaProducer
from kafka import TopicPartition as KTopicPartition

from polymq.protocols import interop
from polymq.storage.model import AppendRequest, Message, QueueRef
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.live_server import LiveServer

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]


@pytest.mark.parametrize("codec", CODECS)
def test_confluent_round_trip_with_every_codec(bootstrap: str, topic: str, codec: str) -> None:
    producer = confluent_producer(bootstrap, **{"compression.type": codec, "acks": "all"})
    for i in range(200):
        producer.produce(topic, key=b"k%d" % i, value=b"value-%d" % i, headers=[("h", b"%d" % i)])
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.subscribe([topic])
    try:
        got = confluent_consume(consumer, 200)
    finally:
        consumer.close()
    assert [m.offset() for m in got] == list(range(200))
    assert [m.value() for m in got] == [b"value-%d" % i for i in range(200)]
    assert got[7].key() == b"k7"
    assert got[7].headers() == [("h", b"7")]


def test_kafka_python_round_trip_and_offsets(bootstrap: str, topic: str) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, compression_type="gzip", acks="all")
    futures = [producer.send(topic, key=b"k", value=b"v%d" % i) for i in range(50)]
    producer.flush(30)
    assert [f.get(10).offset for f in futures] == list(range(50))
    producer.close()
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=3000
    )
    partition = KTopicPartition(topic, 0)
    consumer.assign([partition])
    assert consumer.beginning_offsets([partition]) == {partition: 0}
    assert consumer.end_offsets([partition]) == {partition: 50}
    consumer.seek(partition, 45)
    values = [m.value for m in consumer]
    consumer.close()
    assert values == [b"v%d" % i for i in range(45, 50)]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_aiokafka_round_trip(bootstrap: str, topic: str, codec: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec)
    await producer.start()
    try:
        batch = producer.create_batch()
        for i in range(20):
            batch.append(key=None, value=b"a%d" % i, timestamp=None)
        await (await producer.send_batch(batch, topic, partition=0))
        await producer.send_and_wait(topic, b"last", key=b"k", headers=[("x", b"y")])
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=f"g-{topic}", auto_offset_reset="earliest"
    )
    await consumer.start()
    got = []
    try:
        async with asyncio.timeout(30):
            async for message in consumer:
                got.append(message)
                if len(got) == 21:
                    break
    finally:
        await consumer.stop()
    assert [m.value for m in got[:20]] == [b"a%d" % i for i in range(20)]
    assert (got[20].key, got[20].value, list(got[20].headers)) == (b"k", b"last", [("x", b"y")])


def test_seek_to_timestamp(bootstrap: str, topic: str) -> None:
    producer = confluent_producer(bootstrap)
    base = int(time.time() * 1000) - 100_000
    for i in range(10):
        producer.produce(topic, value=b"%d" % i, timestamp=base + i * 1000)
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, 0, base + 4500)], timeout=10)
        assert found[0].offset == 5
        later = consumer.offsets_for_times([TopicPartition(topic, 0, base + 99_000)], timeout=10)
        assert later[0].offset == -1
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (low, high) == (0, 10)
    finally:
        consumer.close()


def test_records_are_single_messages_for_other_protocols(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    producer = confluent_producer(bootstrap, **{"compression.type": "lz4"})
    producer.produce(
        topic, key=b"key", value=b"hello", headers=[(interop.TAG, b"t1"), ("user", b"u")]
    )
    producer.produce(topic, value=b"second")
    assert producer.flush(30) == 0
    engine = server.gateway.storage
    result = server.call(lambda: engine.read(QueueRef("default", topic, 0), 0))
    messages = [m.message for m in result.messages]
    assert [m.body for m in messages] == [b"hello", b"second"]
    assert (messages[0].key, messages[0].tag, messages[0].properties) == (
        b"key",
        "t1",
        (("user", b"u"),),
    )


def test_messages_of_other_protocols_arrive_as_record_batches(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1)])[topic].result(10)
    engine = server.gateway.storage
    queue = QueueRef("default", topic, 0)
    sent = [
        Message(body=b"from-amqp", key=b"rk", content_type="text/plain", born_timestamp_ms=1234),
        Message(body=b"plain"),
    ]
    server.call(lambda: engine.append([AppendRequest(entry=m, queues=(queue,)) for m in sent]))
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.subscribe([topic])
    try:
        got = confluent_consume(consumer, 2)
    finally:
        consumer.close()
    assert [m.value() for m in got] == [b"from-amqp", b"plain"]
    assert got[0].key() == b"rk"
    assert got[0].headers() == [(interop.CONTENT_TYPE, b"text/plain")]
    assert got[0].timestamp()[1] == 1234
