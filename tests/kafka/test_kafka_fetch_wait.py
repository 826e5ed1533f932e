"""A consumer's fetch long-polls (``max_wait``, librdkafka's ``fetch.wait.max.ms``) and is
answered on the append that makes a record readable, not when its wait runs out: a
consumer at an everyday rate sees each record about one fsync after it was produced."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Producer
from kio.schema.errors import ErrorCode

from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer

# Far beyond the socket's read timeout below: an answer at all means the append woke it.
WAIT_MS = 600_000
ANSWER_TIMEOUT_S = 30.0


def _fetch(topic: str, partitions: int) -> dict[str, Any]:
    return {
        "replica_id": -1,
        "max_wait": WAIT_MS,
        "min_bytes": 1,
        "max_bytes": 1 << 20,
        "topics": [
            {
                "topic": topic,
                "partitions": [
                    {"partition": p, "fetch_offset": 0, "partition_max_bytes": 1 << 16}
                    for p in range(partitions)
                ],
            }
        ],
    }


def _produce(server: LiveServer, topic: str, partition: int) -> None:
    host, port = server.address("kafka")
    producer = Producer({"bootstrap.servers": f"{host}:{port}", "acks": "all", "linger.ms": 0})
    producer.produce(topic, b"wake up", partition=partition)
    assert producer.flush(30) == 0


def _waiting_fetch_gets(server: LiveServer, topic: str, partitions: int, into: int) -> None:
    with RawKafka(*server.address("kafka"), timeout=ANSWER_TIMEOUT_S) as client:
        created = client.request(
            19,
            3,
            {
                "topics": [
                    {
                        "name": topic,
                        "num_partitions": partitions,
                        "replication_factor": 1,
                        "assignments": [],
                        "configs": [],
                    }
                ],
                "timeout": 30_000,
                "validate_only": False,
            },
        )
        assert created.topics[0].error_code is ErrorCode.none
        # The fetch is read (and parked: the topic is empty) before the produce, which
        # comes from another connection after it was sent.
        client.send_bytes(client.frame(1, 4, _fetch(topic, partitions)))
        _produce(server, topic, into)
        answer = client.response(1, 4)  # a socket timeout here: the append did not wake it
    (partition,) = [p for p in answer.responses[0].partitions if p.records]
    assert partition.partition_index == into
    assert partition.error_code is ErrorCode.none
    assert b"wake up" in partition.records


def test_a_waiting_fetch_of_one_partition_wakes_on_the_append(
    server: LiveServer, topic: str
) -> None:
    _waiting_fetch_gets(server, topic, partitions=1, into=0)


def test_a_waiting_fetch_of_several_partitions_wakes_on_any_append(
    server: LiveServer, topic: str
) -> None:
    _waiting_fetch_gets(server, topic, partitions=3, into=2)
