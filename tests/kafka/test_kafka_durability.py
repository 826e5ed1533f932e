"""What survives a gateway restart (records, committed offsets), and size limits: large
batches near the topic's max.message.bytes pass, larger ones get MESSAGE_TOO_LARGE."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from polymq.protocols.kafka.listener import kafka_listener
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.live_server import live_server


def test_records_and_commits_survive_a_restart(tmp_path: Path) -> None:
    factories = {"kafka": kafka_listener}
    with live_server(tmp_path, ("kafka",), factories=factories) as server:
        host, port = server.address("kafka")
        bootstrap = f"{host}:{port}"
        producer = confluent_producer(bootstrap, **{"compression.type": "snappy"})
        for i in range(20):
            producer.produce("durable", value=b"%d" % i)
        assert producer.flush(30) == 0
        consumer = confluent_consumer(bootstrap, "resume")
        consumer.subscribe(["durable"])
        confluent_consume(consumer, 20)
        consumer.commit(offsets=[TopicPartition("durable", 0, 12)], asynchronous=False)
        consumer.close()
    with live_server(tmp_path, ("kafka",), factories=factories) as server:
        host, port = server.address("kafka")
        bootstrap = f"{host}:{port}"
        consumer = confluent_consumer(bootstrap, "resume")
        consumer.subscribe(["durable"])
        try:
            values = [m.value() for m in confluent_consume(consumer, 8)]
        finally:
            consumer.close()
        assert values == [b"%d" % i for i in range(12, 20)]


def test_large_batches_up_to_the_topic_limit(bootstrap: str, topic: str) -> None:
    limit = 256 * 1024
    admin = AdminClient({"bootstrap.servers": bootstrap})
    config = {"max.message.bytes": str(limit)}
    admin.create_topics([NewTopic(topic, 1, config=config)])[topic].result(10)
    producer = confluent_producer(bootstrap, **{"message.max.bytes": 4 << 20})
    big = b"b" * (limit - 1024)
    producer.produce(topic, value=big)
    assert producer.flush(30) == 0
    errors: list[str] = []
    producer.produce(
        topic,
        value=b"c" * (limit + 1024),
        on_delivery=lambda error, _: errors.append(error.name() if error else "none"),
    )
    producer.flush(30)
    assert errors == ["MSG_SIZE_TOO_LARGE"]
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        assert confluent_consume(consumer, 1)[0].value() == big
    finally:
        consumer.close()
