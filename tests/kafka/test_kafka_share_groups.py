"""KIP-932 share groups with confluent-kafka's ShareConsumer: queue semantics over the
storage's pop mode (each record to one member, per-record acks, delivery counts)."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import AcknowledgeType, Message, ShareConsumer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kio.schema.errors import ErrorCode

from tests.kafka.clients import confluent_producer
from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer

LIMIT_S = 30.0


def _topic_with(bootstrap: str, topic: str, partitions: int, count: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions)])[topic].result(10)
    producer = confluent_producer(bootstrap)
    for i in range(count):
        producer.produce(topic, value=b"%d" % i, partition=i % partitions)
    assert producer.flush(30) == 0


def _share_consumer(bootstrap: str, group: str, **extra: Any) -> ShareConsumer:
    return ShareConsumer({"bootstrap.servers": bootstrap, "group.id": group, **extra})


def _poll(consumer: ShareConsumer, timeout: float = 0.3) -> list[Message]:
    return [m for m in consumer.poll(timeout) or [] if m.error() is None]


def test_members_share_the_records_once_each(bootstrap: str, topic: str) -> None:
    _topic_with(bootstrap, topic, 2, 40)
    members = [_share_consumer(bootstrap, f"s-{topic}") for _ in range(2)]
    got: list[list[bytes]] = [[], []]
    try:
        for member in members:
            member.subscribe([topic])
        deadline = time.monotonic() + LIMIT_S
        while sum(map(len, got)) < 40 and time.monotonic() < deadline:
            for i, member in enumerate(members):
                got[i] += [m.value() or b"" for m in _poll(member, 0.1)]
        # Implicit mode: the next poll accepts what the previous one returned.
        for member in members:
            got_more = _poll(member, 0.5)
            assert got_more == []
    finally:
        for member in members:
            member.close()
    everything = got[0] + got[1]
    assert sorted(everything) == sorted(b"%d" % i for i in range(40))  # each exactly once


def test_release_redelivers_and_reject_archives(bootstrap: str, topic: str) -> None:
    _topic_with(bootstrap, topic, 1, 3)
    consumer = _share_consumer(
        bootstrap, f"s-{topic}", **{"share.acknowledgement.mode": "explicit"}
    )
    consumer.subscribe([topic])
    try:
        first: list[Message] = []
        deadline = time.monotonic() + LIMIT_S
        while len(first) < 3 and time.monotonic() < deadline:
            first += _poll(consumer)
        assert [m.value() for m in first] == [b"0", b"1", b"2"]
        assert {m.delivery_count() for m in first} == {1}
        consumer.acknowledge(first[0], AcknowledgeType.RELEASE)
        consumer.acknowledge(first[1], AcknowledgeType.REJECT)
        consumer.acknowledge(first[2], AcknowledgeType.ACCEPT)
        consumer.commit_sync(10)
        again: list[Message] = []
        deadline = time.monotonic() + LIMIT_S
        while not again and time.monotonic() < deadline:
            again = _poll(consumer)
        assert [(m.value(), m.delivery_count()) for m in again] == [(b"0", 2)]
        consumer.acknowledge(again[0], AcknowledgeType.ACCEPT)
        consumer.commit_sync(10)
        assert _poll(consumer, 1.0) == []
    finally:
        consumer.close()


def test_share_group_describe_lists_members_and_assignments(server: LiveServer, topic: str) -> None:
    host, port = server.address("kafka")
    _topic_with(f"{host}:{port}", topic, 3, 0)
    group = f"s-{topic}"
    with RawKafka(host, port) as client:
        joined = client.request(
            76,
            1,
            {
                "group_id": group,
                "member_id": "",
                "member_epoch": 0,
                "subscribed_topic_names": [topic],
            },
        )
        assert joined.error_code is ErrorCode.none
        answer = client.request(77, 1, {"group_ids": [group, f"{group}-absent"]})
    found, absent = answer.groups
    assert absent.error_code is ErrorCode.group_id_not_found
    assert (found.error_code, found.group_state, found.assignor_name) == (
        ErrorCode.none,
        "Stable",
        "simple",
    )
    [member] = found.members
    assert member.member_id == joined.member_id
    assert (member.client_id, member.client_host) == ("raw", "/127.0.0.1")
    assert list(member.subscribed_topic_names) == [topic]
    [assigned] = member.assignment.topic_partitions
    assert (assigned.topic_name, list(assigned.partitions)) == (topic, [0, 1, 2])
