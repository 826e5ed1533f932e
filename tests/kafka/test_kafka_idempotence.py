"""The idempotent producer: InitProducerId, retries answered once, gaps rejected."""

from __future__ import annotations

import struct
from typing import Any

from confluent_kafka import TopicPartition
from crc32c import crc32c
from kafka import KafkaProducer
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka.records import KafkaRecord, encode_batch
from polymq.storage.model import QueueRef
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer


def _idempotent_batch(producer_id: int, epoch: int, sequence: int, count: int) -> bytes:
    records = [
        KafkaRecord(offset_delta=i, timestamp_ms=1, key=None, value=b"s%d" % (sequence + i))
        for i in range(count)
    ]
    batch = bytearray(encode_batch(0, records))
    struct.pack_into(">qhi", batch, 43, producer_id, epoch, sequence)
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[21:])))
    return bytes(batch)


def _produce(client: RawKafka, topic: str, records: bytes) -> Any:
    body = {
        "acks": -1,
        "timeout": 5000,
        "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": records}]}],
    }
    return client.request(0, 9, body).responses[0].partition_responses[0]


def test_retries_are_stored_once_and_gaps_are_refused(server: LiveServer, topic: str) -> None:
    with RawKafka(*server.address("kafka")) as client:
        client.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        init = client.request(22, 4, {"transactional_id": None, "transaction_timeout": 60000})
        assert init.error_code is ErrorCode.none
        pid = init.producer_id
        first = _produce(client, topic, _idempotent_batch(pid, 0, 0, 3))
        second = _produce(client, topic, _idempotent_batch(pid, 0, 3, 2))
        retry = _produce(client, topic, _idempotent_batch(pid, 0, 0, 3))
        assert (first.base_offset, second.base_offset) == (0, 3)
        assert retry.error_code is ErrorCode.none and retry.base_offset == 0
        gap = _produce(client, topic, _idempotent_batch(pid, 0, 9, 1))
        assert gap.error_code is ErrorCode.out_of_order_sequence_number
        following = _produce(client, topic, _idempotent_batch(pid, 0, 5, 1))
        assert following.error_code is ErrorCode.none and following.base_offset == 5
    queue = QueueRef("default", topic, 0)
    offsets = server.call(lambda: server.gateway.storage.queue_offsets(queue))
    assert offsets.latest == 6


def test_confluent_idempotent_producer(bootstrap: str, topic: str) -> None:
    producer = confluent_producer(bootstrap, **{"enable.idempotence": True, "acks": "all"})
    for i in range(500):
        producer.produce(topic, value=b"%d" % i)
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        got = confluent_consume(consumer, 500)
    finally:
        consumer.close()
    assert [m.value() for m in got] == [b"%d" % i for i in range(500)]


def test_kafka_python_idempotent_producer(bootstrap: str, topic: str) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    futures = [producer.send(topic, value=b"%d" % i) for i in range(100)]
    producer.flush(30)
    producer.close()
    assert [f.get(10).offset for f in futures] == list(range(100))


def test_idempotent_producer_on_the_longest_topic_name(bootstrap: str, topic: str) -> None:
    longest = (topic + "-" + "x" * 249)[:249]
    producer = confluent_producer(bootstrap, **{"enable.idempotence": True})
    delivered: list[str | None] = []
    for i in range(3):
        producer.produce(
            longest,
            value=b"%d" % i,
            on_delivery=lambda error, _: delivered.append(error.name() if error else None),
        )
    assert producer.flush(30) == 0
    assert delivered == [None, None, None]
