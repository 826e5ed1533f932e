"""Compaction of `cleanup.policy=compact` topics: the pure plan, the engine call it
becomes, and a real partition compacted after produces, read by a Kafka client and as
single messages."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from crc32c import crc32c

from polymq.protocols.kafka.compaction import Entry, is_compacted, keep_offsets, plan_partition
from polymq.protocols.kafka.listener import KafkaListener, kafka_listener
from polymq.protocols.kafka.records import (
    BATCH_FORMAT,
    KafkaRecord,
    encode_batch,
    iter_records,
    parse_header,
)
from polymq.storage.model import UNLIMITED, QueueRef, StoredBatch
from tests.kafka.clients import (
    confluent_consume,
    confluent_consumer,
    confluent_producer,
    wait_until,
)
from tests.live_server import LiveServer, live_server


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


def _stored_batch(base: int, records: list[KafkaRecord], *, producer_id: int = -1) -> StoredBatch:
    raw = bytearray(encode_batch(base, records, producer_id=producer_id, producer_epoch=0))
    struct.pack_into(">i", raw, 53, 40)  # base sequence
    struct.pack_into(">I", raw, 17, crc32c(bytes(raw[21:])))
    return StoredBatch(
        queue=QueueRef("default", "t", 0),
        base_offset=base,
        count=len(records),
        store_timestamp_ms=1000,
        format=BATCH_FORMAT,
        raw=bytes(raw),
    )


def test_the_engine_call_drops_whole_batches_and_rewrites_partial_ones() -> None:
    def record(delta: int, key: bytes, value: bytes | None) -> KafkaRecord:
        return KafkaRecord(offset_delta=delta, timestamp_ms=1000 + delta, key=key, value=value)

    first = _stored_batch(0, [record(0, b"a", b"1"), record(1, b"b", b"1"), record(2, b"c", b"1")])
    second = _stored_batch(
        3, [record(0, b"a", b"2"), record(1, b"b", b"2"), record(2, b"d", b"2")], producer_id=77
    )
    third = _stored_batch(6, [record(0, b"d", b"3")])
    plan = plan_partition([first, second, third], now_ms=10_000, delete_retention_ms=1000)
    assert sorted(plan.drop) == [0, 1, 5]  # a, b superseded; d superseded at 6
    assert set(plan.rewrite) == {0, 3}
    kept_first = plan.rewrite[0]
    header = parse_header(kept_first.raw)  # the CRC is right
    assert header.last_offset_delta == 2 and header.record_count == 1
    assert [(r.offset_delta, r.key) for r in iter_records(kept_first.raw)] == [(2, b"c")]
    assert [m.key for m in kept_first.messages] == [None, None, b"c"]  # one per offset
    kept_second = parse_header(plan.rewrite[3].raw)
    assert (kept_second.producer_id, kept_second.base_sequence) == (77, 40)
    assert kept_second.last_offset_delta == 2 and kept_second.record_count == 2
    untouched = plan_partition([third], now_ms=10_000, delete_retention_ms=1000)
    assert untouched.drop == [] and untouched.rewrite == {}


def _offsets(bootstrap: str, topic: str) -> tuple[int, int]:
    consumer = confluent_consumer(bootstrap, f"probe-{topic}")
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    finally:
        consumer.close()
    return int(low), int(high)


def _consumed(bootstrap: str, topic: str, count: int) -> list[Message]:
    consumer = confluent_consumer(bootstrap, f"g-{topic}-{count}")
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        return confluent_consume(consumer, count)
    finally:
        consumer.close()


def _stored_offsets(server: LiveServer, topic: str) -> list[int]:
    queue = QueueRef("default", topic, 0)
    result = server.call(lambda: server.gateway.storage.read(queue, 0, max_messages=100))
    return [m.offset for m in result.messages]


def test_a_compacted_partition_keeps_each_keys_latest_record(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    if not hasattr(server.gateway.storage, "compact"):
        pytest.skip("this form's storage has no compact yet (ClusterStorage: asked for)")
    listener = server.gateway.listeners.get("kafka")
    assert isinstance(listener, KafkaListener)
    listener.services.compactor.interval_s = 0.2
    plain = f"{topic}-plain"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    compacted = NewTopic(topic, 1, config={"cleanup.policy": "compact", "delete.retention.ms": "0"})
    for future in admin.create_topics([compacted, NewTopic(plain, 1)]).values():
        future.result(10)
    producer = confluent_producer(bootstrap, **{"linger.ms": 50})
    for name in (topic, plain):
        # offsets 0-5: k0..k4 and k6; 6-10: k0..k3 again and k4's tombstone; 11: k5
        for k in (0, 1, 2, 3, 4, 6):
            producer.produce(name, key=b"k%d" % k, value=b"v1-%d" % k)
        assert producer.flush(30) == 0
        for k in range(5):
            producer.produce(name, key=b"k%d" % k, value=None if k == 4 else b"v2-%d" % k)
        assert producer.flush(30) == 0
        producer.produce(name, key=b"k5", value=b"v1-5")
        assert producer.flush(30) == 0
    # kept: k6 (5), k0..k3's second values (6-9), k5 (11, the last); k4's tombstone
    # (10) is past delete.retention.ms 0 and not the last record: gone with k4.
    kept = [5, 6, 7, 8, 9, 11]
    wait_until(lambda: _stored_offsets(server, topic) == kept, what="compaction")
    got = _consumed(bootstrap, topic, len(kept))
    assert [m.offset() for m in got] == kept
    assert {m.key(): m.value() for m in got} == {
        **{b"k%d" % k: b"v2-%d" % k for k in range(4)},
        b"k5": b"v1-5",
        b"k6": b"v1-6",
    }
    assert _offsets(bootstrap, topic) == (0, 12)  # offsets never move, as in Kafka
    # compact alone: kept until compacted away, never aged out by time retention
    info = server.call(lambda: server.gateway.storage.describe_topic("default", topic))
    assert info.config.retention_ms == UNLIMITED
    # other protocols read the same records, one message per kept offset
    queue = QueueRef("default", topic, 0)
    read = server.call(lambda: server.gateway.storage.read(queue, 0, max_messages=100))
    assert [(m.offset, m.message.body) for m in read.messages] == [
        (5, b"v1-6"),
        *((6 + k, b"v2-%d" % k) for k in range(4)),
        (11, b"v1-5"),
    ]
    assert _offsets(bootstrap, plain) == (0, 12)  # delete policy: untouched
    assert len(_consumed(bootstrap, plain, 12)) == 12


def test_compaction_outlives_a_restart(tmp_path: Path) -> None:
    topic = "compacted-restart"
    with live_server(tmp_path, ("kafka",), factories={"kafka": kafka_listener}) as live:
        if not hasattr(live.gateway.storage, "compact"):
            pytest.skip("this form's storage has no compact yet")
        listener = live.gateway.listeners.get("kafka")
        assert isinstance(listener, KafkaListener)
        listener.services.compactor.interval_s = 0.1
        bootstrap = "{}:{}".format(*live.address("kafka"))
        admin = AdminClient({"bootstrap.servers": bootstrap})
        config = {"cleanup.policy": "compact"}
        admin.create_topics([NewTopic(topic, 1, config=config)])[topic].result(10)
        producer = confluent_producer(bootstrap)
        for i in range(20):
            producer.produce(topic, key=b"k%d" % (i % 4), value=b"v%d" % i)
            assert producer.flush(30) == 0  # one batch per record: each can go
        wait_until(lambda: _stored_offsets(live, topic) == [16, 17, 18, 19], what="compaction")
    with live_server(tmp_path, ("kafka",), factories={"kafka": kafka_listener}) as live:
        bootstrap = "{}:{}".format(*live.address("kafka"))
        got = _consumed(bootstrap, topic, 4)
        assert [(m.offset(), m.value()) for m in got] == [
            (16 + i, b"v%d" % (16 + i)) for i in range(4)
        ]
        assert _offsets(bootstrap, topic) == (0, 20)
