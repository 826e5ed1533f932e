"""RemoteStorage against a real StorageNode (a real engine on a temporary directory)
over loopback: what the network adds to the engine's contract (its own behaviour tests
run remotely in test_remote_contract.py): the API's shape, types that survive the
wire, long polls and their cancellation on the node, typed errors, a node that goes
down and comes back."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import pytest

import polymq.protocols.kafka  # noqa: F401  (registers the kafka.v2 expander in this process)
from polymq.protocols.kafka.records import KafkaRecord, encode_batch
from polymq.storage import errors
from polymq.storage.api import StorageAPI
from polymq.storage.clock import ManualClock
from polymq.storage.model import (
    AppendRequest,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    Message,
    MessageType,
    QueueRef,
    TopicConfig,
)
from polymq.storage.node import SERVED_METHODS, StorageNode
from polymq.storage.remote import RemoteStorage
from tests.storage.conftest import EngineFactory

NS = "default"
T = TypeVar("T")
WAIT = 10.0  # seconds: a generous bound on waiting for a condition


def q(topic: str = "t", queue_id: int = 0) -> QueueRef:
    return QueueRef(NS, topic, queue_id)


@pytest.fixture
async def node(make_engine: EngineFactory) -> AsyncIterator[StorageNode]:
    node = StorageNode(make_engine(), "node-a")
    await node.start()
    try:
        yield node
    finally:
        await node.close()


@pytest.fixture
async def remote(node: StorageNode) -> AsyncIterator[RemoteStorage]:
    remote = RemoteStorage(*node.address)
    try:
        yield remote
    finally:
        await remote.close()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.001)


async def started(node: StorageNode, call: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``call`` as a task, once the node has received it."""
    before = node.requests_served
    task = asyncio.ensure_future(call)
    await until(lambda: node.requests_served > before)
    return task


def test_remote_storage_has_the_whole_storage_api() -> None:
    """Same names, parameters, kinds and defaults as the protocol (a drifted signature
    would fail only at run time, on the node)."""
    for name in (*SERVED_METHODS, "start", "close"):
        expected = inspect.signature(getattr(StorageAPI, name))
        actual = inspect.signature(getattr(RemoteStorage, name))
        assert [(p.name, p.kind, p.default) for p in actual.parameters.values()] == [
            (p.name, p.kind, p.default) for p in expected.parameters.values()
        ], name
    assert isinstance(RemoteStorage("127.0.0.1", 1), StorageAPI)


async def test_topics_and_types_cross_the_wire(remote: RemoteStorage) -> None:
    config = TopicConfig(queue_count=2, message_type=MessageType.FIFO, retention_ms=5000)
    info = await remote.create_topic(NS, "t", config)
    assert info.config == config
    assert info.config.message_type is MessageType.FIFO
    assert (await remote.describe_topic(NS, "t")).queues == info.queues
    assert [t.name for t in await remote.list_topics(NS)] == ["t"]
    with pytest.raises(errors.TopicAlreadyExists):
        await remote.create_topic(NS, "t")
    with pytest.raises(errors.TopicNotFound):
        await remote.describe_topic(NS, "nope")


async def test_append_read_and_offsets(remote: RemoteStorage) -> None:
    await remote.create_topic(NS, "t", TopicConfig(queue_count=2))
    message = Message(body=b"\x00body", key=b"k", tag="tg", properties=(("h", b"1"), ("h", b"2")))
    [result] = await remote.append(
        [AppendRequest(entry=message, queues=(q("t", 0), q("t", 1)), dedup_key="d1")]
    )
    assert [p.queue for p in result.placements] == [q("t", 0), q("t", 1)]
    [again] = await remote.append(
        (AppendRequest(entry=message, queues=(q("t", 0),), dedup_key="d1"),)
    )
    assert again.duplicate and again.message_id == result.message_id
    read = await remote.read(q("t", 1), 0)
    assert read.messages[0].message == message
    assert read.messages[0].message_id == result.message_id
    assert read.next_offset == 1
    offsets = await remote.queue_offsets(q("t", 1))
    assert (offsets.earliest, offsets.latest) == (0, 1)
    assert await remote.offset_for_timestamp(q("t", 1), 0) == 0
    assert await remote.delete_records(q("t", 1), 1) == await remote.queue_offsets(q("t", 1))


async def test_offset_out_of_range_carries_its_bounds(remote: RemoteStorage) -> None:
    await remote.create_topic(NS, "t")
    await remote.append([AppendRequest(entry=Message(body=b"x"), queues=(q(),))] * 3)
    await remote.delete_records(q(), 1)
    with pytest.raises(errors.OffsetOutOfRange) as raised:
        await remote.read(q(), 9)
    assert (raised.value.earliest, raised.value.latest) == (1, 3)


async def test_kafka_batches_come_back_byte_for_byte_and_expand_on_the_node(
    remote: RemoteStorage,
) -> None:
    await remote.create_topic(NS, "t")
    records = [
        KafkaRecord(offset_delta=i, timestamp_ms=1000 + i, key=b"k", value=b"v%d" % i)
        for i in range(3)
    ]
    raw = encode_batch(0, records)
    entry = BatchEntry(format="kafka.v2", raw=raw, count=3)
    await remote.append([AppendRequest(entry=entry, queues=(q(),))])
    [batch] = await remote.read_batches(q(), 1)
    assert (batch.base_offset, batch.count, batch.format, batch.raw) == (0, 3, "kafka.v2", raw)
    read = await remote.read(q(), 0)
    assert [m.message.body for m in read.messages] == [b"v0", b"v1", b"v2"]


async def test_offsets_of_groups(remote: RemoteStorage) -> None:
    await remote.create_topic(NS, "t", TopicConfig(queue_count=2))
    await remote.commit_offset(NS, "g", q("t", 1), 5, "meta")
    fetched = await remote.fetch_offset(NS, "g", q("t", 1))
    assert fetched is not None and (fetched.offset, fetched.metadata) == (5, "meta")
    assert await remote.fetch_offset(NS, "g", q("t", 0)) is None
    listed = await remote.list_group_offsets(NS, "g")
    assert list(listed) == [q("t", 1)]
    assert isinstance(listed[q("t", 1)], CommittedOffset)
    assert await remote.list_groups(NS) == ["g"]
    await remote.delete_group_offsets(NS, "g", [q("t", 1)])
    assert await remote.list_group_offsets(NS, "g") == {}


async def test_long_poll_read_ends_empty_at_its_deadline(
    node: StorageNode, remote: RemoteStorage, clock: ManualClock
) -> None:
    await remote.create_topic(NS, "t")
    reader = await started(node, remote.read(q(), 0, wait_ms=5000))
    assert not reader.done()
    async with asyncio.timeout(WAIT):
        while not reader.done():  # the node may not have begun to wait yet: go on
            clock.advance(5000)
            await asyncio.sleep(0.001)
    assert reader.result().messages == ()


async def test_long_poll_pop_wakes_on_append_from_another_client(
    node: StorageNode, remote: RemoteStorage
) -> None:
    await remote.create_topic(NS, "t")
    popper = await started(node, remote.pop(NS, "g", [q()], wait_ms=60_000))
    other = RemoteStorage(*node.address)
    try:
        await other.append([AppendRequest(entry=Message(body=b"late"), queues=(q(),))])
    finally:
        await other.close()
    async with asyncio.timeout(WAIT):
        [message] = await popper
    assert message.message.body == b"late" and message.delivery_attempt == 1


async def test_a_pop_cancelled_while_waiting_takes_nothing(
    node: StorageNode, remote: RemoteStorage
) -> None:
    """The cancel reaches the node: the pop no longer waits there, so the message
    appended afterwards goes to the next pop, as a first delivery."""
    await remote.create_topic(NS, "t")
    popper = await started(node, remote.pop(NS, "g", [q()], wait_ms=60_000))
    popper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await popper
    await until(lambda: not any(c._tasks for c in node._server._connections))
    await remote.append([AppendRequest(entry=Message(body=b"m"), queues=(q(),))])
    assert await remote.inflight_count(NS, "g", q()) == 0
    [message] = await remote.pop(NS, "g", [q()])
    assert message.delivery_attempt == 1


async def test_a_pop_answered_after_its_cancel_gives_its_messages_back(
    node: StorageNode, remote: RemoteStorage
) -> None:
    """The race a consumer that leaves meets: the node finishes the pop before the
    cancel reaches it, and answers a caller that stopped waiting. Those messages go
    back at once instead of staying invisible until their invisibility
    runs out (never, on this test's manual clock), behind later messages. Their pop
    is undone, not nacked: the next delivery is still the first attempt."""
    handed_out = node._server.handlers["pop"]

    async def finishes_anyway(*args: Any, **kwargs: Any) -> Any:
        pop = asyncio.ensure_future(handed_out(*args, **kwargs))
        try:
            return await asyncio.shield(pop)
        except asyncio.CancelledError:  # too late: the answer is on its way
            return await pop

    node._server.handlers["pop"] = finishes_anyway
    await remote.create_topic(NS, "t")
    popper = await started(node, remote.pop(NS, "g", [q()], wait_ms=60_000))
    popper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await popper
    await remote.append([AppendRequest(entry=Message(body=b"m"), queues=(q(),))])
    node._server.handlers["pop"] = handed_out
    got: list[Any] = []

    async def pop_again() -> bool:
        got.extend(await remote.pop(NS, "g", [q()], wait_ms=100))
        return bool(got)

    async with asyncio.timeout(WAIT):
        while not await pop_again():
            pass
    [message] = got
    assert message.message.body == b"m" and message.delivery_attempt == 1


async def test_pop_ack_nack_and_invisibility(remote: RemoteStorage, clock: ManualClock) -> None:
    await remote.create_topic(NS, "t")
    await remote.set_group_config(NS, "g", GroupConfig(max_delivery_attempts=5))
    assert await remote.get_group_config(NS, "g") == GroupConfig(max_delivery_attempts=5)
    bodies = [b"a", b"b", b"c"]
    await remote.append([AppendRequest(entry=Message(body=b), queues=(q(),)) for b in bodies])
    popped = await remote.pop(NS, "g", (q(),), max_messages=3, invisible_ms=1000)
    assert [m.message.body for m in popped] == bodies
    a, b, c = (m.receipt or "" for m in popped)
    await remote.ack(NS, "g", a)
    with pytest.raises(errors.InvalidReceipt):
        await remote.ack(NS, "g", a)
    assert await remote.ack_many(NS, "g", [a, b]) == [errors.InvalidReceipt.code, None]
    moved = await remote.change_invisibility(NS, "g", c, 5000)
    assert moved.receipt and moved.receipt != c
    assert await remote.inflight_count(NS, "g", q()) == 1
    assert await remote.pending_count(NS, "g", q()) == 1
    await remote.nack(NS, "g", moved.receipt, delay_ms=0)
    [again] = await remote.pop(NS, "g", [q()])
    assert again.message.body == b"c" and again.delivery_attempt == 2
    await remote.ack(NS, "g", again.receipt or "")
    assert await remote.consumed_below(NS, "g", q()) == 3


async def test_pop_with_a_tag_filter(remote: RemoteStorage) -> None:
    await remote.create_topic(NS, "t")
    await remote.append(
        [
            AppendRequest(entry=Message(body=b, tag=t), queues=(q(),))
            for b, t in ((b"1", "x"), (b"2", "y"))
        ]
    )
    popped = await remote.pop(NS, "g", [q()], max_messages=5, tags=frozenset({"y"}))
    assert [m.message.body for m in popped] == [b"2"]


async def test_delayed_messages(remote: RemoteStorage, clock: ManualClock) -> None:
    await remote.create_topic(NS, "t", TopicConfig(message_type=MessageType.DELAY))
    due = clock.now_ms() + 60_000
    [result] = await remote.append(
        [AppendRequest(entry=Message(body=b"later", delivery_time_ms=due), queues=(q(),))]
    )
    assert result.placements == ()
    assert await remote.delayed_count(NS, q()) == 1
    assert await remote.cancel_delayed(NS, result.message_id) is True
    assert await remote.delayed_count(NS, q()) == 0


async def test_transactions(remote: RemoteStorage) -> None:
    await remote.create_topic(NS, "t", TopicConfig(message_type=MessageType.TRANSACTION))
    request = AppendRequest(entry=Message(body=b"tx"), queues=(q(),))
    half = await remote.append_half(request, producer_group="pg")
    assert half.queues == (q(),) and half.producer_group == "pg"
    assert [h.transaction_id for h in await remote.list_undecided(NS)] == [half.transaction_id]
    assert [h.transaction_id for h in await remote.list_undecided()] == [half.transaction_id]
    committed = await remote.end_transaction(NS, half.transaction_id, commit=True)
    assert committed is not None and committed.placements[0].queue == q()
    assert await remote.list_undecided(NS) == []
    with pytest.raises(errors.TransactionNotFound):
        await remote.end_transaction(NS, half.transaction_id, commit=False)
    assert [m.message.body for m in (await remote.read(q(), 0)).messages] == [b"tx"]


async def test_latest_values_and_metadata(remote: RemoteStorage) -> None:
    await remote.put_latest(NS, "retained/a", b"k1", Message(body=b"v1"))
    await remote.put_latest(NS, "retained/a", b"k2", Message(body=b"v2"))
    assert await remote.get_latest(NS, "retained/a", b"k1") == Message(body=b"v1")
    assert await remote.list_latest(NS, "retained/a") == [
        (b"k1", Message(body=b"v1")),
        (b"k2", Message(body=b"v2")),
    ]
    await remote.put_latest(NS, "retained/a", b"k1", None)
    assert await remote.get_latest(NS, "retained/a", b"k1") is None
    value = {"bindings": [["x", 1], ["y", 2]], "durable": True, "args": {}}
    await remote.meta_put(NS, "exchange", "e", value)
    assert await remote.meta_get(NS, "exchange", "e") == value
    assert await remote.meta_list(NS, "exchange") == {"e": value}
    assert await remote.meta_delete(NS, "exchange", "e") is True
    assert await remote.meta_get(NS, "exchange", "e") is None
    with pytest.raises(errors.InvalidArgument):
        await remote.meta_put(NS, "exchange", "e", {"not json": {1, 2}})


async def test_namespaces(remote: RemoteStorage) -> None:
    await remote.create_namespace("tenant")
    with pytest.raises(errors.NamespaceAlreadyExists):
        await remote.create_namespace("tenant")
    assert await remote.list_namespaces() == ["default", "tenant"]
    await remote.delete_namespace("tenant")
    with pytest.raises(errors.NamespaceNotFound):
        await remote.list_topics("tenant")
    with pytest.raises(errors.InvalidName):
        await remote.create_namespace("")


async def test_node_down_is_unavailable_and_its_data_is_there_after_a_restart(
    make_engine: EngineFactory,
) -> None:
    node = StorageNode(make_engine(), "node-a")
    await node.start()
    host, port = node.address
    remote = RemoteStorage(host, port)
    try:
        await remote.create_topic(NS, "t")
        await remote.append([AppendRequest(entry=Message(body=b"kept"), queues=(q(),))])
        waiting = asyncio.ensure_future(remote.read(q(), 1, wait_ms=60_000))
        await until(lambda: node.requests_served >= 3)
        await node.close()
        with pytest.raises(errors.StorageUnavailable):
            await waiting
        with pytest.raises(errors.StorageUnavailable):
            await remote.queue_offsets(q())
        node = StorageNode(make_engine(), "node-a", host, port)
        await node.start()
        read = await remote.read(q(), 0)
        assert [m.message.body for m in read.messages] == [b"kept"]
    finally:
        await remote.close()
        await node.close()


async def test_closed_engine_is_storage_closed_over_the_wire(
    node: StorageNode, remote: RemoteStorage
) -> None:
    await node.engine.close()
    with pytest.raises(errors.StorageClosed):
        await remote.list_namespaces()
