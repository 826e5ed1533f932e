"""A server killed with SIGKILL keeps what Kafka acknowledged: every record produced
with acks=all whose delivery report came back, and every synchronously committed group
offset. (test_kafka_durability.py covers a clean restart only.)"""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import KafkaError, Message, TopicPartition

from tests.crash_server import crash_server
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer

TOPIC = "crash-durable"
COUNT = 30
COMMITTED = 12


def test_acked_records_and_commits_survive_a_sigkill(tmp_path: Path) -> None:
    delivered: list[bytes] = []

    def report(error: KafkaError | None, message: Message) -> None:
        assert error is None, error
        value = message.value()
        assert value is not None
        delivered.append(value)

    with crash_server(tmp_path, "kafka") as port:
        bootstrap = f"127.0.0.1:{port}"
        producer = confluent_producer(bootstrap, acks="all", **{"enable.idempotence": True})
        for i in range(COUNT):
            producer.produce(TOPIC, value=b"%d" % i, on_delivery=report)
        assert producer.flush(30) == 0
        assert len(delivered) == COUNT
        producer.close()  # idle now; left open it would retry the dead server noisily
        consumer = confluent_consumer(bootstrap, "crash-group")
        consumer.assign([TopicPartition(TOPIC, 0, 0)])
        confluent_consume(consumer, COMMITTED)
        consumer.commit(offsets=[TopicPartition(TOPIC, 0, COMMITTED)], asynchronous=False)
        consumer.close()
        # killed here: records and the commit were acknowledged, nothing flushed on exit
    with crash_server(tmp_path, "kafka") as port:
        bootstrap = f"127.0.0.1:{port}"
        everything = confluent_consumer(bootstrap, "crash-fresh")
        everything.assign([TopicPartition(TOPIC, 0, 0)])
        values = [m.value() for m in confluent_consume(everything, COUNT)]
        everything.close()
        resumed = confluent_consumer(bootstrap, "crash-group")
        resumed.subscribe([TOPIC])
        rest = [m.value() for m in confluent_consume(resumed, COUNT - COMMITTED)]
        resumed.close()
    assert values == delivered == [b"%d" % i for i in range(COUNT)]
    assert rest == [b"%d" % i for i in range(COMMITTED, COUNT)]
