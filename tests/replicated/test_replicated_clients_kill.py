"""The storage process of a shard is SIGKILLed while every protocol's real client
sends to it, then started again and given its shard back; nothing acknowledged is
lost or undone, through the takeover and through the hand-back.

One pool and one story for the module (a pool costs half a minute): every protocol's
queue is placed on the shard that is also the namespace's home (its metadata, groups
and sessions die with it too), producers of all of them run at a steady pace, and
consumers take and ack part of each stream before the kill. Then the shard's process
is killed; once every producer had more acknowledged, it is restarted, and once the
route names it again and every producer had more acknowledged, the producers stop
and consumers read the rest. Each protocol's checks are a test of their own.

What counts as acknowledged is what the client said: a delivery report without error
(confluent-kafka, ``acks=all``, idempotent), a confirm (pika), a PUBACK or PUBCOMP
(paho, QoS 1 and 2), a send receipt (RocketMQ), a 201 (MNS SDK); on the consumer
side a committed offset, an ack or delete that was answered, and for AMQP and MQTT
(whose acks get no answer) an ack sent before a request whose answer came back.
The time from the kill to the first acknowledged send is printed (``-s``), never
asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from mns.queue import QueueMeta

from polymq.nameserver.client import NameserverClient
from polymq.protocols.amqp.queues import TOPIC_PREFIX as AMQP_PREFIX
from polymq.storage.routes import RouteTable
from tests.mqtt.helpers import Paho
from tests.replicated import clients
from tests.replicated.clients import Ack, MessageId, Producer, Taken, parse
from tests.replicated.conftest import ReplicatedPool

ONE_FORM = True
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(420)]

NAMESPACE = "default"  # open auth mode
RATE = 20.0  # messages a second, each producer
BEFORE = 20  # acknowledged by each producer before consumers take part
TAKEN = 10  # taken and acked by each consumer before the kill
AFTER = 30  # acknowledged by each producer after the kill, and after the hand-back
WAIT_S = 90.0
PROTOCOLS = ("kafka", "amqp", "mqtt", "rocketmq", "mns")
_SERVING = re.compile(r"shard (?P<shard>\S+): serving it \(epoch \d+\) at \S+:(?P<port>\d+)")


# -- the pool: routes and who serves a shard -------------------------------------------


async def routes(pool: ReplicatedPool) -> RouteTable:
    client = NameserverClient([pool.cluster.nameserver])
    try:
        return await client.status()
    finally:
        await client.close()


def _serving_port(lines: list[str], shard: str) -> int | None:
    """The port a process last said it serves ``shard`` on, unless it dropped it since."""
    for line in reversed(lines):
        if f"shard {shard}: no longer served here" in line:
            return None
        match = _SERVING.search(line)
        if match is not None and match["shard"] == shard:
            return int(match["port"])
    return None


async def server_of(pool: ReplicatedPool, shard: str) -> str | None:
    """The running storage process the shard's route points at, if any."""
    nodes = [n for n in (await routes(pool)).nodes if n.node_id == shard and n.alive]
    for name in pool.storage:
        child = pool.cluster.children[name]
        running = child.process is not None and child.process.returncode is None
        if running and nodes and _serving_port(child.lines, shard) == nodes[0].port:
            return name
    return None


async def until(check: Callable[[], Awaitable[bool]], what: str, pool: ReplicatedPool) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs(pool)}")
        await asyncio.sleep(0.1)


def logs(pool: ReplicatedPool, lines: int = 15) -> str:
    """The storage processes' last log lines, for a failure's message."""
    return "\n".join(
        f"[{name}] {line}"
        for name in pool.storage
        for line in pool.cluster.children[name].lines[-lines:]
    )


# -- placing every protocol's queue on one shard ---------------------------------------


@dataclass(frozen=True, slots=True)
class Gateways:
    producing: dict[str, tuple[str, int]]  # listener -> gateway-1's address
    consuming: dict[str, tuple[str, int]]  # listener -> gateway-2's address
    bootstrap: str  # Kafka: both gateways


def gateways(pool: ReplicatedPool) -> Gateways:
    listeners = ("kafka", "amqp", "mqtt", "rocketmq", "http")
    first = {name: pool.cluster.address("gateway-1", name) for name in listeners}
    second = {name: pool.cluster.address("gateway-2", name) for name in listeners}
    bootstrap = ",".join(f"{h}:{p}" for h, p in (first["kafka"], second["kafka"]))
    return Gateways(first, second, bootstrap)


def _make_kafka(at: Gateways, name: str) -> None:
    admin = AdminClient({"bootstrap.servers": at.bootstrap})
    admin.create_topics([NewTopic(name, 2)])[name].result(30)


def _make_amqp(at: Gateways, name: str) -> None:
    producer = clients.AmqpProducer("setup", 1.0, at.producing["amqp"], name)
    producer.open()  # declares the durable queue
    producer.close()


def _make_mqtt(at: Gateways, name: str) -> None:
    """MQTT's storage topic (the first level) comes with its first publish."""
    probe = Paho(at.producing["mqtt"][1]).connect()
    try:
        assert probe.publish(f"{name}/probe", clients.body("probe", 0), qos=1) == 0
    finally:
        probe.disconnect()


def _make_rocketmq(at: Gateways, name: str) -> None:
    """A RocketMQ topic comes with its first message (FIFO: the topic is FIFO then)."""
    producer = clients.RocketProducer("probe", 1.0, at.producing["rocketmq"], name)
    producer.open()
    try:
        producer.send(clients.body("probe", 0))
    finally:
        producer.close()


def _make_mns(at: Gateways, name: str) -> None:
    clients.mns_queue(at.producing["http"], name).create(
        QueueMeta(vis_timeout=clients.INVISIBLE_S, polling_wait_sec=0)
    )


async def place(
    pool: ReplicatedPool,
    shard: str,
    make: Callable[[Gateways, str], None],
    stored_as: Callable[[str], str] = lambda name: name,
) -> str:
    """A new queue's name, made (with new names) until the nameserver put it on
    ``shard`` (placement picks the shard with the fewest topics)."""
    at = gateways(pool)
    for _ in range(8):
        name = f"r{uuid.uuid4().hex[:10]}"
        await asyncio.to_thread(make, at, name)
        key = (NAMESPACE, stored_as(name))

        async def routed(key: tuple[str, str] = key) -> bool:
            return key in (await routes(pool)).topics

        await until(routed, f"the route of {key}", pool)
        if (await routes(pool)).topics[key] == shard:
            return name
    raise AssertionError(f"eight new queues and none on {shard}")


async def home_shard(pool: ReplicatedPool) -> str:
    """The shard holding the namespace's home (a first queue claims it)."""
    await asyncio.to_thread(_make_mns, gateways(pool), f"r{uuid.uuid4().hex[:10]}")

    async def claimed() -> bool:
        return NAMESPACE in (await routes(pool)).homes

    await until(claimed, "the namespace's home", pool)
    return (await routes(pool)).homes[NAMESPACE]


# -- the story ---------------------------------------------------------------------------


@dataclass
class Side:
    """One protocol's producers and what its consumer got before and after."""

    producers: list[Producer]
    before: Taken = field(default_factory=Taken, repr=False)
    after: Taken = field(default_factory=Taken, repr=False)


@dataclass
class Story:
    victim: str
    shard: str
    successor: str = ""
    killed_at: float = 0.0
    restarted_at: float = 0.0
    handed_back_at: float = 0.0
    sides: dict[str, Side] = field(default_factory=dict, repr=False)


@dataclass
class Queues:
    """Every protocol's queue on the victim's shard, and the consumers that must be
    there before anything is sent (a persistent session, a RocketMQ group)."""

    kafka: str
    amqp: str
    mqtt: str  # the storage topic: the MQTT topics are <mqtt>/q1 and <mqtt>/q2
    rocketmq: str
    mns: str
    subscriber: clients.MqttSubscriber
    rocket: Any  # the SimpleConsumer

    @property
    def group(self) -> str:
        """The Kafka consumer group."""
        return f"g-{self.kafka}"


async def make_queues(pool: ReplicatedPool, shard: str) -> Queues:
    at = gateways(pool)
    kafka = await place(pool, shard, _make_kafka)
    amqp = await place(pool, shard, _make_amqp, lambda name: AMQP_PREFIX + name)
    mqtt = await place(pool, shard, _make_mqtt)
    rocketmq = await place(pool, shard, _make_rocketmq)
    mns = await place(pool, shard, _make_mns)
    topics = {f"{mqtt}/q1": 1, f"{mqtt}/q2": 2}
    subscriber = clients.MqttSubscriber(at.consuming["mqtt"], f"sub-{mqtt}", topics)
    await asyncio.to_thread(subscriber.connect)
    await asyncio.to_thread(subscriber.subscribe, list(topics.items()))
    rocket = await asyncio.to_thread(
        clients.rocket_consumer, at.consuming["rocketmq"], f"g-{rocketmq}", rocketmq
    )
    return Queues(kafka, amqp, mqtt, rocketmq, mns, subscriber, rocket)


def producers(at: Gateways, q: Queues) -> dict[str, Side]:
    mqtt = [
        clients.MqttProducer(
            f"mqtt-qos{qos}",
            RATE,
            at.producing["mqtt"],
            f"{q.mqtt}/q{qos}",
            qos,
            f"pub-{qos}-{q.mqtt}",
        )
        for qos in (1, 2)
    ]
    return {
        "kafka": Side([clients.KafkaProducer("kafka", RATE, at.bootstrap, q.kafka)]),
        "amqp": Side([clients.AmqpProducer("amqp", RATE, at.producing["amqp"], q.amqp)]),
        "mqtt": Side(list[Producer](mqtt)),
        "rocketmq": Side(
            [clients.RocketProducer("rocketmq", RATE, at.producing["rocketmq"], q.rocketmq)]
        ),
        "mns": Side([clients.MnsProducer("mns", RATE, at.producing["http"], q.mns)]),
    }


async def take_before(at: Gateways, q: Queues) -> tuple[Taken, ...]:
    """Each consumer takes and acks part of its stream (in the order of ``PROTOCOLS``)."""
    return await asyncio.gather(
        asyncio.to_thread(clients.kafka_take, at.bootstrap, q.kafka, q.group, TAKEN),
        asyncio.to_thread(clients.amqp_take, at.consuming["amqp"], q.amqp, TAKEN),
        asyncio.to_thread(q.subscriber.take, TAKEN),
        asyncio.to_thread(clients.rocket_take, q.rocket, TAKEN),
        asyncio.to_thread(clients.mns_take, at.consuming["http"], q.mns, TAKEN),
    )


async def drain_after(
    at: Gateways, q: Queues, wanted: dict[str, set[MessageId]], not_before: float
) -> tuple[Taken, ...]:
    """Each consumer reads the rest of its stream (in the order of ``PROTOCOLS``)."""
    return await asyncio.gather(
        asyncio.to_thread(clients.kafka_drain, at.bootstrap, q.kafka, q.group, wanted["kafka"]),
        asyncio.to_thread(clients.amqp_drain, at.consuming["amqp"], q.amqp, wanted["amqp"]),
        asyncio.to_thread(q.subscriber.drain, wanted["mqtt"]),
        asyncio.to_thread(clients.rocket_drain, q.rocket, wanted["rocketmq"], not_before),
        asyncio.to_thread(
            clients.mns_drain, at.consuming["http"], q.mns, wanted["mns"], not_before
        ),
    )


async def kill_and_restart(pool: ReplicatedPool, story: Story, every: list[Producer]) -> None:
    """SIGKILL the victim; once another process serves the shard and every producer
    had more acknowledged, start it again; then until the route names it again and
    every producer had more acknowledged."""
    await pool.cluster.kill(story.victim)
    story.killed_at = time.monotonic()

    async def taken_over() -> bool:
        story.successor = await server_of(pool, story.shard) or ""
        return story.successor not in ("", story.victim)

    await until(taken_over, f"another process serving {story.shard}", pool)
    await acknowledged(pool, every, AFTER, story.killed_at, "after the kill")

    await pool.cluster.start(story.victim)
    story.restarted_at = time.monotonic()

    async def handed_back() -> bool:
        return await server_of(pool, story.shard) == story.victim

    await until(handed_back, f"{story.shard} handed back to {story.victim}", pool)
    story.handed_back_at = time.monotonic()
    await acknowledged(pool, every, AFTER, story.handed_back_at, "after the hand-back")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def story(module_pool: ReplicatedPool) -> Story:
    pool, at = module_pool, gateways(module_pool)
    for i in (1, 2, 3):  # at start a process may hold another's shard for a moment

        async def settled(shard: str = f"shard-{i}", name: str = f"storage-{i}") -> bool:
            return await server_of(pool, shard) == name

        await until(settled, f"shard-{i} served by storage-{i}", pool)
    shard = await home_shard(pool)
    victim = await server_of(pool, shard)
    assert victim is not None
    story = Story(victim, shard)
    q = await make_queues(pool, shard)
    try:
        story.sides = producers(at, q)
        every = [p for side in story.sides.values() for p in side.producers]
        for producer in every:
            producer.start()
        try:
            await acknowledged(pool, every, BEFORE, 0.0, "before the kill")
            for name, taken in zip(PROTOCOLS, await take_before(at, q), strict=True):
                story.sides[name].before = taken
            taken_at = time.monotonic()
            await kill_and_restart(pool, story, every)
        finally:
            await asyncio.gather(*(asyncio.to_thread(p.stop) for p in every))
        # What the drains wait for: every acknowledged message not consumed yet. One
        # that came before the kill, after the consumer's last ack (MQTT: after its
        # sync SUBACK), may never come again if its ack landed: waiting for it cost the
        # drain its whole WAIT_S. The checks count it as consumed either way.
        wanted = {
            name: {(p.tag, a.seq) for p in side.producers for a in p.acked()}
            - {parse(d.raw) for d in side.before.deliveries}
            for name, side in story.sides.items()
        }
        not_before = taken_at + clients.INVISIBLE_S + 2  # an undone ack would show by then
        for name, taken in zip(
            PROTOCOLS, await drain_after(at, q, wanted, not_before), strict=True
        ):
            story.sides[name].after = taken
    finally:
        await asyncio.to_thread(q.rocket.shutdown)
    table = await routes(pool)
    sessions = {t: n for (_, t), n in table.topics.items() if t.startswith("$mqtt.session")}
    print(f"\nMQTT session queues: {sessions}; home {table.homes}")
    report(story)
    return story


async def acknowledged(
    pool: ReplicatedPool, producers: list[Producer], count: int, since: float, when: str
) -> None:
    """Until every producer had ``count`` sends acknowledged that it made after ``since``."""

    async def enough() -> bool:
        return all(p.acked_since(since) >= count for p in producers)

    try:
        await until(enough, f"{count} acknowledged {when}", pool)
    except AssertionError as e:
        counts = {p.tag: (p.acked_since(since), dict(p.errors)) for p in producers}
        raise AssertionError(f"{e}\nacknowledged, errors: {counts}") from None


# -- figures and checks -----------------------------------------------------------------


def _resumed(acks: list[Ack], moment: float) -> float:
    """From ``moment`` to the first acknowledgement of a send made after it."""
    return min(a.acked_at for a in acks if a.sent_at >= moment) - moment


def _longest_gap(acks: list[Ack], start: float, end: float) -> float:
    """The longest time without an acknowledgement between ``start`` and ``end``."""
    times = [start, *sorted(a.acked_at for a in acks if start < a.acked_at < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


def report(story: Story) -> None:
    print(
        f"\n{story.shard}: {story.victim} killed, taken over by {story.successor}; "
        f"restarted, handed back {story.handed_back_at - story.restarted_at:.2f} s later"
    )
    for side in story.sides.values():
        for p in side.producers:
            acks = p.acked()
            print(
                f"  {p.tag:13} first ack after the kill {_resumed(acks, story.killed_at):5.2f} s, "
                f"longest gap {_longest_gap(acks, story.killed_at - 1, story.restarted_at):5.2f}"
                f" s; around the hand-back: longest gap "
                f"{_longest_gap(acks, story.restarted_at, story.handed_back_at + 1):5.2f} s; "
                f"{len(acks)} acknowledged, errors {sum(p.errors.values())} {dict(p.errors)}"
            )


def check(side: Side) -> dict[str, int]:
    """Every acknowledged message consumed, byte for byte, in order per queue, and
    no acknowledged ack undone; returns the redeliveries per producer. A copy the
    consumer's client marks redelivered (DUP, redelivered, a later attempt) may come
    out of order: what was in flight when a consumer left is handed out again."""
    deliveries = side.before.deliveries + side.after.deliveries
    ids = [parse(d.raw) for d in deliveries]
    assert None not in ids, [d.raw[:40] for d, i in zip(deliveries, ids, strict=True) if i is None]
    after = {parse(d.raw) for d in side.after.deliveries}
    undone = side.before.acked & after
    assert not undone, f"acked before the kill, delivered again after it: {sorted(undone)}"
    seen = Counter(ids)
    redelivered = {}
    for producer in side.producers:
        acks = {ack.seq: ack for ack in producer.acked()}
        mine = {(producer.tag, seq) for seq in acks}
        lost = sorted(seq for _, seq in mine - set(seen))
        assert not lost, f"{producer.tag}: {len(lost)} acknowledged, never consumed: {lost}"
        order: dict[str, list[int]] = {}
        first = {}
        for message_id, delivery in zip(ids, deliveries, strict=True):
            if message_id in mine and message_id not in first:
                first[message_id] = delivery
                if not delivery.redelivered:
                    order.setdefault(acks[message_id[1]].queue, []).append(message_id[1])
        for queue, seqs in order.items():
            late = [(a, b) for a, b in itertools.pairwise(seqs) if b < a]
            assert not late, f"{producer.tag} {queue}: out of order {late[:5]}"
        redelivered[producer.tag] = sum(n - 1 for i, n in seen.items() if i in mine)
        redelivered[producer.tag] += sum(1 for i, d in first.items() if d.redelivered)
    return redelivered


async def test_the_shard_is_taken_over_and_handed_back(story: Story) -> None:
    assert story.successor not in ("", story.victim)
    assert story.handed_back_at > story.restarted_at > story.killed_at


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_nothing_acknowledged_is_lost_or_undone(story: Story, protocol: str) -> None:
    side = story.sides[protocol]
    redelivered = check(side)
    print(f"\n{protocol}: redelivered {redelivered}; after the kill: {_redeliveries(side)}")


def _redeliveries(side: Side) -> list[str]:
    """Where each copy read after the kill that was marked redelivered, or was seen
    before the kill already, came in what was read after it."""
    before = {parse(d.raw) for d in side.before.deliveries}
    where: list[str] = []
    last: MessageId | None = None
    for n, delivery in enumerate(side.after.deliveries):
        message_id = parse(delivery.raw)
        if delivery.redelivered or message_id in before:
            flag = "marked" if delivery.redelivered else "NOT marked"
            seen = "seen before the kill" if message_id in before else "first copy"
            where.append(f"{message_id} #{n} after {last} ({flag}, {seen})")
        else:
            last = message_id
    return where


async def test_the_checks_catch_a_loss_a_reordering_an_undone_ack_and_a_changed_byte(
    story: Story,
) -> None:
    """The checks are not vacuous: the AMQP side's real deliveries, each spoiled once."""
    side = story.sides["amqp"]
    after = side.after.deliveries
    acked = {(p.tag, a.seq) for p in side.producers for a in p.acked()}
    i = next(
        n for n, d in enumerate(after) if parse(d.raw) in acked and parse(after[n + 1].raw) in acked
    )
    one = parse(after[i].raw)

    def spoiled(deliveries: list[clients.Delivery]) -> Side:
        return Side(side.producers, side.before, Taken(deliveries, set()))

    with pytest.raises(AssertionError, match="never consumed"):
        check(spoiled([d for d in after if parse(d.raw) != one]))
    with pytest.raises(AssertionError, match="out of order"):
        check(spoiled([*after[:i], after[i + 1], after[i], *after[i + 2 :]]))
    again = next(d for d in side.before.deliveries if parse(d.raw) in side.before.acked)
    with pytest.raises(AssertionError, match="delivered again"):
        check(spoiled([*after, again]))
    changed = clients.Delivery(after[i].raw[:-1] + bytes([after[i].raw[-1] ^ 1]), "q")
    with pytest.raises(AssertionError):
        check(spoiled([*after[:i], changed, *after[i + 1 :]]))
