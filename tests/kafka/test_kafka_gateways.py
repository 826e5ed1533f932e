"""Kafka over several gateways: brokers, leaders, controller and coordinators come from
the gateway directory; a group's or transaction's requests reaching a gateway that is
not its coordinator get NOT_COORDINATOR, and real clients follow FindCoordinator to the
right one. Also: storage out of reach answers errors clients retry."""

from __future__ import annotations

import itertools
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, ShareConsumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from crc32c import crc32c
from kio.schema.errors import ErrorCode

from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.kafka.cluster import cluster_view
from polymq.protocols.kafka.listener import kafka_listener
from polymq.protocols.kafka.producers import ProducerRegistry, Verdict
from polymq.storage.model import QueueRef, TopicConfig
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.kafka.gateways import Gateways, StaticDirectory, gateways
from tests.kafka.raw import RawKafka
from tests.kafka.test_kafka_idempotence import _idempotent_batch, _produce

# Its gateways share one engine (tests/kafka/gateways.py), whatever the form.
ONE_FORM = True

IDS = ("gw-a", "gw-b")
_names = itertools.count()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    data_dir: Path = tmp_path_factory.mktemp("gateways")
    with gateways(data_dir, IDS, {"kafka": kafka_listener}) as live:
        yield live


def _endpoints(two: Gateways) -> list[GatewayEndpoint]:
    return [
        GatewayEndpoint(gateway_id=g, host="127.0.0.1", port=two.address(g, "kafka")[1])
        for g in IDS
    ]


def _owner(two: Gateways, key: str) -> str:
    found = owner_of(key, _endpoints(two))
    assert found is not None
    return found.gateway_id


def _key_owned_by(two: Gateways, gateway_id: str, prefix: str) -> str:
    """A fresh key (group or transactional id) whose coordinator is ``gateway_id``."""
    while True:
        key = f"{prefix}-{next(_names)}"
        if _owner(two, key) == gateway_id:
            return key


def _other(gateway_id: str) -> str:
    return IDS[1 - IDS.index(gateway_id)]


def test_the_view_resolves_hosts_and_always_lists_this_gateway() -> None:
    listed = {
        "kafka": [
            GatewayEndpoint(gateway_id="a", host="", port=9092),
            GatewayEndpoint(gateway_id="b", host="10.0.0.2", port=9093),
        ]
    }
    view = cluster_view(StaticDirectory("a", listed), ("192.168.1.5", 9092))
    assert [(n.gateway_id, n.host, n.port) for n in view.all] == [
        ("a", "192.168.1.5", 9092),
        ("b", "10.0.0.2", 9093),
    ]
    assert view.me.node_id == listed["kafka"][0].broker_id
    owners = {view.owner(f"group-{i}").gateway_id for i in range(50)}
    assert owners == {"a", "b"}  # keys spread over both
    for i in range(50):
        expected = owner_of(f"group-{i}", listed["kafka"])
        assert expected is not None and view.owner(f"group-{i}").gateway_id == expected.gateway_id
        assert view.owns(f"group-{i}") == (expected.gateway_id == "a")
    # not (yet) listed for Kafka: this gateway alone, where the client reached it
    alone = cluster_view(StaticDirectory("c", {}), ("127.0.0.1", 1234))
    assert [(n.gateway_id, n.host, n.port) for n in alone.all] == [("c", "127.0.0.1", 1234)]
    assert alone.owns("anything") and alone.controller is alone.me


def test_a_producer_unknown_to_this_gateway_is_accepted_at_any_sequence() -> None:
    """Another gateway (or this one before a restart) had its state: accept, as Kafka
    does once a producer's state expired, and check sequences from there on."""
    registry = ProducerRegistry(node=7)
    queue = QueueRef("default", "t", 0)
    assert registry.check(123, 0, queue, 57, 3).verdict is Verdict.ACCEPT
    registry.record(123, 0, queue, 57, 3, offset=10)
    assert registry.check(123, 0, queue, 61, 1).verdict is Verdict.OUT_OF_ORDER
    assert registry.check(123, 0, queue, 60, 1).verdict is Verdict.ACCEPT
    other = ProducerRegistry(node=8)
    ids = {registry.init_producer(None)[0], other.init_producer(None)[0]}
    assert len(ids) == 2  # two gateways never hand out the same producer id


def test_metadata_lists_every_gateway_and_spreads_leaders(two: Gateways) -> None:
    topic = f"spread-{next(_names)}"
    endpoints = {e.gateway_id: e for e in _endpoints(two)}
    for asked in IDS:
        admin = AdminClient({"bootstrap.servers": two.bootstrap(asked)})
        if asked == IDS[0]:
            admin.create_topics([NewTopic(topic, 8)])[topic].result(10)
        cluster = admin.list_topics(topic, timeout=10)
        brokers: dict[int, tuple[Any, int]] = {
            b.id: (b.host, b.port) for b in cluster.brokers.values()
        }
        assert brokers == {e.broker_id: (e.host, e.port) for e in endpoints.values()}, (
            "every gateway, as a broker"
        )
        controller = owner_of("controller", list(endpoints.values()))
        assert controller is not None and cluster.controller_id == controller.broker_id
        leaders = {p.id: p.leader for p in cluster.topics[topic].partitions.values()}
        assert leaders == {p: endpoints[_owner(two, f"{topic}/{p}")].broker_id for p in range(8)}, (
            "the same leaders whichever gateway is asked"
        )


def test_find_coordinator_agrees_on_every_gateway(two: Gateways) -> None:
    keys = [f"g-{i}" for i in range(6)]
    for asked in IDS:
        with RawKafka(*two.address(asked, "kafka")) as client:
            for key in keys:
                answer = client.request(10, 3, {"key": key, "key_type": 0})
                assert answer.error_code is ErrorCode.none
                assert answer.port == two.address(_owner(two, key), "kafka")[1]
            batched = client.request(10, 4, {"key_type": 1, "coordinator_keys": keys})
            got = {c.key: c.port for c in batched.coordinators}
            assert got == {k: two.address(_owner(two, k), "kafka")[1] for k in keys}


def test_group_requests_at_another_gateway_get_not_coordinator(two: Gateways) -> None:
    group = _key_owned_by(two, IDS[0], "grp")
    txn = _key_owned_by(two, IDS[0], "txn")
    join = {
        "group_id": group,
        "session_timeout": 10000,
        "rebalance_timeout": 10000,
        "member_id": "",
        "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": b""}],
    }
    with RawKafka(*two.address(IDS[1], "kafka")) as client:
        assert client.request(11, 5, join).error_code is ErrorCode.not_coordinator
        heartbeat = {"group_id": group, "generation_id": 1, "member_id": "m"}
        assert client.request(12, 3, heartbeat).error_code is ErrorCode.not_coordinator
        commit = {
            "group_id": group,
            "generation_id_or_member_epoch": -1,
            "member_id": "",
            "topics": [{"name": "t", "partitions": [{"partition_index": 0}]}],
        }
        answer = client.request(8, 8, commit)
        assert answer.topics[0].partitions[0].error_code is ErrorCode.not_coordinator
        init = client.request(22, 4, {"transactional_id": txn, "transaction_timeout": 60000})
        assert init.error_code is ErrorCode.not_coordinator
    with RawKafka(*two.address(IDS[0], "kafka")) as client:
        assert client.request(11, 5, join).error_code is ErrorCode.none
        init = client.request(22, 4, {"transactional_id": txn, "transaction_timeout": 60000})
        assert init.error_code is ErrorCode.none


def test_a_group_reached_through_the_other_gateway_consumes_and_resumes(two: Gateways) -> None:
    topic = f"grp-topic-{next(_names)}"
    group = _key_owned_by(two, IDS[1], "cg")
    bootstrap = two.bootstrap(IDS[0])  # not the coordinator: the client must move
    producer = confluent_producer(bootstrap)
    for i in range(20):
        producer.produce(topic, value=b"%d" % i)
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, group, **{"enable.auto.commit": False})
    consumer.subscribe([topic])
    try:
        got = confluent_consume(consumer, 20)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    assert sorted(int(m.value() or b"") for m in got) == list(range(20))
    again = confluent_consumer(two.bootstrap(IDS[1]), group)
    try:
        committed = again.committed([TopicPartition(topic, 0)], timeout=10)
    finally:
        again.close()
    assert committed[0].offset == 20


def test_transaction_offsets_parked_by_the_groups_gateway_commit_at_end(two: Gateways) -> None:
    """The transaction's coordinator and the group's are different gateways: the
    group's keeps the offsets in storage until EndTxn at the transaction's."""
    topic = f"txn-topic-{next(_names)}"
    txn = _key_owned_by(two, IDS[0], "tx")
    group = _key_owned_by(two, IDS[1], "txg")
    bootstrap = two.bootstrap(IDS[1])
    producer = confluent_producer(bootstrap, **{"transactional.id": txn})
    producer.init_transactions(30)
    member = confluent_consumer(bootstrap, group)
    try:
        for commit, offset in ((False, 5), (True, 7)):
            producer.begin_transaction()
            producer.produce(topic, value=b"x")
            producer.send_offsets_to_transaction(
                [TopicPartition(topic, 0, offset)], member.consumer_group_metadata(), 30
            )
            if commit:
                producer.commit_transaction(30)
            else:
                producer.abort_transaction(30)
        committed = member.committed([TopicPartition(topic, 0)], timeout=10)
    finally:
        member.close()
    assert committed[0].offset == 7  # the aborted 5 was dropped, the committed 7 applied


def test_an_idempotent_producer_moving_to_another_gateway_goes_on(two: Gateways) -> None:
    topic = f"idem-{next(_names)}"
    with RawKafka(*two.address(IDS[0], "kafka")) as first:
        first.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        pid = first.request(22, 4, {"transactional_id": None}).producer_id
        assert _produce(first, topic, _idempotent_batch(pid, 0, 0, 3)).base_offset == 0
    with RawKafka(*two.address(IDS[1], "kafka")) as second:
        moved = _produce(second, topic, _idempotent_batch(pid, 0, 3, 2))
        assert moved.error_code is ErrorCode.none and moved.base_offset == 3
        gap = _produce(second, topic, _idempotent_batch(pid, 0, 9, 1))
        assert gap.error_code is ErrorCode.out_of_order_sequence_number


def test_storage_out_of_reach_answers_retriable_errors(two: Gateways) -> None:
    topic = f"down-{next(_names)}"
    gateway_id = IDS[0]
    group = _key_owned_by(two, gateway_id, "down")
    storage = two.storage[gateway_id]
    with RawKafka(*two.address(gateway_id, "kafka")) as client:
        client.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        storage.down = True
        try:
            produced = _produce(client, topic, _idempotent_batch(-1, -1, -1, 1))
            fetched = client.request(
                1,
                12,
                {
                    "max_wait": 0,
                    "topics": [
                        {"topic": topic, "partitions": [{"partition": 0, "fetch_offset": 0}]}
                    ],
                },
            )
            commit = client.request(
                8,
                8,
                {
                    "group_id": group,
                    "generation_id_or_member_epoch": -1,
                    "topics": [{"name": topic, "partitions": [{"partition_index": 0}]}],
                },
            )
            offsets = client.request(9, 7, {"group_id": group, "topics": None})
        finally:
            storage.down = False
    assert produced.error_code is ErrorCode.kafka_storage_error
    assert fetched.responses[0].partitions[0].error_code is ErrorCode.kafka_storage_error
    assert commit.topics[0].partitions[0].error_code is ErrorCode.coordinator_not_available
    assert offsets.error_code is ErrorCode.coordinator_not_available


def test_a_producer_retries_through_a_storage_outage(two: Gateways) -> None:
    """confluent-kafka keeps retrying KAFKA_STORAGE_ERROR; once storage is back the
    record is stored, once."""
    topic = f"outage-{next(_names)}"
    bootstrap = two.bootstrap(IDS[0])
    producer = confluent_producer(bootstrap, **{"enable.idempotence": True, "retry.backoff.ms": 50})
    producer.produce(topic, value=b"before")
    assert producer.flush(30) == 0
    for gateway_id in IDS:
        two.storage[gateway_id].down = True
    errors: list[Any] = []
    delivered = threading.Event()

    def report(error: KafkaError | None, message: Any) -> None:
        errors.append(error)
        delivered.set()

    try:
        producer.produce(topic, value=b"during", on_delivery=report)
        producer.poll(1.0)  # a few attempts fail meanwhile
        assert not delivered.is_set()
    finally:
        for gateway_id in IDS:
            two.storage[gateway_id].down = False
    assert producer.flush(30) == 0
    assert errors == [None]
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        got = [m.value() for m in confluent_consume(consumer, 2)]
    finally:
        consumer.close()
    assert got == [b"before", b"during"]


def test_an_unanswered_batch_holds_the_next_back_until_its_retry(two: Gateways) -> None:
    """The answers a producer gets when a stored batch's answer was lost: the batch
    "may have been written" (REQUEST_TIMED_OUT), the next one a retryable
    KAFKA_STORAGE_ERROR rather than OUT_OF_ORDER_SEQUENCE_NUMBER, and the retry the
    first copy's offset."""
    topic = f"unsettled-{next(_names)}"
    storage = two.storage[IDS[0]]
    with RawKafka(*two.address(IDS[0], "kafka")) as client:
        client.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        pid = client.request(22, 4, {"transactional_id": None}).producer_id
        assert _produce(client, topic, _idempotent_batch(pid, 0, 0, 2)).base_offset == 0
        storage.lost_append_answers = 1
        lost = _produce(client, topic, _idempotent_batch(pid, 0, 2, 3))
        behind = _produce(client, topic, _idempotent_batch(pid, 0, 5, 1))
        retry = _produce(client, topic, _idempotent_batch(pid, 0, 2, 3))
        after = _produce(client, topic, _idempotent_batch(pid, 0, 5, 1))
    assert lost.error_code is ErrorCode.request_timed_out
    assert behind.error_code is ErrorCode.kafka_storage_error
    assert (retry.error_code, retry.base_offset) == (ErrorCode.none, 2)
    assert (after.error_code, after.base_offset) == (ErrorCode.none, 5)
    offsets = two.call(lambda: storage.queue_offsets(QueueRef("default", topic, 0)))
    assert offsets.latest == 6


def test_a_batch_stored_but_unanswered_is_stored_once(two: Gateways) -> None:
    """Issue 22: the storage node stores a batch and dies before answering, with more
    batches of the producer in flight behind it. Those must not get
    OUT_OF_ORDER_SEQUENCE_NUMBER (librdkafka would take it as proof the first was not
    stored, bump its epoch and send its records again under new sequences): each
    record is stored once."""
    topic = f"lost-{next(_names)}"
    bootstrap = two.bootstrap(IDS[0])
    producer = confluent_producer(
        bootstrap, **{"enable.idempotence": True, "retry.backoff.ms": 50, "linger.ms": 0}
    )
    producer.produce(topic, value=b"before")
    assert producer.flush(30) == 0
    storage = two.storage[IDS[0]]
    storage.lost_answer_delay_s = 0.3  # meanwhile the client sends its next batches
    storage.lost_append_answers = 1
    try:
        for i in range(200):
            producer.produce(topic, value=b"r%d" % i)
            producer.poll(0)
            time.sleep(0.002)
        assert producer.flush(30) == 0
    finally:
        storage.lost_append_answers = 0
    assert storage.lost_append_answers == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        got = [m.value() for m in confluent_consume(consumer, 201)]
        assert consumer.poll(1.0) is None  # no second copy of anything
    finally:
        consumer.close()
    assert got == [b"before", *(b"r%d" % i for i in range(200))]


def _transactional_batch(producer_id: int, epoch: int, sequence: int) -> bytes:
    batch = bytearray(_idempotent_batch(producer_id, epoch, sequence, 1))
    struct.pack_into(">h", batch, 21, struct.unpack_from(">h", batch, 21)[0] | 0x10)
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[21:])))
    return bytes(batch)


def test_a_transaction_goes_on_at_the_coordinator_taking_its_id_over(two: Gateways) -> None:
    """A gateway that did not know its peer yet began the transaction (its own view
    made it the coordinator); once the views agree, the id's real coordinator carries
    the transaction on from what the first one stored, and commits it."""
    owner = IDS[1]
    txn = _key_owned_by(two, owner, "tx-move")
    topic = f"moved-{next(_names)}"
    both = two.listed["kafka"]
    first = next(e for e in both if e.gateway_id == IDS[0])
    with (
        RawKafka(*two.address(IDS[0], "kafka")) as early,
        RawKafka(*two.address(owner, "kafka")) as later,
    ):
        early.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        two.listed["kafka"] = [first]  # IDS[0] sees only itself: it owns every key
        try:
            init = early.request(22, 4, {"transactional_id": txn, "transaction_timeout": 60000})
            assert init.error_code is ErrorCode.none
            pid, epoch = init.producer_id, init.producer_epoch
            added = early.request(
                24,
                3,
                {
                    "v3_and_below_transactional_id": txn,
                    "v3_and_below_producer_id": pid,
                    "v3_and_below_producer_epoch": epoch,
                    "v3_and_below_topics": [{"name": topic, "partitions": [0]}],
                },
            )
            [result] = added.results_by_topic_v3_and_below[0].results_by_partition
            assert result.partition_error_code is ErrorCode.none
            produced = _produce(early, topic, _transactional_batch(pid, epoch, 0))
            assert produced.error_code is ErrorCode.none
        finally:
            two.listed["kafka"] = both
        end = later.request(
            26,
            3,
            {
                "transactional_id": txn,
                "producer_id": pid,
                "producer_epoch": epoch,
                "committed": True,
            },
        )
        assert end.error_code is ErrorCode.none
    consumer = confluent_consumer(
        two.bootstrap(IDS[0]), f"g-{topic}", **{"isolation.level": "read_committed"}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        assert [m.value() for m in confluent_consume(consumer, 1)] == [b"s0"]
    finally:
        consumer.close()


def test_each_gateway_lists_the_groups_it_coordinates(two: Gateways) -> None:
    """Admin clients ask every broker for its groups and add the answers up."""
    groups = [f"listed-{next(_names)}" for _ in range(8)]
    engine = two.gateways[IDS[0]].storage
    topic = f"listed-topic-{next(_names)}"

    async def commit_all() -> None:
        await engine.create_topic("default", topic, TopicConfig(queue_count=1))
        for group in groups:
            await engine.commit_offset("default", group, QueueRef("default", topic, 0), 1)

    two.call(commit_all)
    listed: dict[str, set[str]] = {}
    for asked in IDS:
        with RawKafka(*two.address(asked, "kafka")) as client:
            answer = client.request(16, 4, {"states_filter": []})
            listed[asked] = {g.group_id for g in answer.groups} & set(groups)
    assert listed == {g: {x for x in groups if _owner(two, x) == g} for g in IDS}


def test_a_share_group_fetches_from_every_partition_leader(two: Gateways) -> None:
    """ShareGroupHeartbeat goes to the coordinator, ShareFetch to each partition's
    leader: both gateways serve the member, each record once."""
    topic = f"share-{next(_names)}"
    partitions = 6
    bootstrap = two.bootstrap(IDS[0])
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions)])[topic].result(10)
    leaders = {_owner(two, f"{topic}/{p}") for p in range(partitions)}
    producer = confluent_producer(bootstrap)
    for i in range(30):
        producer.produce(topic, value=b"%d" % i, partition=i % partitions)
    assert producer.flush(30) == 0
    consumer = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": f"sg-{topic}"})
    got: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while len(got) < 30 and time.monotonic() < deadline:
            got += [m.value() or b"" for m in consumer.poll(0.2) or [] if m.error() is None]
    finally:
        consumer.close()
    assert sorted(got) == sorted(b"%d" % i for i in range(30))
    assert leaders == set(IDS), "the topic's partitions are led by both gateways"


def test_a_group_moves_on_when_its_coordinator_leaves(tmp_path: Path) -> None:
    """The coordinator stops and the directory drops it: the members find the new
    owner of the group among the gateways left, rejoin, and resume from the committed
    offsets (they are in storage)."""
    with gateways(tmp_path, IDS, {"kafka": kafka_listener}) as live:
        topic = f"moving-{next(_names)}"
        group = _key_owned_by(live, IDS[1], "mv")
        bootstrap = live.bootstrap(IDS[0])
        producer = confluent_producer(bootstrap)
        for i in range(10):
            producer.produce(topic, value=b"%d" % i)
        assert producer.flush(30) == 0
        consumer = confluent_consumer(bootstrap, group, **{"enable.auto.commit": False})
        consumer.subscribe([topic])
        try:
            first = confluent_consume(consumer, 10)
            consumer.commit(asynchronous=False)
            leaving = live.gateways[IDS[1]]
            live.listed["kafka"] = [e for e in live.listed["kafka"] if e.gateway_id != IDS[1]]
            live.call(leaving.close)
            for i in range(10, 20):
                producer.produce(topic, value=b"%d" % i)
            assert producer.flush(30) == 0
            second = confluent_consume(consumer, 10)
            consumer.commit(asynchronous=False)
        finally:
            consumer.close()
    assert [int(m.value() or b"") for m in first] == list(range(10))
    assert [int(m.value() or b"") for m in second] == list(range(10, 20))


def test_a_member_commits_at_the_new_coordinator_before_any_heartbeat(tmp_path: Path) -> None:
    """The new coordinator carries on the generation the old one stored: a member that
    commits there before its next heartbeat (librdkafka keeps fetching its assignment
    meanwhile) is known, and its commit is taken. Without the stored generation it got
    UNKNOWN_MEMBER_ID; the heartbeat interval here makes that race certain."""
    with gateways(tmp_path, IDS, {"kafka": kafka_listener}) as live:
        topic = f"carried-{next(_names)}"
        group = _key_owned_by(live, IDS[1], "carry")
        bootstrap = live.bootstrap(IDS[0])
        producer = confluent_producer(bootstrap)
        for i in range(10):
            producer.produce(topic, value=b"%d" % i)
        assert producer.flush(30) == 0
        consumer = confluent_consumer(
            bootstrap,
            group,
            **{"session.timeout.ms": 30000, "heartbeat.interval.ms": 10000},
        )
        consumer.subscribe([topic])
        try:
            got = confluent_consume(consumer, 10)
            leaving = live.gateways[IDS[1]]
            live.listed["kafka"] = [e for e in live.listed["kafka"] if e.gateway_id != IDS[1]]
            live.call(leaving.close)
            consumer.commit(asynchronous=False)
            ends: dict[int, int] = {}
            for m in got:
                partition, offset = m.partition(), m.offset()
                assert partition is not None and offset is not None
                ends[partition] = max(ends.get(partition, 0), offset + 1)
            committed = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=30)
        finally:
            consumer.close()
    assert {tp.partition: tp.offset for tp in committed} == ends
