"""Pop mode over the pool: receipts that name their node, pops over several nodes'
queues (first answer wins, overflow handed out next), long polls that still wake."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from polymq.storage.cluster import ClusterStorage
from polymq.storage.cluster_pop import Overflow, PopAsk, pop_spread
from polymq.storage.cluster_routes import Node, NodeClient
from polymq.storage.errors import InvalidArgument, InvalidName, InvalidReceipt, StorageError
from polymq.storage.model import (
    AppendRequest,
    GroupConfig,
    Message,
    QueueRef,
    StoredMessage,
    TopicConfig,
)
from polymq.storage.routes import NodeStatus
from tests.storage.test_cluster_harness import (  # noqa: F401
    Pool,
    cluster_fixture,
    eventually,
    pool_fixture,
)

NS = "default"


async def _three_topics(pool: Pool, cluster: ClusterStorage) -> list[QueueRef]:
    names = ["a", "b", "c"]
    for name in names:
        await cluster.create_topic(NS, name, TopicConfig(queue_count=1))
    assert len({pool.node_of(cluster, NS, n).node_id for n in names}) == 3
    return [QueueRef(NS, n) for n in names]


async def _put(cluster: ClusterStorage, queue: QueueRef, *bodies: bytes) -> None:
    await cluster.append([AppendRequest(entry=Message(body=b), queues=(queue,)) for b in bodies])


async def test_receipts_name_their_node_and_route_back(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _three_topics(pool, cluster)
    for queue in queues:
        await _put(cluster, queue, b"1", b"2", b"3", b"4", b"5")
    for queue in queues:
        owner = pool.node_of(cluster, NS, queue.topic)
        popped = await cluster.pop(NS, "g", [queue], max_messages=5)
        assert len(popped) == 5
        for message in popped:
            assert message.receipt is not None
            assert message.receipt.startswith(f"{owner.node_id}:")
        first, second, third, fourth, fifth = (cast(str, m.receipt) for m in popped)
        await cluster.ack(NS, "g", first)
        with pytest.raises(InvalidReceipt):
            await cluster.ack(NS, "g", first)  # stale
        await cluster.nack(NS, "g", second)
        changed = await cluster.change_invisibility(NS, "g", third, 60_000)
        assert changed.receipt is not None and changed.receipt.startswith(f"{owner.node_id}:")
        with pytest.raises(InvalidReceipt):
            await cluster.ack(NS, "g", third)  # replaced by the new receipt
        assert await cluster.ack_many(NS, "g", [changed.receipt, fourth, "bogus"]) == [
            None,
            None,
            "invalid_receipt",
        ]
        await cluster.dead_letter(NS, "g", fifth)
        dlq = await owner.engine.read(QueueRef(NS, "%DLQ%g"), 0)
        assert [m.message.body for m in dlq.messages][-1] == b"5"
        # Only the nacked one is left to hand out.
        again = await cluster.pop(NS, "g", [queue], max_messages=5)
        assert [m.message.body for m in again] == [b"2"]
    with pytest.raises(InvalidReceipt):
        await cluster.ack(NS, "g", "n9:AAAA")
    with pytest.raises(InvalidReceipt):
        await cluster.nack(NS, "g", "no-node-prefix")


async def test_ack_many_over_several_nodes(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _three_topics(pool, cluster)
    for queue in queues:
        await _put(cluster, queue, queue.topic.encode())
    popped = await cluster.pop(NS, "g", queues, max_messages=3)
    receipts = [cast(str, m.receipt) for m in popped]
    assert len({r.split(":")[0] for r in receipts}) == 3
    outcomes = await cluster.ack_many(NS, "g", [receipts[0], "n2:junk", receipts[1], receipts[2]])
    assert outcomes == [None, "invalid_receipt", None, None]
    for queue in queues:
        assert await cluster.pending_count(NS, "g", queue) == 0


@pytest.mark.parametrize(
    ("group", "max_messages", "invisible_ms", "error"),
    [
        ("", 1, 0, InvalidName),
        ("g", 0, 0, InvalidArgument),
        ("g", 1, -1, InvalidArgument),
    ],
)
async def test_a_pop_over_several_nodes_checks_its_arguments_as_one_node_does(
    pool: Pool,
    cluster: ClusterStorage,
    group: str,
    max_messages: int,
    invisible_ms: int,
    error: type[StorageError],
) -> None:
    queues = await _three_topics(pool, cluster)
    with pytest.raises(error) as one_node:
        await cluster.pop(
            NS, group, queues[:1], max_messages=max_messages, invisible_ms=invisible_ms
        )
    with pytest.raises(error) as spread:
        await cluster.pop(NS, group, queues, max_messages=max_messages, invisible_ms=invisible_ms)
    assert str(spread.value) == str(one_node.value)


async def test_pop_without_waiting_collects_from_several_nodes(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _three_topics(pool, cluster)
    for queue in queues:
        await _put(cluster, queue, f"{queue.topic}1".encode(), f"{queue.topic}2".encode())
    popped = await cluster.pop(NS, "g", queues, max_messages=4)
    assert len(popped) == 4  # never more than asked: nodes are asked for what is missing
    rest = await cluster.pop(NS, "g", queues, max_messages=10)
    bodies = sorted(m.message.body for m in [*popped, *rest])
    assert bodies == sorted(f"{q.topic}{i}".encode() for q in queues for i in (1, 2))
    assert await cluster.pop(NS, "g", queues, max_messages=10) == []
    # Every node served in turn: the first node asked rotates between pops.
    for queue in queues:
        await _put(cluster, queue, b"x")
    firsts = set()
    for _ in range(3):
        [message] = await cluster.pop(NS, "h", queues, max_messages=1)
        firsts.add(message.queue.topic)
    assert firsts == {"a", "b", "c"}


async def test_waiting_pop_over_several_nodes_wakes_on_any(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _three_topics(pool, cluster)
    waiting = asyncio.create_task(cluster.pop(NS, "g", queues, max_messages=5, wait_ms=30_000))
    await eventually(lambda: all(pool.parked(cluster, q) == 1 for q in queues))
    assert not waiting.done()
    await _put(cluster, queues[1], b"wake")
    popped = await asyncio.wait_for(waiting, 10)
    assert [m.message.body for m in popped] == [b"wake"]
    # The pops cancelled on the other nodes gave back nothing and hold nothing.
    for queue in (queues[0], queues[2]):
        await _put(cluster, queue, queue.topic.encode())
        [message] = await cluster.pop(NS, "g", queues, max_messages=1)
        assert message.message.body == queue.topic.encode()
        await cluster.ack(NS, "g", cast(str, message.receipt))


async def test_a_cancelled_waiting_pop_loses_nothing(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _three_topics(pool, cluster)
    waiting = asyncio.create_task(cluster.pop(NS, "g", queues, wait_ms=30_000))
    await eventually(lambda: all(pool.parked(cluster, q) == 1 for q in queues))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert all(pool.parked(cluster, q) == 0 for q in queues)  # no pop left behind
    for queue in queues:
        await _put(cluster, queue, queue.topic.encode())
    popped = await cluster.pop(NS, "g", queues, max_messages=3)
    assert sorted(m.message.body for m in popped) == [b"a", b"b", b"c"]


async def test_give_back_reaches_every_node_of_its_receipts(
    pool: Pool, cluster: ClusterStorage
) -> None:
    """Receipts of three nodes given back in one call: each node undoes its own pops
    (visible again, the delivery not counted)."""
    queues = await _three_topics(pool, cluster)
    for queue in queues:
        await _put(cluster, queue, queue.topic.encode())
    popped = await cluster.pop(NS, "g", queues, max_messages=3, invisible_ms=60_000)
    assert len(popped) == 3
    await cluster.give_back(NS, "g", [cast(str, m.receipt) for m in popped])
    again = await cluster.pop(NS, "g", queues, max_messages=3)
    assert sorted((m.message.body, m.delivery_attempt) for m in again) == [
        (b"a", 1),
        (b"b", 1),
        (b"c", 1),
    ]


async def test_messages_arriving_on_several_nodes_at_once_are_all_delivered(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _three_topics(pool, cluster)
    waiting = asyncio.create_task(cluster.pop(NS, "g", queues, max_messages=1, wait_ms=30_000))
    await eventually(lambda: all(pool.parked(cluster, q) == 1 for q in queues))
    # One append over all three nodes: every node's waiting pop wakes at once.
    await cluster.append([AppendRequest(entry=Message(body=b"all"), queues=tuple(queues))])
    first = await asyncio.wait_for(waiting, 10)
    delivered = list(first)
    for _ in range(10):
        if len(delivered) == 3:
            break
        delivered += await cluster.pop(NS, "g", queues, max_messages=1, wait_ms=1000)
    assert sorted(m.queue.topic for m in delivered) == ["a", "b", "c"]
    assert await cluster.ack_many(NS, "g", [cast(str, m.receipt) for m in delivered]) == [None] * 3


class _AnswerAtOnce:
    """A node whose waiting pop answers as soon as a shared gate opens."""

    def __init__(self, gate: asyncio.Event, message: StoredMessage) -> None:
        self.gate = gate
        self.message = message
        self.waiting = False

    async def pop(self, *args: Any, wait_ms: int = 0, **kwargs: Any) -> list[StoredMessage]:
        if wait_ms <= 0:
            return []
        self.waiting = True
        await self.gate.wait()
        return [self.message]


def _stub_node(node_id: str, client: object) -> Node:
    status = NodeStatus(node_id=node_id, host="127.0.0.1", port=1)
    return Node(status, cast(NodeClient, client))


def _stored(topic: str, receipt: str, next_visible_ms: int = 2**50) -> StoredMessage:
    return StoredMessage(
        message=Message(body=topic.encode()),
        queue=QueueRef(NS, topic),
        offset=0,
        message_id=topic,
        store_timestamp_ms=0,
        delivery_attempt=1,
        receipt=receipt,
        next_visible_ms=next_visible_ms,
    )


async def test_answers_beyond_max_messages_are_kept_for_the_next_pop() -> None:
    gate = asyncio.Event()
    clients = [_AnswerAtOnce(gate, _stored(n, "r")) for n in ("n1", "n2")]
    nodes = [_stub_node(n, c) for n, c in zip(("n1", "n2"), clients, strict=True)]
    parts: Sequence[tuple[Node, list[QueueRef]]] = [(n, [QueueRef(NS, n.node_id)]) for n in nodes]
    overflow = Overflow()
    popping = asyncio.create_task(
        pop_spread(
            parts,
            PopAsk(
                NS,
                "g",
                max_messages=1,
                invisible_ms=30_000,
                wait_ms=10_000,
                tags=None,
                durable=True,
            ),
            overflow=overflow,
            rotation=0,
        )
    )
    await eventually(lambda: all(c.waiting for c in clients))
    gate.set()  # both nodes answer in the same instant
    [won] = await popping
    assert overflow
    queues = [QueueRef(NS, "n1"), QueueRef(NS, "n2")]
    assert overflow.take(NS, "other", queues, None, 5, 0) == []
    [kept] = overflow.take(NS, "g", queues, None, 5, 0)
    assert {won.queue.topic, kept.queue.topic} == {"n1", "n2"}
    assert kept.receipt == f"{kept.queue.topic}:r"
    assert not overflow


def test_overflow_hands_out_only_what_fits_the_pop() -> None:
    overflow = Overflow()
    tagged = StoredMessage(
        message=Message(body=b"t", tag="red"),
        queue=QueueRef(NS, "a"),
        offset=1,
        message_id="m",
        store_timestamp_ms=0,
        receipt="n1:r2",
        next_visible_ms=1000,
    )
    overflow.keep(
        NS, "g", [_stored("a", "n1:r1", next_visible_ms=100), tagged, _stored("b", "n2:r")]
    )
    assert overflow.take(NS, "g", [QueueRef(NS, "c")], None, 5, 0) == []
    assert overflow.take(NS, "g", [QueueRef(NS, "a")], frozenset({"blue"}), 5, 0) == []
    assert overflow.take(NS, "g", [QueueRef(NS, "a")], None, 1, 0) == [
        _stored("a", "n1:r1", next_visible_ms=100)
    ]
    # Past its invisibility a kept message is dropped: its node hands it out again.
    assert overflow.take(NS, "g", [QueueRef(NS, "a")], frozenset({"red"}), 5, 1000) == []
    assert overflow.take(NS, "g", [QueueRef(NS, "b")], None, 1, 0) == [_stored("b", "n2:r")]
    assert not overflow


async def test_long_polls_wake_on_data(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _three_topics(pool, cluster)
    queue = queues[2]
    reading = asyncio.create_task(cluster.read(queue, 0, wait_ms=30_000))
    batches = asyncio.create_task(cluster.read_batches(queue, 0, wait_ms=30_000))
    popping = asyncio.create_task(cluster.pop(NS, "g", [queue], wait_ms=30_000))
    await eventually(lambda: pool.parked(cluster, queue) == 3)
    assert not (reading.done() or batches.done() or popping.done())
    await _put(cluster, queue, b"now")
    read = await asyncio.wait_for(reading, 10)
    assert [m.message.body for m in read.messages] == [b"now"]
    assert (await asyncio.wait_for(batches, 10))[0].messages[0].message.body == b"now"
    [popped] = await asyncio.wait_for(popping, 10)
    assert popped.message.body == b"now"


async def test_fifo_group_config_holds_on_the_topics_node(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _three_topics(pool, cluster)
    await cluster.set_group_config(NS, "g", GroupConfig(fifo=True))
    queue = queues[1]
    await cluster.append(
        [
            AppendRequest(entry=Message(body=str(i).encode(), message_group="o"), queues=(queue,))
            for i in range(3)
        ]
    )
    [first] = await cluster.pop(NS, "g", [queue], max_messages=3)
    assert await cluster.pop(NS, "g", [queue], max_messages=3) == []  # next waits for the ack
    await cluster.ack(NS, "g", cast(str, first.receipt))
    [second] = await cluster.pop(NS, "g", [queue], max_messages=3)
    assert second.message.body == b"1"


async def test_a_node_that_missed_a_group_config_gets_it_before_its_next_pop(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _three_topics(pool, cluster)
    queue = queues[0]
    owner = pool.node_of(cluster, NS, queue.topic)
    await cluster.meta_put(NS, "k", "n", 1)  # the namespace gets its home
    if cluster.routes.homes[NS].node_id == owner.node_id:
        queue = next(q for q in queues if pool.node_of(cluster, NS, q.topic) is not owner)
        owner = pool.node_of(cluster, NS, queue.topic)
    owner.down = True
    await cluster.refresh()
    await cluster.set_group_config(NS, "g", GroupConfig(fifo=True))
    assert not (await owner.engine.get_group_config(NS, "g")).fifo
    owner.down = False
    await cluster.refresh()
    await cluster.pop(NS, "g", [queue])
    assert (await owner.engine.get_group_config(NS, "g")).fifo
