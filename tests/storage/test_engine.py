"""Engine semantics through the StorageAPI, one behaviour per test."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from polymq.storage import errors
from polymq.storage.clock import ManualClock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.model import (
    UNLIMITED,
    AppendRequest,
    BatchEntry,
    GroupConfig,
    Message,
    QueueOffsets,
    QueueRef,
    TopicConfig,
)
from tests.storage.conftest import EngineFactory

NS = "default"


def q(topic: str = "t", queue_id: int = 0, namespace: str = NS) -> QueueRef:
    return QueueRef(namespace, topic, queue_id)


async def put(
    storage: Engine, *bodies: bytes, queue: QueueRef | None = None, **fields: object
) -> None:
    target = queue or q()
    await storage.append(
        [AppendRequest(entry=Message(body=b, **fields), queues=(target,)) for b in bodies]  # type: ignore[arg-type]
    )


# -- topics and queues ---------------------------------------------------------------


async def test_topic_lifecycle(storage: Engine) -> None:
    info = await storage.create_topic(NS, "orders", TopicConfig(queue_count=3))
    assert info.queues == (QueueOffsets(0, 0),) * 3
    with pytest.raises(errors.TopicAlreadyExists):
        await storage.create_topic(NS, "orders")
    altered = await storage.alter_topic(NS, "orders", TopicConfig(queue_count=5))
    assert len(altered.queues) == 5
    with pytest.raises(errors.InvalidArgument, match="only grow"):
        await storage.alter_topic(NS, "orders", TopicConfig(queue_count=2))
    assert [t.name for t in await storage.list_topics(NS)] == ["orders"]
    await storage.delete_topic(NS, "orders")
    assert await storage.list_topics(NS) == []
    with pytest.raises(errors.TopicNotFound):
        await storage.describe_topic(NS, "orders")


async def test_internal_topics_are_listed_only_on_request(storage: Engine) -> None:
    await storage.create_topic(NS, "orders")
    await storage.create_topic(NS, "$session", TopicConfig(internal=True))
    assert [t.name for t in await storage.list_topics(NS)] == ["orders"]
    listed = await storage.list_topics(NS, include_internal=True)
    assert [(t.name, t.config.internal) for t in listed] == [("$session", True), ("orders", False)]
    assert (await storage.describe_topic(NS, "$session")).config.internal


async def test_internal_flag_survives_replay_and_checkpoint(
    make_engine: EngineFactory, engine_config: EngineConfig, tmp_path: Path
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "hidden", TopicConfig(internal=True))
        await storage.create_topic(NS, "shown")
        # The files as a crash leaves them: the topics are only in the log.
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")
    for data_dir in (tmp_path / "crashed", engine_config.data_dir):  # replayed; checkpointed
        async with make_engine(data_dir=data_dir) as storage:
            assert [t.name for t in await storage.list_topics(NS)] == ["shown"]
            assert (await storage.describe_topic(NS, "hidden")).config.internal


async def test_topics_stored_before_the_internal_flag_read_as_public(
    make_engine: EngineFactory, engine_config: EngineConfig
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "old", TopicConfig(internal=True))
    [topics_file] = Path(engine_config.data_dir).glob("topics-*.jsonl")
    rows = [json.loads(line) for line in topics_file.read_text().splitlines()]
    for row in rows:
        del row[3]["internal"]  # as written by a version without the field
    topics_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    async with make_engine() as storage:
        [info] = await storage.list_topics(NS)
        assert info.name == "old" and info.config == TopicConfig()


async def test_names_with_spaces_dots_and_unicode_are_valid(storage: Engine) -> None:
    for name in ("a.b.c", "with space", "Zürich/温度", "amq.gen-xyz"):
        await storage.create_topic(NS, name)
        await put(storage, b"x", queue=q(name))
        assert (await storage.read(q(name), 0)).messages[0].message.body == b"x"


@pytest.mark.parametrize("name", ["", "bad\x00name", "tab\there", "x" * 256])
async def test_invalid_names_are_refused(storage: Engine, name: str) -> None:
    with pytest.raises(errors.InvalidName):
        await storage.create_topic(NS, name)
    assert await storage.list_topics(NS) == []


async def test_unknown_namespace_topic_and_queue(storage: Engine) -> None:
    await storage.create_topic(NS, "t", TopicConfig(queue_count=2))
    with pytest.raises(errors.NamespaceNotFound):
        await storage.create_topic("nope", "t")
    with pytest.raises(errors.TopicNotFound):
        await put(storage, b"x", queue=q("missing"))
    with pytest.raises(errors.QueueNotFound):
        await put(storage, b"x", queue=q("t", 2))
    with pytest.raises(errors.QueueNotFound):
        await storage.read(q("t", -1), 0)
    assert (await storage.queue_offsets(q("t", 0))) == QueueOffsets(0, 0)


async def test_namespaces(storage: Engine) -> None:
    await storage.create_namespace("tenant-a")
    with pytest.raises(errors.NamespaceAlreadyExists):
        await storage.create_namespace("tenant-a")
    await storage.create_topic("tenant-a", "t")
    with pytest.raises(errors.InvalidArgument, match="still has topics"):
        await storage.delete_namespace("tenant-a")
    await storage.delete_topic("tenant-a", "t")
    await storage.delete_namespace("tenant-a")
    assert await storage.list_namespaces() == ["default"]


# -- append and read -------------------------------------------------------------------


async def test_message_fields_round_trip(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    message = Message(
        body=b"\x00\xffbody",
        key=b"k",
        tag="tagA",
        properties=(("x", b"1"), ("x", b"2"), ("y", b"")),
        message_group="g1",
        expiry_ms=9_999_999_999_999,
        content_type="application/json",
        correlation_id=b"corr",
        reply_to="replies",
        producer="client-1",
        born_timestamp_ms=123,
        born_host="10.0.0.1",
    )
    [result] = await storage.append([AppendRequest(entry=message, queues=(q(),))])
    [stored] = (await storage.read(q(), 0)).messages
    assert stored.message == message
    assert stored.message_id == result.message_id
    assert len(result.message_id) == 34
    assert stored.store_timestamp_ms == result.store_timestamp_ms


async def test_unstorable_value_is_refused_before_any_offset(storage: Engine) -> None:
    """A timestamp past int64 fails the append whole: the next message still gets
    offset 0, with no index gap behind it."""
    await storage.create_topic(NS, "t")
    with pytest.raises(errors.InvalidArgument, match="cannot be stored"):
        await put(storage, b"late", born_timestamp_ms=2**63)
    [result] = await storage.append([AppendRequest(entry=Message(body=b"ok"), queues=(q(),))])
    assert [p.offset for p in result.placements] == [0]
    assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [b"ok"]


async def test_oversize_message_is_refused_and_changes_nothing(make_engine: EngineFactory) -> None:
    async with make_engine(max_message_bytes=1024) as storage:
        await storage.create_topic(NS, "t")
        await storage.create_topic(NS, "small", TopicConfig(max_message_bytes=10))
        with pytest.raises(errors.MessageTooLarge):
            await put(storage, b"x" * 1025)
        with pytest.raises(errors.MessageTooLarge):
            await put(storage, b"x" * 11, queue=q("small"))
        await put(storage, b"x" * 1024)
        assert await storage.queue_offsets(q()) == QueueOffsets(0, 1)


async def test_multi_dispatch_indexes_one_body_into_many_queues(storage: Engine) -> None:
    await storage.create_topic(NS, "a", TopicConfig(queue_count=2))
    await storage.create_topic(NS, "b")
    await put(storage, b"first", queue=q("a", 1))
    [result] = await storage.append(
        [AppendRequest(entry=Message(body=b"fan"), queues=(q("a", 0), q("a", 1), q("b")))]
    )
    assert [(p.queue, p.offset) for p in result.placements] == [
        (q("a", 0), 0),
        (q("a", 1), 1),
        (q("b"), 0),
    ]
    for placement in result.placements:
        [stored] = (await storage.read(placement.queue, placement.offset)).messages
        assert stored.message.body == b"fan"
        assert stored.message_id == result.message_id
    with pytest.raises(errors.InvalidArgument, match="twice"):
        await storage.append([AppendRequest(entry=Message(body=b"x"), queues=(q("b"), q("b")))])


async def test_batch_entry_spans_offsets_and_reads_back_both_ways(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"before")
    batch = BatchEntry(
        format="test.v1",
        raw=b"RAW-BYTES",
        messages=tuple(Message(body=bytes([i])) for i in range(5)),
    )
    [result] = await storage.append([AppendRequest(entry=batch, queues=(q(),))])
    assert result.placements[0].offset == 1
    await put(storage, b"after")
    assert await storage.queue_offsets(q()) == QueueOffsets(0, 7)
    read = await storage.read(q(), 2, max_messages=3)
    assert [m.message.body for m in read.messages] == [b"\x01", b"\x02", b"\x03"]
    assert read.next_offset == 5
    batches = await storage.read_batches(q(), 3)
    assert (batches[0].base_offset, batches[0].count, batches[0].raw) == (1, 5, b"RAW-BYTES")
    assert batches[0].format == "test.v1"
    assert batches[1].base_offset == 6 and batches[1].messages[0].message.body == b"after"


async def test_read_limits(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, *(b"x" * 100 for _ in range(10)))
    assert len((await storage.read(q(), 0, max_messages=4)).messages) == 4
    assert len((await storage.read(q(), 0, max_bytes=250)).messages) == 2
    # At least one message, even over max_bytes, so a reader always progresses.
    assert len((await storage.read(q(), 0, max_bytes=1)).messages) == 1
    with pytest.raises(errors.OffsetOutOfRange):
        await storage.read(q(), 11)
    assert (await storage.read(q(), 10)).messages == ()


async def test_long_poll_wakes_on_append(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    reader = asyncio.create_task(storage.read(q(), 0, wait_ms=60_000))
    await asyncio.sleep(0)
    assert not reader.done()
    await put(storage, b"late")
    result = await asyncio.wait_for(reader, 10)
    assert [m.message.body for m in result.messages] == [b"late"]


async def test_long_poll_times_out_empty(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    reader = asyncio.create_task(storage.read(q(), 0, wait_ms=5_000))
    await asyncio.sleep(0)
    clock.advance(5_000)
    result = await asyncio.wait_for(reader, 10)
    assert result.messages == ()


async def test_offsets_by_timestamp(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    start = clock.now_ms()
    for i in range(5):
        await put(storage, bytes([i]))
        clock.advance(1000)
    assert await storage.offset_for_timestamp(q(), start) == 0
    assert await storage.offset_for_timestamp(q(), start + 2500) == 3
    assert await storage.offset_for_timestamp(q(), start + 99_000) == 5


# -- consumer groups: offsets ----------------------------------------------------------


async def test_commit_and_fetch_offsets(storage: Engine) -> None:
    await storage.create_topic(NS, "t", TopicConfig(queue_count=2))
    assert await storage.fetch_offset(NS, "g", q()) is None
    await storage.commit_offset(NS, "g", q(), 5, "meta")
    await storage.commit_offset(NS, "g", q("t", 1), 7)
    fetched = await storage.fetch_offset(NS, "g", q())
    assert fetched is not None and (fetched.offset, fetched.metadata) == (5, "meta")
    assert {
        r.queue_id: c.offset for r, c in (await storage.list_group_offsets(NS, "g")).items()
    } == {
        0: 5,
        1: 7,
    }
    assert await storage.list_groups(NS) == ["g"]
    await storage.delete_group_offsets(NS, "g", [q()])
    assert await storage.fetch_offset(NS, "g", q()) is None
    with pytest.raises(errors.InvalidArgument):
        await storage.commit_offset(NS, "g", q(), -1)


# -- consumer groups: pop mode -----------------------------------------------------------


async def test_pop_ack_and_redelivery_after_invisibility(
    storage: Engine, clock: ManualClock
) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a", b"b")
    first = await storage.pop(NS, "g", [q()], max_messages=1, invisible_ms=10_000)
    assert [(m.offset, m.delivery_attempt) for m in first] == [(0, 1)]
    second = await storage.pop(NS, "g", [q()], max_messages=5, invisible_ms=10_000)
    assert [m.offset for m in second] == [1]
    await storage.ack(NS, "g", second[0].receipt or "")
    assert await storage.pop(NS, "g", [q()]) == []
    clock.advance(10_000)
    again = await storage.pop(NS, "g", [q()], invisible_ms=10_000)
    assert [(m.offset, m.delivery_attempt) for m in again] == [(0, 2)]
    with pytest.raises(errors.InvalidReceipt, match="stale"):
        await storage.ack(NS, "g", first[0].receipt or "")
    await storage.ack(NS, "g", again[0].receipt or "")
    assert await storage.pending_count(NS, "g", q()) == 0


async def test_ack_many_reports_each_receipt(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a", b"b", b"c")
    popped = await storage.pop(NS, "g", [q()], max_messages=3)
    receipts = [m.receipt or "" for m in popped]
    outcomes = await storage.ack_many(NS, "g", [receipts[0], "junk", receipts[2], receipts[0]])
    assert outcomes == [None, "invalid_receipt", None, "invalid_receipt"]
    assert await storage.inflight_count(NS, "g", q()) == 1
    assert await storage.pending_count(NS, "g", q()) == 1


async def test_groups_are_independent(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a")
    [a] = await storage.pop(NS, "g1", [q()])
    [b] = await storage.pop(NS, "g2", [q()])
    assert a.offset == b.offset == 0
    with pytest.raises(errors.InvalidReceipt):
        await storage.ack(NS, "g2", a.receipt or "")


async def test_nack_and_change_invisibility(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a")
    [m] = await storage.pop(NS, "g", [q()], invisible_ms=60_000)
    longer = await storage.change_invisibility(NS, "g", m.receipt or "", 120_000)
    assert longer.next_visible_ms == clock.now_ms() + 120_000
    with pytest.raises(errors.InvalidReceipt):
        await storage.ack(NS, "g", m.receipt or "")
    await storage.change_invisibility(NS, "g", longer.receipt or "", 0)  # a nack
    [again] = await storage.pop(NS, "g", [q()])
    assert (again.offset, again.delivery_attempt) == (0, 2)


async def test_nack_with_delay_and_dead_letter_now(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"retry", b"poison")
    retry, poison = await storage.pop(NS, "g", [q()], max_messages=2, invisible_ms=60_000)
    await storage.nack(NS, "g", retry.receipt or "", delay_ms=1000)
    await storage.dead_letter(NS, "g", poison.receipt or "")
    assert await storage.pop(NS, "g", [q()]) == []
    clock.advance(1000)
    [again] = await storage.pop(NS, "g", [q()], max_messages=5)
    assert (again.message.body, again.delivery_attempt) == (b"retry", 2)
    [dead] = (await storage.read(q("%DLQ%g"), 0)).messages
    assert dead.message.body == b"poison" and dead.message_id == poison.message_id
    assert dead.message.property("DLQ_DELIVERY_ATTEMPTS") == b"1"
    with pytest.raises(errors.InvalidReceipt):
        await storage.dead_letter(NS, "g", poison.receipt or "")


@pytest.mark.parametrize("receipt", ["", "garbage!", "AAAA", "A" * 500])
async def test_bad_receipts(storage: Engine, receipt: str) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a")
    with pytest.raises(errors.InvalidReceipt):
        await storage.ack(NS, "g", receipt)
    assert len(await storage.pop(NS, "g", [q()])) == 1


async def test_receipt_from_another_namespace_is_refused(storage: Engine) -> None:
    await storage.create_namespace("other")
    await storage.create_topic(NS, "t")
    await put(storage, b"a")
    [m] = await storage.pop(NS, "g", [q()])
    with pytest.raises(errors.InvalidReceipt, match="namespace"):
        await storage.ack("other", "g", m.receipt or "")


async def test_max_attempts_moves_message_to_dead_letter_queue(
    storage: Engine, clock: ManualClock
) -> None:
    await storage.create_topic(NS, "t")
    await storage.set_group_config(NS, "g", GroupConfig(max_delivery_attempts=2))
    await put(storage, b"poison", b"fine")
    for attempt in (1, 2):
        popped = await storage.pop(NS, "g", [q()], max_messages=1, invisible_ms=1000)
        assert [(m.message.body, m.delivery_attempt) for m in popped] == [(b"poison", attempt)]
        clock.advance(1000)
    [fine] = await storage.pop(NS, "g", [q()], max_messages=5, invisible_ms=1000)
    assert fine.message.body == b"fine"
    dead = (await storage.read(q("%DLQ%g"), 0)).messages
    assert [m.message.body for m in dead] == [b"poison"]
    assert dead[0].message.property("DLQ_DELIVERY_ATTEMPTS") == b"2"
    assert dead[0].message.property("DLQ_ORIGIN_TOPIC") == b"t"


async def test_fifo_group_holds_back_a_message_group(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    await storage.set_group_config(NS, "g", GroupConfig(fifo=True))
    for body, group in [(b"a1", "A"), (b"a2", "A"), (b"b1", "B"), (b"b2", "B")]:
        await put(storage, body, message_group=group)
    first = await storage.pop(NS, "g", [q()], max_messages=10, invisible_ms=5000)
    assert [m.message.body for m in first] == [b"a1", b"b1"]
    assert await storage.pop(NS, "g", [q()], max_messages=10) == []
    await storage.ack(NS, "g", first[1].receipt or "")
    [b2] = await storage.pop(NS, "g", [q()], max_messages=10)
    assert b2.message.body == b"b2"
    clock.advance(5000)  # a1 times out: it comes back before a2
    [a1] = await storage.pop(NS, "g", [q()], max_messages=10)
    assert (a1.message.body, a1.delivery_attempt) == (b"a1", 2)


async def test_tag_filter_skips_other_tags(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"1", tag="red")
    await put(storage, b"2", tag="blue")
    await put(storage, b"3")
    popped = await storage.pop(NS, "g", [q()], max_messages=10, tags=frozenset({"blue"}))
    assert [m.message.body for m in popped] == [b"2"]
    assert await storage.pending_count(NS, "g", q()) == 1


async def test_expired_messages_are_not_popped(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"old", expiry_ms=clock.now_ms() + 1000)
    await put(storage, b"new")
    clock.advance(1000)
    popped = await storage.pop(NS, "g", [q()], max_messages=10)
    assert [m.message.body for m in popped] == [b"new"]


async def test_pop_long_poll_wakes_on_append(storage: Engine) -> None:
    await storage.create_topic(NS, "t", TopicConfig(queue_count=2))
    popper = asyncio.create_task(storage.pop(NS, "g", [q("t", 0), q("t", 1)], wait_ms=60_000))
    await asyncio.sleep(0)
    await put(storage, b"x", queue=q("t", 1))
    [m] = await asyncio.wait_for(popper, 10)
    assert (m.queue.queue_id, m.message.body) == (1, b"x")


async def test_pop_long_poll_wakes_on_redelivery(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"x")
    await storage.pop(NS, "g", [q()], invisible_ms=1000)
    popper = asyncio.create_task(storage.pop(NS, "g", [q()], wait_ms=60_000))
    await asyncio.sleep(0)
    clock.advance(1000)
    [m] = await asyncio.wait_for(popper, 10)
    assert m.delivery_attempt == 2


async def test_pop_long_poll_wakes_when_a_fifo_ack_releases_the_next(storage: Engine) -> None:
    await storage.create_topic(NS, "t")
    await storage.set_group_config(NS, "g", GroupConfig(fifo=True))
    await put(storage, b"a1", message_group="A")
    await put(storage, b"a2", message_group="A")
    [a1] = await storage.pop(NS, "g", [q()], invisible_ms=60_000)
    popper = asyncio.create_task(storage.pop(NS, "g", [q()], wait_ms=60_000))
    await asyncio.sleep(0)
    await storage.ack(NS, "g", a1.receipt or "")
    [a2] = await asyncio.wait_for(popper, 10)
    assert a2.message.body == b"a2"


class HeldFsync:
    """Holds every fdatasync of the commit log until released: what a pop returns
    while its hand-out record waits for the disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released = threading.Event()
        real = os.fdatasync

        def held(fd: int) -> None:
            self.released.wait(60)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", held)

    def release(self) -> None:
        self.released.set()


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(2000):
        if await condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def test_pop_without_durable_returns_once_its_hand_out_is_written(
    make_engine: EngineFactory,
    engine_config: EngineConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await put(storage, b"a", b"b")
        fsync = HeldFsync(monkeypatch)
        [m] = await asyncio.wait_for(
            storage.pop(NS, "g", [q()], invisible_ms=60_000, durable=False), 30
        )
        assert (m.offset, m.delivery_attempt) == (0, 1)
        # Written, not yet durable: what a crash of the process leaves keeps it.
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")
        durable = asyncio.create_task(storage.pop(NS, "g", [q()], invisible_ms=60_000))
        await wait_for(lambda: inflight(storage, 2), "the second hand-out")
        assert not durable.done()  # a durable pop waits for the fsync
        fsync.release()
        [second] = await asyncio.wait_for(durable, 30)
        assert second.offset == 1
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        assert await storage.inflight_count(NS, "g", q()) == 1
        [after] = await storage.pop(NS, "g", [q()])
        assert after.offset == 1  # offset 0 is still handed out


async def test_hand_outs_lost_by_a_crash_never_share_a_receipt_with_later_ones(
    make_engine: EngineFactory, engine_config: EngineConfig, tmp_path: Path, clock: ManualClock
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await put(storage, b"a")
        await storage.checkpoint()
        shutil.copytree(engine_config.data_dir, tmp_path / "lost")  # before the hand-out
        [m] = await storage.pop(NS, "g", [q()], durable=False)
    clock.advance(1)  # a restart takes at least a millisecond
    async with make_engine(data_dir=tmp_path / "lost") as storage:
        [again] = await storage.pop(NS, "g", [q()])
        assert again.offset == m.offset and again.receipt != m.receipt
        with pytest.raises(errors.InvalidReceipt):
            await storage.ack(NS, "g", m.receipt or "")


async def inflight(storage: Engine, count: int) -> bool:
    return await storage.inflight_count(NS, "g", q()) == count


@pytest.mark.parametrize("delivered_before", [0, 1])
async def test_a_pop_cancelled_while_waiting_for_durability_gives_its_messages_back(
    make_engine: EngineFactory,
    engine_config: EngineConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    delivered_before: int,
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await put(storage, b"a")
        if delivered_before:
            [m] = await storage.pop(NS, "g", [q()])
            await storage.nack(NS, "g", m.receipt or "")
        fsync = HeldFsync(monkeypatch)
        popper = asyncio.create_task(storage.pop(NS, "g", [q()], invisible_ms=60_000))
        await wait_for(lambda: next_visible_later(storage), "the hand-out")
        popper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await popper
        fsync.release()
        # Visible again at once, and this delivery is not counted.
        [again] = await storage.pop(NS, "g", [q()], invisible_ms=0)
        assert (again.offset, again.delivery_attempt) == (0, delivered_before + 1)
        await storage.checkpoint()
        await storage.nack(NS, "g", again.receipt or "")  # the next pop counts again
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")  # replays the log
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        [after] = await storage.pop(NS, "g", [q()])
        assert after.delivery_attempt == delivered_before + 2


@pytest.mark.parametrize("delivered_before", [0, 1])
async def test_give_back_undoes_the_pops_that_handed_out(
    make_engine: EngineFactory, delivered_before: int
) -> None:
    """What a caller that stopped waiting gives back (the separated form's late pop
    answer) is visible again at once and its delivery is not counted: with two
    attempts allowed, a message nacked once and then given back is still delivered,
    not dead-lettered. Receipts acked since are skipped; a reopened engine has it."""
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await storage.set_group_config(NS, "g", GroupConfig(max_delivery_attempts=2))
        await put(storage, b"a")
        await put(storage, b"b")
        if delivered_before:
            [m] = await storage.pop(NS, "g", [q()])
            await storage.nack(NS, "g", m.receipt or "")
        late = await storage.pop(NS, "g", [q()], max_messages=2, invisible_ms=60_000)
        assert [m.delivery_attempt for m in late] == [delivered_before + 1, 1]
        await storage.ack(NS, "g", late[1].receipt or "")
        await storage.give_back(NS, "g", [m.receipt or "" for m in late])
        [again] = await storage.pop(NS, "g", [q()], max_messages=2, invisible_ms=0)
        assert (again.offset, again.delivery_attempt) == (0, delivered_before + 1)
        await storage.give_back(NS, "g", [again.receipt or ""])
    async with make_engine() as storage:  # reopened: the give-back was logged
        [after] = await storage.pop(NS, "g", [q()], max_messages=2)
        assert (after.offset, after.delivery_attempt) == (0, delivered_before + 1)


async def test_a_pop_cancelled_while_a_checkpoint_holds_writers_gives_back_after_it(
    storage: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await storage.create_topic(NS, "t")
    await put(storage, b"a")
    fsync = HeldFsync(monkeypatch)
    popper = asyncio.create_task(storage.pop(NS, "g", [q()], invisible_ms=60_000))
    await wait_for(lambda: next_visible_later(storage), "the hand-out")
    checkpoint = asyncio.create_task(storage.checkpoint())  # closes the gate, waits
    await wait_for(lambda: gate_closed(storage), "the checkpoint's gate")
    popper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await popper
    assert await next_visible_later(storage)  # no record while writers are held
    fsync.release()
    await asyncio.wait_for(checkpoint, 30)
    [again] = await asyncio.wait_for(storage.pop(NS, "g", [q()], wait_ms=30_000), 30)
    assert (again.offset, again.delivery_attempt) == (0, 1)


async def gate_closed(storage: Engine) -> bool:
    return not storage._gate.is_set()


async def next_visible_later(storage: Engine) -> bool:
    """The message is handed out for 60 s (by the pop under test)."""
    cursor = storage._state.cursors.get((NS, "g"), {})
    return any(
        state.deadline_ms > storage.clock.now_ms()
        for c in cursor.values()
        for state in c.inflight.values()
    )


@pytest.mark.parametrize("release", ["nack", "change_invisibility", "ack_many", "dead_letter"])
async def test_pop_long_poll_wakes_on_release(storage: Engine, release: str) -> None:
    """Whatever frees a FIFO group's head (or makes a message visible sooner) wakes a
    waiting pop, instead of leaving it asleep until its own timeout."""
    await storage.create_topic(NS, "t")
    await storage.set_group_config(NS, "g", GroupConfig(fifo=True))
    await put(storage, b"a1", message_group="A")
    await put(storage, b"a2", message_group="A")
    [a1] = await storage.pop(NS, "g", [q()], invisible_ms=60_000)
    receipt = a1.receipt or ""
    popper = asyncio.create_task(storage.pop(NS, "g", [q()], wait_ms=60_000))
    await asyncio.sleep(0)
    if release == "nack":
        await storage.nack(NS, "g", receipt)
        expected = b"a1"
    elif release == "change_invisibility":
        await storage.change_invisibility(NS, "g", receipt, 0)
        expected = b"a1"
    elif release == "ack_many":
        assert await storage.ack_many(NS, "g", [receipt]) == [None]
        expected = b"a2"
    else:
        await storage.dead_letter(NS, "g", receipt)
        expected = b"a2"
    [m] = await asyncio.wait_for(popper, 10)
    assert m.message.body == expected


# -- delay, transactions, keyed latest, metadata ---------------------------------------------


async def wait_for_offsets(storage: Engine, queue: QueueRef, latest: int) -> None:
    async with asyncio.timeout(10):
        while (await storage.queue_offsets(queue)).latest < latest:
            await asyncio.sleep(0.001)


async def test_delayed_message_is_invisible_until_due(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    [result] = await storage.append(
        [
            AppendRequest(
                entry=Message(body=b"later", delivery_time_ms=clock.now_ms() + 5000), queues=(q(),)
            )
        ]
    )
    assert result.placements == ()
    await put(storage, b"now")
    assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [b"now"]
    clock.advance(5000)
    await wait_for_offsets(storage, q(), 2)
    [later] = (await storage.read(q(), 1)).messages
    assert (later.message.body, later.message_id) == (b"later", result.message_id)


async def test_cancel_delayed(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t")
    [result] = await storage.append(
        [
            AppendRequest(
                entry=Message(body=b"x", delivery_time_ms=clock.now_ms() + 5000), queues=(q(),)
            )
        ]
    )
    assert await storage.cancel_delayed(NS, result.message_id)
    assert not await storage.cancel_delayed(NS, result.message_id)
    clock.advance(10_000)
    await put(storage, b"marker")
    await wait_for_offsets(storage, q(), 1)
    assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [b"marker"]


async def test_delayed_message_survives_restart(
    make_engine: EngineFactory, clock: ManualClock
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await storage.append(
            [
                AppendRequest(
                    entry=Message(body=b"d", delivery_time_ms=clock.now_ms() + 5000), queues=(q(),)
                )
            ]
        )
    async with make_engine() as storage:
        clock.advance(5000)
        await wait_for_offsets(storage, q(), 1)
    async with make_engine() as storage:
        assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [b"d"]


async def test_transaction_commit_and_rollback(make_engine: EngineFactory) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        keep = await storage.append_half(
            AppendRequest(entry=Message(body=b"keep"), queues=(q(),)), producer_group="pg"
        )
        drop = await storage.append_half(AppendRequest(entry=Message(body=b"drop"), queues=(q(),)))
        assert await storage.queue_offsets(q()) == QueueOffsets(0, 0)
        assert {h.transaction_id for h in await storage.list_undecided(NS)} == {
            keep.transaction_id,
            drop.transaction_id,
        }
        assert keep.producer_group == "pg"
    async with make_engine() as storage:
        assert len(await storage.list_undecided(NS)) == 2
        result = await storage.end_transaction(NS, keep.transaction_id, commit=True)
        assert result is not None and result.placements[0].offset == 0
        assert await storage.end_transaction(NS, drop.transaction_id, commit=False) is None
        with pytest.raises(errors.TransactionNotFound):
            await storage.end_transaction(NS, drop.transaction_id, commit=True)
    async with make_engine() as storage:
        assert await storage.list_undecided(NS) == []
        assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [b"keep"]


async def test_keyed_latest_value(make_engine: EngineFactory) -> None:
    async with make_engine() as storage:
        await storage.put_latest(NS, "sensors", b"room/1", Message(body=b"20"))
        await storage.put_latest(NS, "sensors", b"room/1", Message(body=b"21"))
        await storage.put_latest(NS, "sensors", b"room/2", Message(body=b"19"))
        await storage.put_latest(NS, "sensors", b"room/2", None)
    async with make_engine() as storage:
        latest = await storage.get_latest(NS, "sensors", b"room/1")
        assert latest is not None and latest.body == b"21"
        assert await storage.get_latest(NS, "sensors", b"room/2") is None
        assert [(k, m.body) for k, m in await storage.list_latest(NS, "sensors")] == [
            (b"room/1", b"21")
        ]


async def test_metadata_store(make_engine: EngineFactory) -> None:
    async with make_engine() as storage:
        await storage.meta_put(NS, "exchange", "logs", {"type": "fanout", "durable": True})
        await storage.meta_put(NS, "exchange", "tmp", {"type": "direct"})
        assert await storage.meta_delete(NS, "exchange", "tmp")
        assert not await storage.meta_delete(NS, "exchange", "tmp")
        with pytest.raises(errors.InvalidArgument):
            await storage.meta_put(NS, "exchange", "bad", {"x": object()})
    async with make_engine() as storage:
        assert await storage.meta_list(NS, "exchange") == {
            "logs": {"type": "fanout", "durable": True}
        }
        assert await storage.meta_get(NS, "exchange", "logs") == {"type": "fanout", "durable": True}


# -- recovery, checkpoints and retention ---------------------------------------------------


async def test_state_survives_checkpoint_and_restart(make_engine: EngineFactory) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t", TopicConfig(queue_count=2))
        await put(storage, b"a", b"b", b"c")
        [m] = await storage.pop(NS, "g", [q()])
        await storage.ack(NS, "g", m.receipt or "")
        await storage.commit_offset(NS, "reader", q(), 2)
        await storage.checkpoint()
        await put(storage, b"d")  # after the checkpoint: comes back from the log
        [inflight] = await storage.pop(NS, "g", [q()], invisible_ms=60_000)
    async with make_engine() as storage:
        assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [
            b"a",
            b"b",
            b"c",
            b"d",
        ]
        committed = await storage.fetch_offset(NS, "reader", q())
        assert committed is not None and committed.offset == 2
        await storage.ack(NS, "g", inflight.receipt or "")  # the receipt is still valid
        popped = await storage.pop(NS, "g", [q()], max_messages=10)
        assert [m.message.body for m in popped] == [b"c", b"d"]


async def test_retention_deletes_whole_segments(
    make_engine: EngineFactory, clock: ManualClock
) -> None:
    async with make_engine(segment_bytes=4096, retention_bytes=8192) as storage:
        await storage.create_topic(NS, "t")
        for _ in range(40):
            await put(storage, b"x" * 500)
        await storage.checkpoint()
        await storage.enforce_retention()
        offsets = await storage.queue_offsets(q())
        assert offsets.latest == 40 and offsets.earliest > 0
        with pytest.raises(errors.OffsetOutOfRange):
            await storage.read(q(), 0)
        first = (await storage.read(q(), offsets.earliest)).messages[0]
        assert first.offset == offsets.earliest
        popped = await storage.pop(NS, "g", [q()], max_messages=100)
        assert popped[0].offset == offsets.earliest
    async with make_engine(segment_bytes=4096, retention_bytes=8192) as storage:
        assert await storage.queue_offsets(q()) == offsets


async def test_topic_retention_by_time(storage: Engine, clock: ManualClock) -> None:
    await storage.create_topic(NS, "t", TopicConfig(retention_ms=10_000))
    await put(storage, b"old")
    clock.advance(20_000)
    await put(storage, b"new")
    await storage.enforce_retention()
    assert await storage.queue_offsets(q()) == QueueOffsets(1, 2)


async def test_delete_records_moves_the_start_and_survives_restart(
    make_engine: EngineFactory,
) -> None:
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        await put(storage, b"a", b"b", b"c")
        assert await storage.delete_records(q(), 2) == QueueOffsets(2, 3)
        assert await storage.delete_records(q(), 1) == QueueOffsets(2, 3)  # never moves back
        with pytest.raises(errors.OffsetOutOfRange):
            await storage.delete_records(q(), 4)
        with pytest.raises(errors.OffsetOutOfRange):
            await storage.read(q(), 1)
        await storage.checkpoint()
        await storage.delete_records(q(), 3)  # after the checkpoint: replayed from the log
    async with make_engine() as storage:
        assert await storage.queue_offsets(q()) == QueueOffsets(3, 3)


async def test_unlimited_retention_keeps_unconsumed_segments(make_engine: EngineFactory) -> None:
    async with make_engine(segment_bytes=4096, retention_bytes=4096) as storage:
        await storage.create_topic(NS, "kept", TopicConfig(retention_ms=UNLIMITED))
        await storage.create_topic(NS, "t")
        await put(storage, b"k" * 500, queue=q("kept"))
        for _ in range(40):
            await put(storage, b"x" * 500)
        await storage.checkpoint()
        await storage.enforce_retention()
        assert (await storage.queue_offsets(q())).earliest == 0  # held by "kept"
        await storage.delete_records(q("kept"), 1)  # consumed: now it may go
        await storage.checkpoint()
        await storage.enforce_retention()
        assert (await storage.queue_offsets(q())).earliest > 0
        assert await storage.queue_offsets(q("kept")) == QueueOffsets(1, 1)


async def test_closed_engine_refuses_calls(make_engine: EngineFactory) -> None:
    storage = make_engine()
    await storage.start()
    await storage.close()
    with pytest.raises(errors.StorageClosed):
        await storage.create_topic(NS, "t")


async def test_registered_batch_format_is_stored_once_and_expanded_on_read(
    storage: Engine,
) -> None:
    """A format with a registered expander keeps only the raw bytes; reads one message
    at a time expand them."""
    from polymq.storage import batch_formats

    def split_lines(raw: bytes) -> tuple[Message, ...]:
        return tuple(Message(body=line) for line in raw.split(b"\n"))

    batch_formats.register("test.lines", split_lines)
    await storage.create_topic(NS, "t")
    raw = b"one\ntwo\nthree"
    await storage.append(
        [AppendRequest(entry=BatchEntry(format="test.lines", raw=raw, count=3), queues=(q(),))]
    )
    assert [m.message.body for m in (await storage.read(q(), 0)).messages] == [
        b"one",
        b"two",
        b"three",
    ]
    [batch] = await storage.read_batches(q(), 1)
    assert (batch.base_offset, batch.count, batch.raw) == (0, 3, raw)
    with pytest.raises(errors.InvalidArgument, match="unregistered"):
        await storage.append(
            [AppendRequest(entry=BatchEntry(format="nope", raw=b"x", count=1), queues=(q(),))]
        )
    with pytest.raises(errors.InvalidArgument, match="count"):
        await storage.append(
            [
                AppendRequest(
                    entry=BatchEntry(format="x", raw=b"", messages=(Message(),), count=2),
                    queues=(q(),),
                )
            ]
        )


async def test_dedup_key_stores_a_retry_once_within_the_window(
    make_engine: EngineFactory, clock: ManualClock
) -> None:
    def request(body: bytes, key: str) -> AppendRequest:
        return AppendRequest(entry=Message(body=body), queues=(q(),), dedup_key=key)

    async with make_engine(dedup_window_ms=60_000) as storage:
        await storage.create_topic(NS, "t")
        first, again, other = await storage.append(
            [request(b"a", "k1"), request(b"a-retry", "k1"), request(b"b", "k2")]
        )
        assert (first.duplicate, again.duplicate, other.duplicate) == (False, True, False)
        assert again.message_id == first.message_id and again.placements == first.placements
        await storage.checkpoint()
        [late] = await storage.append([request(b"c", "k3")])  # after the checkpoint: in the log
    async with make_engine(dedup_window_ms=60_000) as storage:
        [retry1, retry3] = await storage.append([request(b"x", "k1"), request(b"y", "k3")])
        assert retry1.duplicate and retry1.message_id == first.message_id
        assert retry3.duplicate and retry3.placements == late.placements
        clock.advance(60_000)
        [fresh] = await storage.append([request(b"z", "k1")])
        assert not fresh.duplicate
        bodies = [m.message.body for m in (await storage.read(q(), 0)).messages]
        assert bodies == [b"a", b"b", b"c", b"z"]
        with pytest.raises(errors.InvalidName):
            await storage.append([request(b"bad", "")])


async def test_dedup_keys_come_back_from_the_log_after_a_crash(
    make_engine: EngineFactory, engine_config: EngineConfig, tmp_path: Path
) -> None:
    request = AppendRequest(entry=Message(body=b"once"), queues=(q(),), dedup_key="k")
    async with make_engine() as storage:
        await storage.create_topic(NS, "t")
        [first] = await storage.append([request])
        # The files as a crash leaves them: the append is only in the log.
        shutil.copytree(engine_config.data_dir, tmp_path / "crashed")
    async with make_engine(data_dir=tmp_path / "crashed") as storage:
        [retry] = await storage.append([request])
        assert retry.duplicate and retry.placements == first.placements
        assert await storage.queue_offsets(q()) == QueueOffsets(0, 1)


async def test_read_batches_of_many_small_messages_returns_them_all_in_order(
    storage: Engine,
) -> None:
    await storage.create_topic(NS, "t")
    await storage.append(
        [AppendRequest(entry=Message(body=b"%d" % i), queues=(q(),)) for i in range(700)]
    )
    batches = await storage.read_batches(q(), 0)
    assert [b.base_offset for b in batches] == list(range(700))
    assert [b.messages[0].message.body for b in batches] == [b"%d" % i for i in range(700)]
