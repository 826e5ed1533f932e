from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from polymq.gateway.accounts import ANONYMOUS, AccessDenied, Accounts
from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.metering import Metering, Usage
from polymq.gateway.processor import Caller, Processor
from polymq.storage import batch_formats
from polymq.storage.api import StorageAPI
from polymq.storage.clock import ManualClock
from polymq.storage.memory import MemoryEngine
from polymq.storage.model import AppendRequest, BatchEntry, Message, QueueRef, TopicConfig
from tests.gateway.gateway_fakes import RecordedStorage

ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(
        AccountConfig(user="alice", password="a", namespaces=("alice",)),
        AccountConfig(user="bob", password="b", namespaces=("bob",)),
        AccountConfig(user="ops", password="o", namespaces=("ops",), admin=True),
    ),
)


class Setup:
    def __init__(self) -> None:
        self.storage = RecordedStorage()
        self.accounts = Accounts(ACCOUNTS)
        self.metering = Metering()
        self.processor = Processor(
            cast(StorageAPI, self.storage), self.accounts, self.metering, ManualClock()
        )

    def caller(self, user: str, namespace: str, protocol: str = "kafka") -> Caller:
        principal = self.accounts.principal(user)  # the password check is not under test
        assert principal is not None
        return Caller(principal=principal, namespace=namespace, protocol=protocol)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s = Setup()
    await s.storage.start()
    for ns in ("alice", "bob"):
        await s.storage.create_namespace(ns)
        await s.storage.create_topic(ns, "t")
    s.storage.calls.clear()
    yield s
    await s.storage.close()


# Calls that read or change messages, offsets or metadata (not the namespace and
# topic listing the checks themselves may not even reach).
DATA_CALLS = {"append", "read", "read_batches", "pop", "commit_offset", "meta_get", "create_topic"}


def request(namespace: str, body: bytes = b"hello") -> AppendRequest:
    return AppendRequest(entry=Message(body=body), queues=(QueueRef(namespace, "t"),))


async def test_own_namespace_works_and_is_metered(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    batch = BatchEntry(format="test", raw=b"0123456789", messages=(Message(), Message()))
    await setup.processor.append(
        alice,
        [request("alice"), AppendRequest(entry=batch, queues=(QueueRef("alice", "t"),))],
    )
    result = await setup.processor.read(alice, QueueRef("alice", "t"), 0)
    assert [m.message.body for m in result.messages] == [b"hello", b"", b""]
    consumer = Caller(principal=alice.principal, namespace="alice", protocol="amqp")
    popped = await setup.processor.pop(consumer, "g", [QueueRef("alice", "t")], max_messages=2)
    assert len(popped) == 2
    assert setup.metering.snapshot() == [
        Usage(namespace="alice", protocol="amqp", messages_out=2, bytes_out=5),
        Usage(
            namespace="alice",
            protocol="kafka",
            messages_in=3,
            bytes_in=15,
            messages_out=3,
            bytes_out=5,
        ),
    ]


async def test_a_batch_stored_raw_is_metered_by_its_record_count(setup: Setup) -> None:
    """Kafka batches carry only ``count`` (their messages are expanded on read), and
    must still be billed as that many messages."""
    batch_formats.register("test.three", lambda raw: (Message(body=raw),) * 3)
    alice = setup.caller("alice", "alice")
    batch = BatchEntry(format="test.three", raw=b"abcd", count=3)
    await setup.processor.append(
        alice, [AppendRequest(entry=batch, queues=(QueueRef("alice", "t"),))]
    )
    [usage] = setup.metering.snapshot()
    assert (usage.messages_in, usage.bytes_in) == (3, 4)


async def test_deduplicated_retries_are_not_metered_again(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    first = AppendRequest(
        entry=Message(body=b"once"), queues=(QueueRef("alice", "t"),), dedup_key="k"
    )
    [stored] = await setup.processor.append(alice, [first])
    [retry, other] = await setup.processor.append(alice, [first, request("alice", b"new")])
    assert not stored.duplicate and retry.duplicate and not other.duplicate
    [usage] = setup.metering.snapshot()
    assert (usage.messages_in, usage.bytes_in) == (2, 7)  # "once" and "new", not the retry


async def test_unmetered_appends_are_stored_but_not_counted(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    await setup.processor.append(alice, [request("alice")], metered=False)
    assert setup.metering.snapshot() == []
    result = await setup.processor.read(alice, QueueRef("alice", "t"), 0, metered=False)
    assert [m.message.body for m in result.messages] == [b"hello"]
    await setup.processor.append(alice, [request("alice")])
    [usage] = setup.metering.snapshot()
    assert (usage.messages_in, usage.bytes_in) == (1, 5)


async def test_internal_topics_and_pop_durability_pass_through(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    await setup.processor.create_topic(alice, "$queue", TopicConfig(internal=True))
    assert [t.name for t in await setup.processor.list_topics(alice)] == ["t"]
    listed = await setup.processor.list_topics(alice, include_internal=True)
    assert [t.name for t in listed] == ["$queue", "t"]
    await setup.processor.pop(alice, "g", [QueueRef("alice", "t")], durable=False)
    assert [c.kwargs.get("durable") for c in setup.storage.calls if c.name == "pop"] == [False]
    await setup.processor.pop(alice, "g", [QueueRef("alice", "t")])
    pops = [c for c in setup.storage.calls if c.name == "pop"]
    assert pops[-1].kwargs.get("durable", True) is True


async def test_another_namespace_is_denied(setup: Setup) -> None:
    alice_in_bob = setup.caller("alice", "bob")
    calls: list[Any] = [
        setup.processor.append(alice_in_bob, [request("bob")]),
        setup.processor.read(alice_in_bob, QueueRef("bob", "t"), 0),
        setup.processor.pop(alice_in_bob, "g", [QueueRef("bob", "t")]),
        setup.processor.list_topics(alice_in_bob),
        setup.processor.create_topic(alice_in_bob, "new"),
        setup.processor.meta_get(alice_in_bob, "exchange", "x"),
    ]
    for call in calls:
        with pytest.raises(AccessDenied, match="'alice' may not use namespace 'bob'"):
            await call
    assert DATA_CALLS.isdisjoint(setup.storage.names())  # nothing reached storage
    assert setup.metering.snapshot() == []


async def test_queue_refs_outside_the_callers_namespace_are_refused(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    bob_queue = QueueRef("bob", "t")
    mixed = AppendRequest(entry=Message(body=b"x"), queues=(QueueRef("alice", "t"), bob_queue))
    with pytest.raises(AccessDenied, match="outside namespace 'alice'"):
        await setup.processor.append(alice, [mixed])
    with pytest.raises(AccessDenied, match="outside namespace 'alice'"):
        await setup.processor.read(alice, bob_queue, 0)
    with pytest.raises(AccessDenied, match="outside namespace 'alice'"):
        await setup.processor.pop(alice, "g", [QueueRef("alice", "t"), bob_queue])
    with pytest.raises(AccessDenied):
        await setup.processor.commit_offset(alice, "g", bob_queue, 1)
    assert DATA_CALLS.isdisjoint(setup.storage.names())


async def test_admin_and_namespace_management(setup: Setup) -> None:
    alice = setup.caller("alice", "alice")
    with pytest.raises(AccessDenied, match="may not manage namespaces"):
        await setup.processor.create_namespace(alice, "alice2")
    ops = setup.caller("ops", "ops")
    await setup.processor.create_namespace(ops, "new")
    assert "new" in await setup.processor.list_namespaces(ops)
    assert await setup.processor.list_namespaces(alice) == ["alice"]
    # An admin may act in any namespace.
    await setup.processor.append(setup.caller("ops", "bob"), [request("bob")])


async def test_open_mode_anonymous_may_use_any_namespace() -> None:
    async with MemoryEngine() as storage:
        await storage.create_namespace("anything")
        await storage.create_topic("anything", "t")
        processor = Processor(storage, Accounts(AuthConfig()), Metering(), ManualClock())
        caller = Caller(principal=ANONYMOUS, namespace="anything", protocol="mqtt")
        await processor.append(caller, [request("anything")])
        read = await storage.read(QueueRef("anything", "t"), 0)
        assert [m.message.body for m in read.messages] == [b"hello"]


async def test_over_the_real_engine(tmp_path: Path) -> None:
    from polymq.storage.engine import Engine, EngineConfig

    async with Engine(EngineConfig(data_dir=tmp_path)) as engine:
        metering = Metering()
        processor = Processor(engine, Accounts(AuthConfig()), metering, engine.clock)
        caller = Caller(principal=ANONYMOUS, namespace="default", protocol="kafka")
        await processor.create_topic(caller, "t")
        queue = QueueRef("default", "t")
        [result] = await processor.append(caller, [request("default", b"abc")])
        assert result.placements[0].queue == queue
        read = await processor.read(caller, queue, 0)
        assert [m.message.body for m in read.messages] == [b"abc"]
        batches = await processor.read_batches(caller, queue, 0)
        assert sum(b.count for b in batches) == 1
        [usage] = metering.snapshot()
        assert (usage.messages_in, usage.bytes_in, usage.messages_out) == (1, 3, 2)


def test_processor_covers_every_storage_call() -> None:
    """Adapters reach storage only through the processor, so it must offer every call
    of the storage API (lifecycle aside)."""
    import inspect

    from polymq.gateway.processor import Processor
    from polymq.storage.api import StorageAPI

    storage_calls = {
        name
        for name, member in inspect.getmembers(StorageAPI, inspect.iscoroutinefunction)
        if not name.startswith("_")
    } - {"start", "close"}
    missing = sorted(n for n in storage_calls if not hasattr(Processor, n))
    assert missing == []


async def test_unmetered_reads_are_not_billed_and_queue_state_passes_through(
    tmp_path: Path,
) -> None:
    from polymq.storage.engine import Engine, EngineConfig

    async with Engine(EngineConfig(data_dir=tmp_path)) as engine:
        metering = Metering()
        processor = Processor(engine, Accounts(AuthConfig()), metering, engine.clock)
        caller = Caller(principal=ANONYMOUS, namespace="default", protocol="http")
        await processor.create_topic(caller, "t")
        queue = QueueRef("default", "t")
        await processor.append(caller, [request("default", b"abc"), request("default", b"de")])
        peeked = await processor.read(caller, queue, 0, metered=False)
        batches = await processor.read_batches(caller, queue, 0, metered=False)
        assert len(peeked.messages) == 2 and sum(b.count for b in batches) == 2
        [usage] = metering.snapshot()
        assert (usage.messages_in, usage.messages_out, usage.bytes_out) == (2, 0, 0)
        [popped] = await processor.pop(caller, "g", [queue])
        await processor.ack(caller, "g", popped.receipt or "")
        assert await processor.consumed_below(caller, "g", queue) == 1
        assert await processor.delayed_count(caller, queue) == 0
        elsewhere = QueueRef("other", "t")
        with pytest.raises(AccessDenied):
            await processor.consumed_below(caller, "g", elsewhere)
        with pytest.raises(AccessDenied):
            await processor.delayed_count(caller, elsewhere)
