"""Kafka, judged by the protocol guide and Apache Kafka's documented behaviour
(KIP numbers in the docstrings). Topics are created per case with the Admin API and
deleted afterwards; every consumer group is new."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from polymq.conformance.runner import NotApplicable, Registry, Target

registry = Registry("kafka")
case = registry.case
_WAIT_S = 20.0


def _bootstrap(t: Target) -> str:
    return f"{t.host}:{t.port('kafka')}"


def _conf(t: Target, password: str | None = None, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": _bootstrap(t),
        "socket.timeout.ms": 10000,
        "topic.metadata.refresh.interval.ms": 1000,
        "reconnect.backoff.max.ms": 500,
    }
    if t.user is not None:
        conf |= {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.username": t.user,
            "sasl.password": password or t.password or "",
        }
    return conf | extra


def _python_conf(t: Target) -> dict[str, Any]:
    """kafka-python's and aiokafka's spelling of the same."""
    if t.user is None:
        return {}
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": t.user,
        "sasl_plain_password": t.password or "",
    }


def _topic_name(t: Target) -> str:
    return t.name("topic").replace("-", "_")


@contextmanager
def _topic(t: Target, partitions: int = 1, **config: str) -> Iterator[str]:
    admin = AdminClient(_conf(t))
    name = _topic_name(t)
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=dict(config))])
    futures[name].result(_WAIT_S)
    try:
        yield name
    finally:
        admin.delete_topics([name])[name].result(_WAIT_S)


def _producer(t: Target, **extra: Any) -> Producer:
    return Producer(_conf(t, **{"linger.ms": 5, **extra}))


def _consumer(t: Target, group: str | None = None, **extra: Any) -> Consumer:
    return Consumer(
        _conf(
            t,
            **{
                "group.id": group or t.name("group"),
                "auto.offset.reset": "earliest",
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 500,
                "enable.auto.commit": False,
                **extra,
            },
        )
    )


def _assert_split(topic: str, members: list[Consumer]) -> None:
    """Two members of one group, subscribed to the four partitions of ``topic``, come
    to own them all between them, disjointly (within 30 s); then they are closed."""
    try:
        for m in members:
            m.subscribe([topic])
        deadline = time.monotonic() + 30
        while True:
            for m in members:
                m.poll(0.1)
            owned = [{p.partition for p in m.assignment()} for m in members]
            if all(owned) and owned[0] | owned[1] == {0, 1, 2, 3} and not owned[0] & owned[1]:
                return
            assert time.monotonic() < deadline, f"assignments {owned}"
    finally:
        for m in members:
            m.close()


def _produce(producer: Producer, topic: str, values: list[bytes], **kwargs: Any) -> None:
    errors: list[Any] = []
    for value in values:
        producer.produce(
            topic, value, on_delivery=lambda e, m: errors.append(e) if e else None, **kwargs
        )
    assert producer.flush(_WAIT_S) == 0, "records not delivered in time"
    assert not errors, f"delivery errors: {errors}"


def _consume(consumer: Consumer, count: int, timeout: float = _WAIT_S) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is None:
            continue
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                continue
            raise AssertionError(f"consumer error: {error}")
        got.append(message)
    assert len(got) == count, f"got {len(got)} of {count} records"
    return got


def _drain_marker(consumer: Consumer, marker: bytes, timeout: float = _WAIT_S) -> list[bytes]:
    """Values before ``marker`` (awaited): absence checked without sleeping."""
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is None or message.error() is not None:
            continue
        if message.value() == marker:
            return values
        values.append(bytes(message.value() or b""))
    raise AssertionError(f"marker {marker!r} not consumed within {timeout:g}s")


@case("metadata", "kafka-python")
def metadata(t: Target) -> None:
    """ApiVersions and Metadata: a client bootstraps and sees a created topic's partitions."""
    from kafka import KafkaConsumer

    with _topic(t, partitions=3) as topic:
        consumer = KafkaConsumer(bootstrap_servers=_bootstrap(t), **_python_conf(t))
        try:
            deadline = time.monotonic() + _WAIT_S
            while (parts := consumer.partitions_for_topic(topic)) is None:
                assert time.monotonic() < deadline, "topic not in metadata"
                time.sleep(0.1)
            assert parts == {0, 1, 2}, parts
        finally:
            consumer.close()


@case("sasl-refused", "confluent-kafka")
def sasl_refused(t: Target) -> None:
    """SASL/PLAIN with a wrong password fails authentication (no metadata served)."""
    if not t.auth_enforced or t.user is None:
        raise NotApplicable("the target does not check credentials")
    errors: list[KafkaError] = []
    admin = AdminClient(_conf(t, password="wrong-" + t.run_id, error_cb=errors.append))
    try:
        admin.list_topics(timeout=3)
    except KafkaException:
        deadline = time.monotonic() + 5  # errors reach error_cb through poll()
        while KafkaError._AUTHENTICATION not in {e.code() for e in errors}:
            assert time.monotonic() < deadline, f"no authentication error, only {errors}"
            admin.poll(0.1)
        return
    raise AssertionError("a wrong SASL password was accepted")


@case("produce-consume", "confluent-kafka")
def produce_consume(t: Target) -> None:
    """Keys, values, headers and timestamps come back as produced, at consecutive offsets."""
    with _topic(t) as topic:
        producer = _producer(t, acks="all")
        stamp = int(time.time() * 1000) - 5000
        for i in range(5):
            producer.produce(
                topic,
                f"v{i}".encode(),
                f"k{i}".encode(),
                headers=[("h", b"x"), ("h", b"y")],
                timestamp=stamp + i,
            )
        assert producer.flush(_WAIT_S) == 0
        consumer = _consumer(t)
        consumer.subscribe([topic])
        try:
            got = _consume(consumer, 5)
        finally:
            consumer.close()
        assert [m.value() for m in got] == [f"v{i}".encode() for i in range(5)]
        assert [m.key() for m in got] == [f"k{i}".encode() for i in range(5)]
        assert [m.offset() for m in got] == list(range(5))
        assert all(m.headers() == [("h", b"x"), ("h", b"y")] for m in got), got[0].headers()
        assert [m.timestamp()[1] for m in got] == [stamp + i for i in range(5)]


def _acks_case(t: Target, acks: str) -> None:
    with _topic(t) as topic:
        _produce(_producer(t, acks=acks), topic, [b"a", b"b", b"c"])
        consumer = _consumer(t)
        consumer.subscribe([topic])
        try:
            assert [m.value() for m in _consume(consumer, 3)] == [b"a", b"b", b"c"]
        finally:
            consumer.close()


@case("acks-0", "confluent-kafka")
def acks_0(t: Target) -> None:
    """acks=0: fire and forget, yet the records are stored."""
    _acks_case(t, "0")


@case("acks-all", "confluent-kafka")
def acks_all(t: Target) -> None:
    """acks=all: each produce answered after the write."""
    _acks_case(t, "all")


@case("produce-consume", "kafka-python")
def kafka_python_roundtrip(t: Target) -> None:
    """kafka-python: produce with a key, consume by assignment from the beginning."""
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.structs import TopicPartition as KTopicPartition

    with _topic(t) as topic:
        producer = KafkaProducer(bootstrap_servers=_bootstrap(t), acks="all", **_python_conf(t))
        try:
            for i in range(3):
                producer.send(topic, f"v{i}".encode(), key=b"k").get(_WAIT_S)
        finally:
            producer.close(5)
        consumer = KafkaConsumer(
            bootstrap_servers=_bootstrap(t), consumer_timeout_ms=10000, **_python_conf(t)
        )
        try:
            consumer.assign([KTopicPartition(topic, 0)])
            consumer.seek_to_beginning()
            got = []
            for record in consumer:
                got.append((record.key, record.value))
                if len(got) == 3:
                    break
            assert got == [(b"k", f"v{i}".encode()) for i in range(3)], got
        finally:
            consumer.close()


@case("produce-consume", "aiokafka")
async def aiokafka_roundtrip(t: Target) -> None:
    """aiokafka (asyncio): produce and consume in a group."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    with _topic(t) as topic:
        producer = AIOKafkaProducer(bootstrap_servers=_bootstrap(t), **_python_conf(t))
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"hello", key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=_bootstrap(t),
            group_id=t.name("aiogroup"),
            auto_offset_reset="earliest",
            **_python_conf(t),
        )
        await consumer.start()
        try:
            record = await consumer.getone()
            assert (record.key, record.value) == (b"k", b"hello")
        finally:
            await consumer.stop()


@case("group-commit-resume", "confluent-kafka")
def group_commit_resume(t: Target) -> None:
    """A committed offset is where the group's next member resumes."""
    group = t.name("group")
    with _topic(t) as topic:
        _produce(_producer(t), topic, [f"m{i}".encode() for i in range(6)])
        first = _consumer(t, group)
        first.subscribe([topic])
        try:
            got = _consume(first, 3)
            first.commit(message=got[-1], asynchronous=False)
        finally:
            first.close()
        second = _consumer(t, group)
        second.subscribe([topic])
        try:
            assert [m.value() for m in _consume(second, 3)] == [b"m3", b"m4", b"m5"]
            committed = second.committed([TopicPartition(topic, 0)], timeout=10)
            assert committed[0].offset == 3, committed
        finally:
            second.close()


@case("group-rebalance", "confluent-kafka", timeout_s=40)
def group_rebalance(t: Target) -> None:
    """Two members of one group split a topic's partitions between them, disjointly."""
    group = t.name("group")
    with _topic(t, partitions=4) as topic:
        _assert_split(topic, [_consumer(t, group) for _ in range(2)])


@case("idempotent-producer", "confluent-kafka")
def idempotent_producer(t: Target) -> None:
    """enable.idempotence (KIP-98): InitProducerId and sequenced produce, stored once each."""
    with _topic(t) as topic:
        _produce(
            _producer(t, **{"enable.idempotence": True}),
            topic,
            [f"i{i}".encode() for i in range(10)],
        )
        consumer = _consumer(t)
        consumer.subscribe([topic])
        try:
            got = _consume(consumer, 10)
            assert [m.value() for m in got] == [f"i{i}".encode() for i in range(10)]
            assert _drain_marker_after(t, topic, consumer) == []
        finally:
            consumer.close()


def _drain_marker_after(t: Target, topic: str, consumer: Consumer) -> list[bytes]:
    marker = b"marker-" + uuid.uuid4().hex.encode()
    _produce(_producer(t), topic, [marker])
    return _drain_marker(consumer, marker)


@case("transactions", "confluent-kafka", timeout_s=40)
def transactions(t: Target) -> None:
    """Transactions (KIP-98): read_committed sees committed records, never aborted ones."""
    with _topic(t) as topic:
        producer = _producer(t, **{"transactional.id": t.name("tx")})
        producer.init_transactions(_WAIT_S)
        producer.begin_transaction()
        producer.produce(topic, b"aborted")
        producer.abort_transaction(_WAIT_S)
        producer.begin_transaction()
        producer.produce(topic, b"committed")
        producer.commit_transaction(_WAIT_S)
        consumer = _consumer(t, **{"isolation.level": "read_committed"})
        consumer.subscribe([topic])
        try:
            assert [m.value() for m in _consume(consumer, 1)] == [b"committed"]
            assert _drain_marker_after(t, topic, consumer) == []
        finally:
            consumer.close()


@case("compression", "confluent-kafka")
def compression(t: Target) -> None:
    """Batches compressed with gzip, snappy, lz4 and zstd are consumed intact."""
    codecs = ("gzip", "snappy", "lz4", "zstd")
    with _topic(t) as topic:
        for codec in codecs:
            _produce(_producer(t, **{"compression.type": codec}), topic, [codec.encode() * 50] * 3)
        consumer = _consumer(t)
        consumer.subscribe([topic])
        try:
            got = [m.value() for m in _consume(consumer, 3 * len(codecs))]
            assert got == [c.encode() * 50 for c in codecs for _ in range(3)]
        finally:
            consumer.close()


@case("offsets-for-times", "confluent-kafka")
def offsets_for_times(t: Target) -> None:
    """ListOffsets by timestamp: the first offset at or after the time asked."""
    with _topic(t) as topic:
        base = int(time.time() * 1000) - 60_000
        producer = _producer(t)
        for i in range(3):
            producer.produce(topic, f"t{i}".encode(), timestamp=base + i * 1000)
        assert producer.flush(_WAIT_S) == 0
        consumer = _consumer(t)
        try:
            found = consumer.offsets_for_times([TopicPartition(topic, 0, base + 500)], timeout=10)
            assert found[0].offset == 1, found
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
            assert (low, high) == (0, 3), (low, high)
        finally:
            consumer.close()


@case("create-delete-topic", "confluent-kafka")
def create_delete_topic(t: Target) -> None:
    """CreateTopics twice answers TOPIC_ALREADY_EXISTS; DeleteTopics removes it."""
    admin = AdminClient(_conf(t))
    with _topic(t, partitions=2) as topic:
        try:
            admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(_WAIT_S)
        except KafkaException as e:
            assert e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS, e
        else:
            raise AssertionError("creating an existing topic succeeded")
        assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 2
    from kafka import KafkaAdminClient

    listing = KafkaAdminClient(bootstrap_servers=_bootstrap(t), **_python_conf(t))
    try:
        deadline = time.monotonic() + _WAIT_S
        while topic in listing.list_topics():
            assert time.monotonic() < deadline, "deleted topic still listed"
            time.sleep(0.1)
    finally:
        listing.close()


@case("metadata-all-topics", "confluent-kafka")
def metadata_all_topics(t: Target) -> None:
    """A Metadata request for all topics (null topic list) lists a created topic."""
    with _topic(t) as topic:
        listed = AdminClient(_conf(t)).list_topics(timeout=10).topics
        assert topic in listed, f"{topic} not among {len(listed)} listed topics"


@case("produce-consume", "kafkajs")
def kafkajs_roundtrip(t: Target) -> None:
    """kafkajs (node): create a topic, produce keyed records with headers, consume them in
    a group, delete the topic."""
    from polymq.conformance.cases._node import run_node

    creds = [t.user, t.password or ""] if t.user is not None else []
    topic = _topic_name(t)
    result = run_node("conformance_kafka.js", _bootstrap(t), topic, t.name("group"), *creds)
    assert result["got"] == [[f"k{i}", f"v{i}", f"x{i}"] for i in range(3)], result


@case("delete-records", "confluent-kafka")
def delete_records(t: Target) -> None:
    """DeleteRecords moves the log start: the low watermark and what a consumer reads."""
    with _topic(t) as topic:
        _produce(_producer(t), topic, [b"%d" % i for i in range(10)])
        admin = AdminClient(_conf(t))
        result = next(iter(admin.delete_records([TopicPartition(topic, 0, 4)]).values()))
        assert result.result(_WAIT_S).low_watermark == 4
        consumer = _consumer(t)
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
            assert (low, high) == (4, 10), (low, high)
            consumer.subscribe([topic])
            assert _consume(consumer, 6)[0].value() == b"4"
        finally:
            consumer.close()


@case("create-partitions", "confluent-kafka")
def create_partitions(t: Target) -> None:
    """CreatePartitions grows a topic; shrinking is refused (INVALID_PARTITIONS)."""
    from confluent_kafka.cimpl import NewPartitions

    admin = AdminClient(_conf(t))
    with _topic(t, partitions=2) as topic:
        admin.create_partitions([NewPartitions(topic, 4)])[topic].result(_WAIT_S)
        assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 4
        try:
            admin.create_partitions([NewPartitions(topic, 3)])[topic].result(_WAIT_S)
        except KafkaException as e:
            assert e.args[0].code() == KafkaError.INVALID_PARTITIONS, e
        else:
            raise AssertionError("shrinking a topic succeeded")


@case("topic-configs", "confluent-kafka")
def topic_configs(t: Target) -> None:
    """DescribeConfigs and IncrementalAlterConfigs on retention.ms; an invalid value is
    INVALID_CONFIG."""
    from confluent_kafka.admin._config import AlterConfigOpType, ConfigEntry, ConfigResource
    from confluent_kafka.admin._resource import ResourceType

    admin = AdminClient(_conf(t))
    with _topic(t) as topic:
        resource = ConfigResource(ResourceType.TOPIC, topic)

        def change(value: str) -> ConfigResource:
            entry = ConfigEntry("retention.ms", value, incremental_operation=AlterConfigOpType.SET)
            return ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[entry])

        good = change("3600000")
        admin.incremental_alter_configs([good])[good].result(_WAIT_S)
        configs = admin.describe_configs([resource])[resource].result(_WAIT_S)
        assert configs["retention.ms"].value == "3600000", configs["retention.ms"]
        bad = change("-5")
        try:
            admin.incremental_alter_configs([bad])[bad].result(_WAIT_S)
        except KafkaException as e:
            assert e.args[0].code() == KafkaError.INVALID_CONFIG, e
        else:
            raise AssertionError("retention.ms=-5 was accepted")


@case("group-admin", "confluent-kafka")
def group_admin(t: Target) -> None:
    """DescribeGroups, ListGroups, OffsetFetch and DeleteGroups (NON_EMPTY_GROUP while a
    member is in it)."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    admin = AdminClient(_conf(t))
    group = t.name("group")
    with _topic(t) as topic:
        _produce(_producer(t), topic, [b"x"])
        consumer = _consumer(t, group)
        consumer.subscribe([topic])
        try:
            _consume(consumer, 1)
            consumer.commit(asynchronous=False)
            described = admin.describe_consumer_groups([group])[group].result(_WAIT_S)
            assert described.state.name == "STABLE" and len(described.members) == 1, described
            listed = admin.list_consumer_groups().result(_WAIT_S)
            assert group in {g.group_id for g in listed.valid}
            try:
                admin.delete_consumer_groups([group])[group].result(_WAIT_S)
            except KafkaException as e:
                assert e.args[0].code() == KafkaError.NON_EMPTY_GROUP, e
            else:
                raise AssertionError("a group with a member was deleted")
        finally:
            consumer.close()
        request = [ConsumerGroupTopicPartitions(group)]
        offsets = admin.list_consumer_group_offsets(request)[group].result(_WAIT_S)
        assert [tp.offset for tp in offsets.topic_partitions] == [1], offsets
        admin.delete_consumer_groups([group])[group].result(_WAIT_S)


@case("kip848-consumer-group", "confluent-kafka", timeout_s=40)
def kip848_consumer_group(t: Target) -> None:
    """KIP-848 (group.protocol=consumer): the server assigns partitions; two members
    split four partitions."""
    group = t.name("group")
    with _topic(t, partitions=4) as topic:
        conf = _conf(t, **{"group.id": group, "group.protocol": "consumer"})
        _assert_split(topic, [Consumer(conf) for _ in range(2)])


@case("share-group", "confluent-kafka", timeout_s=40)
def share_group(t: Target) -> None:
    """KIP-932 share groups: a released record comes back with delivery count 2; accepted
    ones do not come back."""
    from confluent_kafka import AcknowledgeType, ShareConsumer

    with _topic(t) as topic:
        _produce(_producer(t), topic, [b"0", b"1"])
        consumer = ShareConsumer(
            _conf(t, **{"group.id": t.name("share"), "share.acknowledgement.mode": "explicit"})
        )
        consumer.subscribe([topic])

        def poll_until(count: int) -> list[Message]:
            got: list[Message] = []
            deadline = time.monotonic() + _WAIT_S
            while len(got) < count and time.monotonic() < deadline:
                got += [m for m in consumer.poll(0.3) or [] if m.error() is None]
            return got

        try:
            first = poll_until(2)
            assert [m.value() for m in first] == [b"0", b"1"], first
            consumer.acknowledge(first[0], AcknowledgeType.RELEASE)
            consumer.acknowledge(first[1], AcknowledgeType.ACCEPT)
            consumer.commit_sync(10)
            again = poll_until(1)
            assert [(m.value(), m.delivery_count()) for m in again] == [(b"0", 2)], again
            consumer.acknowledge(again[0], AcknowledgeType.ACCEPT)
            consumer.commit_sync(10)
        finally:
            consumer.close()


@case("sasl-scram", "confluent-kafka")
def sasl_scram(t: Target) -> None:
    """SASL/SCRAM-SHA-256 with the account's password authenticates."""
    if t.user is None:
        raise NotApplicable("no user given (--user/--password)")
    with _topic(t) as topic:
        producer = Producer(_conf(t, **{"sasl.mechanism": "SCRAM-SHA-256"}))
        _produce(producer, topic, [b"scram"])


@case("null-key-value", "confluent-kafka")
def null_key_value(t: Target) -> None:
    """A record with a null key and a null value (a tombstone) is consumed with both
    null, not empty."""
    with _topic(t) as topic:
        producer = _producer(t)
        producer.produce(topic, None, None)
        producer.produce(topic, b"", b"k")
        assert producer.flush(_WAIT_S) == 0
        consumer = _consumer(t)
        consumer.subscribe([topic])
        try:
            got = _consume(consumer, 2)
        finally:
            consumer.close()
        assert (got[0].key(), got[0].value()) == (None, None), (got[0].key(), got[0].value())
        assert (got[1].key(), got[1].value()) == (b"k", b""), (got[1].key(), got[1].value())
