"""Consumer groups with real clients: rebalancing as members join and leave, commits
and resume, and the coordinator's state machine on its own (fencing, expiry)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kafka import KafkaConsumer
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka.consumer_groups import assign_range
from polymq.protocols.kafka.coordinator import GroupCoordinator, GroupState
from polymq.protocols.kafka.listener import KafkaListener
from tests.kafka.clients import (
    confluent_consume,
    confluent_consumer,
    confluent_producer,
    wait_until,
)
from tests.live_server import LiveServer

PARTITIONS = 6


def _create(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions)])[topic].result(10)


def _assigned(consumers: list[Consumer]) -> list[set[int]]:
    for consumer in consumers:
        consumer.poll(0.05)
    return [{tp.partition for tp in c.assignment()} for c in consumers]


def _split_evenly(consumers: list[Consumer]) -> bool:
    sets = _assigned(consumers)
    union = set().union(*sets)
    disjoint = sum(len(s) for s in sets) == len(union)
    return union == set(range(PARTITIONS)) and disjoint and all(sets)


@pytest.mark.parametrize("strategy", ["range", "roundrobin", "cooperative-sticky"])
def test_members_join_and_leave(bootstrap: str, topic: str, strategy: str) -> None:
    _create(bootstrap, topic, PARTITIONS)
    group = f"g-{topic}"
    options = {"partition.assignment.strategy": strategy}
    first = confluent_consumer(bootstrap, group, **options)
    second = confluent_consumer(bootstrap, group, **options)
    third = None
    try:
        for c in (first, second):
            c.subscribe([topic])
        wait_until(lambda: _split_evenly([first, second]), what="two members")
        third = confluent_consumer(bootstrap, group, **options)
        third.subscribe([topic])
        wait_until(lambda: _split_evenly([first, second, third]), what="three members")
        first.close()
        wait_until(lambda: _split_evenly([second, third]), what="after one left")
    finally:
        second.close()
        if third is not None:
            third.close()


def test_commit_and_resume(bootstrap: str, topic: str) -> None:
    producer = confluent_producer(bootstrap)
    for i in range(10):
        producer.produce(topic, value=b"%d" % i)
    assert producer.flush(30) == 0
    group = f"g-{topic}"
    consumer = confluent_consumer(bootstrap, group)
    consumer.subscribe([topic])
    got = confluent_consume(consumer, 10)
    consumer.commit(offsets=[TopicPartition(topic, 0, 5)], asynchronous=False)
    assert got[4].offset() == 4
    committed = consumer.committed([TopicPartition(topic, 0)], timeout=10)
    assert committed[0].offset == 5
    consumer.close()
    again = confluent_consumer(bootstrap, group)
    again.subscribe([topic])
    try:
        rest = confluent_consume(again, 5)
    finally:
        again.close()
    assert [m.value() for m in rest] == [b"%d" % i for i in range(5, 10)]


def test_kafka_python_group_commits_and_resumes(bootstrap: str, topic: str) -> None:
    """kafka-python through the whole classic protocol: join, sync, heartbeats,
    commit, leave; a new member of the group resumes after the commit."""
    producer = confluent_producer(bootstrap)
    for i in range(6):
        producer.produce(topic, value=b"%d" % i)
    assert producer.flush(30) == 0
    group = f"g-{topic}"

    def member() -> KafkaConsumer:
        return KafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=6000,
            heartbeat_interval_ms=300,
            consumer_timeout_ms=10000,
        )

    first = member()
    try:
        got = [next(first).value for _ in range(4)]
        first.commit()
    finally:
        first.close()
    assert got == [b"0", b"1", b"2", b"3"]
    second = member()
    try:
        rest = [next(second).value for _ in range(2)]
    finally:
        second.close()
    assert rest == [b"4", b"5"]


def _kafka_python_member(bootstrap: str, topic: str, group: str) -> KafkaConsumer:
    """A member that knows the topic's partitions before it subscribes: kafka-python
    3.0.12 otherwise rejoins once the metadata arrives, and a join that completes after
    the poll() that started it timed out is never applied (see docs/kafka.md)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=300,
    )
    wait_until(lambda: bool(consumer.partitions_for_topic(topic)), what="topic metadata")
    consumer.subscribe([topic])
    return consumer


@pytest.mark.parametrize("round_", range(3))
def test_kafka_python_two_members_split_the_partitions(
    bootstrap: str, topic: str, round_: int
) -> None:
    """Two kafka-python members polled in turn with short timeouts, so a member's join
    often completes between its polls and it sends the same JoinGroup again. The
    coordinator must answer that with the current generation (as Kafka does), not
    rebalance: rebalancing made the two members rebalance forever."""
    _create(bootstrap, topic, 4)
    producer = confluent_producer(bootstrap)
    for i in range(40):
        producer.produce(topic, value=b"%d" % i, partition=i % 4)
    assert producer.flush(30) == 0
    group = f"g-{topic}"
    members = [_kafka_python_member(bootstrap, topic, group) for _ in range(2)]
    seen: set[bytes] = set()

    def split() -> bool:
        for member in members:
            for records in member.poll(timeout_ms=100).values():
                seen.update(r.value for r in records)
        owned = [{tp.partition for tp in m.assignment()} for m in members]
        return (
            len(seen) == 40
            and owned[0] | owned[1] == set(range(4))
            and all(len(each) == 2 for each in owned)
        )

    try:
        wait_until(split, what=f"two kafka-python members, round {round_}")
    finally:
        for member in members:
            member.close()


async def test_an_unchanged_rejoin_keeps_the_generation() -> None:
    """A follower of a stable group (or anyone between join and sync) re-sending its
    JoinGroup unchanged gets the current generation; a changed one rebalances."""
    coordinator = GroupCoordinator()
    join = dict(
        group_instance_id=None,
        client_id="c",
        client_host="/h",
        session_timeout_ms=10000,
        rebalance_timeout_ms=10000,
        protocol_type="consumer",
    )
    try:
        first_join = asyncio.ensure_future(
            coordinator.join("ns", "g", member_id="", protocols=[("range", b"m")], **join)  # type: ignore[arg-type]
        )
        leader = await first_join
        second_join = asyncio.ensure_future(
            coordinator.join("ns", "g", member_id="", protocols=[("range", b"m")], **join)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0)
        leader = await coordinator.join(
            "ns",
            "g",
            member_id=leader.member_id,
            protocols=[("range", b"m")],
            **join,  # type: ignore[arg-type]
        )
        follower = await second_join
        generation = follower.generation
        # Between join and sync: the same JoinGroup again is answered at once.
        again = await coordinator.join(
            "ns",
            "g",
            member_id=follower.member_id,
            protocols=[("range", b"m")],
            **join,  # type: ignore[arg-type]
        )
        assert (again.error, again.generation) == (ErrorCode.none, generation)
        synced = await coordinator.sync(
            "ns",
            "g",
            member_id=leader.member_id,
            generation=generation,
            assignments={leader.member_id: b"a1", follower.member_id: b"a2"},
        )
        assert synced.assignment == b"a1"
        again = await coordinator.join(
            "ns",
            "g",
            member_id=follower.member_id,
            protocols=[("range", b"m")],
            **join,  # type: ignore[arg-type]
        )
        assert (again.error, again.generation, again.members) == (ErrorCode.none, generation, ())
        assert coordinator.heartbeat("ns", "g", leader.member_id, generation) is ErrorCode.none
        # A changed subscription rebalances.
        changed = asyncio.ensure_future(
            coordinator.join(
                "ns",
                "g",
                member_id=follower.member_id,
                protocols=[("range", b"n")],
                **join,  # type: ignore[arg-type]
            )
        )
        await asyncio.sleep(0)
        assert coordinator.heartbeat("ns", "g", leader.member_id, generation) is (
            ErrorCode.rebalance_in_progress
        )
        changed.cancel()
    finally:
        await coordinator.close()


async def test_the_initial_rebalance_delay_gathers_members_starting_together() -> None:
    """With group.initial.rebalance.delay.ms, two members joining an empty group a
    moment apart form generation 1 together; without it the first is alone in it."""
    join = dict(
        group_instance_id=None,
        client_id="c",
        client_host="/h",
        session_timeout_ms=10000,
        rebalance_timeout_ms=10000,
        protocol_type="consumer",
        protocols=[("range", b"m")],
    )
    for delay_ms, together in ((300, True), (0, False)):
        coordinator = GroupCoordinator(initial_rebalance_delay_ms=delay_ms)
        try:
            first = asyncio.ensure_future(
                coordinator.join("ns", "g", member_id="", **join)  # type: ignore[arg-type]
            )
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(
                coordinator.join("ns", "g", member_id="", **join)  # type: ignore[arg-type]
            )
            if together:
                results = await asyncio.gather(first, second)
                assert [r.generation for r in results] == [1, 1]
                assert len(results[0].members) == 2
            else:
                alone = await first
                assert (alone.generation, len(alone.members)) == (1, 1)
                second.cancel()
        finally:
            await coordinator.close()


async def test_coordinator_fences_generations_and_expires_silent_members() -> None:
    coordinator = GroupCoordinator()
    join = dict(
        group_instance_id=None,
        client_id="c",
        client_host="/h",
        session_timeout_ms=200,
        rebalance_timeout_ms=200,
        protocol_type="consumer",
        protocols=[("range", b"m")],
    )
    try:
        first = await coordinator.join("ns", "g", member_id="", **join)  # type: ignore[arg-type]
        assert first.error is ErrorCode.none and first.leader == first.member_id
        synced = await coordinator.sync(
            "ns",
            "g",
            member_id=first.member_id,
            generation=first.generation,
            assignments={first.member_id: b"a1"},
        )
        assert synced.assignment == b"a1"
        assert coordinator.heartbeat("ns", "g", first.member_id, first.generation - 1) is (
            ErrorCode.illegal_generation
        )
        second_join = asyncio.ensure_future(
            coordinator.join("ns", "g", member_id="", **join)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0)
        assert coordinator.heartbeat("ns", "g", first.member_id, first.generation) is (
            ErrorCode.rebalance_in_progress
        )
        rejoined = await coordinator.join("ns", "g", member_id=first.member_id, **join)  # type: ignore[arg-type]
        second = await second_join
        assert rejoined.generation == second.generation == first.generation + 1
        assert len(rejoined.members) == 2  # the leader learns both
        assert coordinator.check_commit("ns", "g", first.member_id, first.generation) is (
            ErrorCode.illegal_generation
        )
        # Nobody heartbeats: both sessions run out and the group empties.
        coordinator.expire(asyncio.get_running_loop().time() + 1)
        described = coordinator.describe("ns", "g")
        assert described is not None and described[0] is GroupState.EMPTY
    finally:
        await coordinator.close()


async def test_a_stored_generation_is_carried_on_elsewhere_but_not_revived_here() -> None:
    """Another gateway restores a stable generation (its member heartbeats and commits
    there at once); the gateway that stored it and has since moved past it (the member
    expired) refuses it, so an expired member is not brought back."""
    old, new = GroupCoordinator(), GroupCoordinator()
    join = dict(
        group_instance_id=None,
        client_id="c",
        client_host="/h",
        session_timeout_ms=200,
        rebalance_timeout_ms=200,
        protocol_type="consumer",
        protocols=[("range", b"m")],
    )
    try:
        first = await old.join("ns", "g", member_id="", **join)  # type: ignore[arg-type]
        assert old.snapshot("ns", "g") is None  # not stable yet
        await old.sync(
            "ns",
            "g",
            member_id=first.member_id,
            generation=first.generation,
            assignments={first.member_id: b"a1"},
        )
        stored = old.snapshot("ns", "g")
        assert stored is not None
        assert new.restore("ns", "g", stored)
        assert new.heartbeat("ns", "g", first.member_id, first.generation) is ErrorCode.none
        assert new.check_commit("ns", "g", first.member_id, first.generation) is ErrorCode.none
        assert not new.restore("ns", "g", stored)  # it has members of its own now
        synced = await new.sync(
            "ns", "g", member_id=first.member_id, generation=first.generation, assignments={}
        )
        assert synced.assignment == b"a1"
        old.expire(asyncio.get_running_loop().time() + 1)
        assert not old.restore("ns", "g", stored)
        assert old.heartbeat("ns", "g", first.member_id, first.generation) is (
            ErrorCode.unknown_member_id
        )
    finally:
        await old.close()
        await new.close()


def _kip848_consumer(bootstrap: str, group: str) -> Consumer:
    """Session timeout and heartbeat interval are the broker's under KIP-848."""
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "group.protocol": "consumer",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )


def test_kip848_consumer_protocol_assigns_on_the_server(bootstrap: str, topic: str) -> None:
    _create(bootstrap, topic, 4)
    producer = confluent_producer(bootstrap)
    for i in range(8):
        producer.produce(topic, value=b"%d" % i, partition=i % 4)
    assert producer.flush(30) == 0
    group = f"g-{topic}"
    first = _kip848_consumer(bootstrap, group)
    first.subscribe([topic])
    try:
        got = confluent_consume(first, 8)
        assert sorted(m.value() or b"" for m in got) == [b"%d" % i for i in range(8)]
        first.commit(asynchronous=False)
        second = _kip848_consumer(bootstrap, group)
        second.subscribe([topic])

        def split() -> bool:
            sets = _assigned([first, second])
            return sets[0] | sets[1] == {0, 1, 2, 3} and not sets[0] & sets[1] and all(sets)

        wait_until(split, what="server-side assignment over two members")
        admin = AdminClient({"bootstrap.servers": bootstrap})
        described = admin.describe_consumer_groups([group])[group].result(10)
        assert described.type.name == "CONSUMER" and len(described.members) == 2
        assert sorted(
            tp.partition for m in described.members for tp in m.assignment.topic_partitions
        ) == [0, 1, 2, 3]
        listed = admin.list_consumer_groups().result(10)
        assert {(g.group_id, g.type.name) for g in listed.valid} >= {(group, "CONSUMER")}
        second.close()
        wait_until(lambda: _assigned([first])[0] == {0, 1, 2, 3}, what="after one left")
    finally:
        first.close()
    committed = confluent_consumer(bootstrap, group).committed(
        [TopicPartition(topic, p) for p in range(4)], timeout=10
    )
    assert [tp.offset for tp in committed] == [2, 2, 2, 2]


def test_range_assignment_splits_each_topic() -> None:
    members = {"b": ("t", "u"), "a": ("t",), "c": ("u",)}
    assigned = assign_range(members, {"t": 5, "u": 2, "unsubscribed": 3})
    assert assigned == {
        "a": {"t": frozenset({0, 1, 2})},
        "b": {"t": frozenset({3, 4}), "u": frozenset({0})},
        "c": {"u": frozenset({1})},
    }


async def test_aiokafka_group_rebalances(bootstrap: str, topic: str) -> None:
    _create(bootstrap, topic, 4)
    group = f"g-{topic}"

    def consumer() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            session_timeout_ms=6000,
            heartbeat_interval_ms=300,
        )

    first, second = consumer(), consumer()
    await first.start()
    await second.start()
    try:

        async def split() -> None:
            while True:
                for c in (first, second):
                    await c.getmany(timeout_ms=50)
                sets = [{tp.partition for tp in c.assignment()} for c in (first, second)]
                if sets[0] | sets[1] == {0, 1, 2, 3} and not sets[0] & sets[1] and all(sets):
                    return

        async with asyncio.timeout(30):
            await split()
        await second.stop()
        async with asyncio.timeout(30):
            while {tp.partition for tp in first.assignment()} != {0, 1, 2, 3}:
                await first.getmany(timeout_ms=50)
    finally:
        await first.stop()
        await second.stop()


def test_static_member_returns_without_a_rebalance(
    server: LiveServer, bootstrap: str, topic: str
) -> None:
    """KIP-345: a follower restarting with its group.instance.id gets its partitions
    back at once, and nobody rebalances (a returning leader would make everyone
    rebalance, as in Kafka before KIP-814)."""
    _create(bootstrap, topic, PARTITIONS)
    group = f"g-{topic}"
    listener = server.gateway.listeners.get("kafka")
    assert isinstance(listener, KafkaListener)
    coordinator = listener.services.coordinator

    def state() -> tuple[int, str]:
        described = coordinator.describe("default", group)
        assert described is not None
        return described[1].generation, described[1].leader

    def static(instance: str) -> Consumer:
        return confluent_consumer(bootstrap, group, **{"group.instance.id": instance})

    members = {"a": static("a"), "b": static("b")}
    for member in members.values():
        member.subscribe([topic])
    try:
        wait_until(lambda: _split_evenly(list(members.values())), what="two static members")
        settled, leader_id = state()
        name = next(n for n, c in members.items() if c.memberid() != leader_id)
        leader = next(c for n, c in members.items() if n != name)
        before = _assigned([members[name]])[0]
        members.pop(name).close()  # a static member leaves no LeaveGroup behind
        back = members[name] = static(name)
        back.subscribe([topic])
        wait_until(lambda: _assigned([back, leader])[0] == before, what="its partitions back")
        assert state()[0] == settled  # nobody had to rebalance
    finally:
        for member in members.values():
            member.close()
