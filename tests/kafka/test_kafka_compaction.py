"""Compaction of `cleanup.policy=compact` topics: the pure plan, and the compactor
moving a real partition's log start past its superseded prefix after produces."""

from __future__ import annotations

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from protocols.kafka.compaction import Entry, is_compacted, keep_offsets
from protocols.kafka.listener import KafkaListener
from tests.kafka.clients import (
    confluent_consume,
    confluent_consumer,
    confluent_producer,
    wait_until,
)
from tests.live_server import LiveServer


def test_the_plan_keeps_each_keys_latest_and_young_tombstones() -> None:
    entries = [
        Entry(0, b"a", False, 1000),
        Entry(1, b"b", False, 1000),
        Entry(2, None, False, 1000),  # keyless (another protocol's message): kept
        Entry(3, b"a", False, 1000),
        Entry(4, b"b", True, 1000),  # b's tombstone, old
        Entry(5, b"c", True, 9500),  # c's tombstone, young
        Entry(6, b"d", False, 1000),
        Entry(7, b"d", True, 1000),  # the last record: kept, as Kafka's active segment
    ]
    keep = keep_offsets(entries, now_ms=10_000, delete_retention_ms=1000)
    assert keep == {2, 3, 5, 7}
    assert keep_offsets([], now_ms=0, delete_retention_ms=0) == set()
    assert is_compacted("compact") and is_compacted("delete,compact")
    assert not is_compacted("delete") and not is_compacted(None)


def _offsets(bootstrap: str, topic: str) -> tuple[int, int]:
    consumer = confluent_consumer(bootstrap, f"probe-{topic}")
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    finally:
        consumer.close()
    return int(low), int(high)


def test_a_compacted_partition_drops_its_superseded_prefix(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    listener = server.gateway.listeners.get("kafka")
    assert isinstance(listener, KafkaListener)
    listener.broker.compactor.interval_s = 0.2
    plain = f"{topic}-plain"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    compacted = NewTopic(topic, 1, config={"cleanup.policy": "compact", "delete.retention.ms": "0"})
    for future in admin.create_topics([compacted, NewTopic(plain, 1)]).values():
        future.result(10)
    producer = confluent_producer(bootstrap)
    for name in (topic, plain):
        for round_ in (1, 2):
            for k in range(5):
                value = None if (round_, k) == (2, 4) else b"v%d-%d" % (round_, k)
                producer.produce(name, key=b"k%d" % k, value=value)
            assert producer.flush(30) == 0
        producer.produce(name, key=b"k5", value=b"v1-5")
        assert producer.flush(30) == 0
    # k0..k4 at 0-4 are superseded by 5-9 (k4's tombstone, with delete.retention.ms 0,
    # goes too, but sits behind kept records): the log now starts at 5.
    wait_until(lambda: _offsets(bootstrap, topic) == (5, 11), what="compaction")
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        got = confluent_consume(consumer, 6)
    finally:
        consumer.close()
    assert [m.offset() for m in got] == list(range(5, 11))
    latest = {m.key(): m.value() for m in got}
    assert latest == {
        **{b"k%d" % k: b"v2-%d" % k for k in range(4)},
        b"k4": None,
        b"k5": b"v1-5",
    }
    assert _offsets(bootstrap, plain) == (0, 11)  # delete policy: untouched
