"""Kafka over ``polymq run --workers 2`` with confluent-kafka: a client bootstraps on
the shared port and Metadata names each worker as a broker at its own port (a shared
port cannot send a client to one worker, which a group's coordinator needs), a
consumer group commits on its coordinator's worker and a second consumer resumes
there, a transactional producer's commit and abort are honoured."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from tests.workers.helpers import (
    TIMEOUT,
    Workers,
    consume_values,
    produce_values,
    running_workers,
    wait_until,
)

ONE_FORM = True  # starts its own server processes


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with running_workers(tmp_path_factory.mktemp("kafka-workers") / "data") as running:
        # Each worker learns the others from navigation at its next heartbeat.
        wait_until(lambda: len(_broker_ports(running)) == 2, "both workers listed as brokers")
        yield running


def _broker_ports(workers: Workers) -> list[int]:
    producer = Producer({"bootstrap.servers": _bootstrap(workers)})
    return sorted(b.port for b in producer.list_topics(timeout=TIMEOUT).brokers.values())


def _bootstrap(workers: Workers) -> str:
    return f"127.0.0.1:{workers.port('kafka')}"


def _topic(workers: Workers, partitions: int = 4) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": _bootstrap(workers)})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(TIMEOUT)
    return name


def test_metadata_names_each_worker_at_its_own_port(workers: Workers) -> None:
    # A worker lists another once its own heartbeat to the parent's directory brought
    # that one, which may come after the workers say they are ready, and each bootstrap
    # connection lands on either worker: so one full answer says that worker knows,
    # not the other (a clean run failed on that). Both know once answers agree 8 times
    # in a row.
    expected = sorted(workers.kafka_ports.values())
    deadline = time.monotonic() + TIMEOUT
    agreeing = 0
    answers: list[list[int]] = []
    while agreeing < 8:
        assert time.monotonic() < deadline, f"never 8 answers in a row of {expected}: {answers}"
        answers = [*answers[-15:], _broker_ports(workers)]
        agreeing = agreeing + 1 if answers[-1] == expected else 0
    assert workers.port("kafka") not in workers.kafka_ports.values()


def test_consumer_group_commits_and_resumes(workers: Workers) -> None:
    topic = _topic(workers)
    produce_values(workers, topic, range(100))
    group = f"g-{uuid.uuid4().hex[:8]}"
    settings = {
        "bootstrap.servers": _bootstrap(workers),
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    }
    first = Consumer(settings)
    first.subscribe([topic])
    seen = consume_values(first, 100)
    first.commit(asynchronous=False)
    first.close()
    produce_values(workers, topic, range(100, 150))
    second = Consumer(settings)
    second.subscribe([topic])
    resumed = consume_values(second, 50)
    second.close()
    assert sorted(seen) == list(range(100))
    assert sorted(resumed) == list(range(100, 150))  # nothing before the commit again


def test_transactional_producer(workers: Workers) -> None:
    topic = _topic(workers, partitions=2)
    producer = Producer(
        {"bootstrap.servers": _bootstrap(workers), "transactional.id": f"tx-{uuid.uuid4().hex}"}
    )
    producer.init_transactions(TIMEOUT)
    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, str(i).encode())
    producer.commit_transaction(TIMEOUT)
    producer.begin_transaction()
    for i in range(10, 20):
        producer.produce(topic, str(i).encode())
    producer.abort_transaction(TIMEOUT)
    producer.begin_transaction()
    producer.produce(topic, b"20")
    producer.commit_transaction(TIMEOUT)
    consumer = Consumer(
        {
            "bootstrap.servers": _bootstrap(workers),
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    got = consume_values(consumer, 11)
    consumer.close()
    assert sorted(got) == [*range(10), 20]
