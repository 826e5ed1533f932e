"""A Kafka connection goes on storing while an ``acks=all`` produce waits for its
fsync (protocols/kafka/answers.py): with the commit log's fsync held, records produced
after one waiting for it are stored and reach a consumer, and every delivery report
waits for the fsync, then all come in order.

Merged form only: the separated form's storage client answers once durable, so there
a produce is still answered one fsync at a time (docs/kafka.md)."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import KafkaError, Message, TopicPartition

from polymq.protocols.kafka.listener import kafka_listener
from tests.held_fsync import WAIT_S, HeldFsync
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.live_server import live_server

ONE_FORM = True  # see the docstring

TOPIC = "held"


def test_produces_are_stored_while_an_earlier_one_waits_for_its_fsync(
    tmp_path: Path, held_fsync: HeldFsync
) -> None:
    with live_server(tmp_path, ("kafka",), factories={"kafka": kafka_listener}) as server:
        host, port = server.address("kafka")
        bootstrap = f"{host}:{port}"
        producer = confluent_producer(bootstrap, **{"linger.ms": 0, "acks": "all"})
        reports: list[bytes] = []

        def report(error: KafkaError | None, message: Message) -> None:
            assert error is None, error
            value = message.value()
            assert value is not None
            reports.append(value)

        producer.produce(TOPIC, b"first", on_delivery=report)
        assert producer.flush(WAIT_S) == 0  # the topic exists before the fsync is held
        held_fsync.armed.set()
        producer.produce(TOPIC, b"held", on_delivery=report)
        producer.poll(0)
        assert held_fsync.entered.wait(WAIT_S), "no fsync was asked for"
        producer.produce(TOPIC, b"after", on_delivery=report)
        producer.produce(TOPIC, b"and after", on_delivery=report)
        producer.poll(0)
        consumer = confluent_consumer(bootstrap, "held-reader")
        consumer.assign([TopicPartition(TOPIC, 0, 0)])  # no group writes: they would wait
        try:
            values = [m.value() for m in confluent_consume(consumer, 4)]
        finally:
            consumer.close()
        assert values == [b"first", b"held", b"after", b"and after"]
        producer.poll(0)
        assert reports == [b"first"], "a produce was answered before its fsync"
        held_fsync.released.set()
        assert producer.flush(WAIT_S) == 0
        assert reports == [b"first", b"held", b"after", b"and after"]
