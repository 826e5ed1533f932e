"""Property-based tests of the embedded engine against simple in-memory models.

Hypothesis does not drive coroutines, so every example runs the engine in its own
event loop (``asyncio.run`` for single properties, an ``asyncio.Runner`` kept for the
life of one state machine) on its own temporary directory, with a fresh ManualClock.

"Reopen" comes in three kinds: a clean close (checkpoint) and start, a crash image
(the data directory copied as it is on disk while the engine runs, then opened: the
log is replayed from the last checkpoint), and a checkpoint followed by a crash image
(checkpoint plus a log tail to replay).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from polymq.storage import batch_formats
from polymq.storage.clock import ManualClock
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.errors import (
    InvalidArgument,
    InvalidReceipt,
    TopicNotFound,
    TransactionNotFound,
)
from polymq.storage.model import (
    DEFAULT_NAMESPACE,
    AppendRequest,
    AppendResult,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    HalfMessage,
    Message,
    Placement,
    QueueRef,
    StoredMessage,
    TopicConfig,
)

T = TypeVar("T")

NS = DEFAULT_NAMESPACE
CLOSE, CRASH, CHECKPOINT_CRASH = "close", "crash", "checkpoint+crash"
# Each engine test runs twice: reopening only by clean close, and only from crash images
# (so a recovery bug fails the "crash" variant without hiding everything else).
RECOVERY = {"clean": (CLOSE,), "crash": (CRASH, CHECKPOINT_CRASH)}
recovery_modes = pytest.mark.parametrize("modes", list(RECOVERY.values()), ids=list(RECOVERY))

# No "explain" phase: its line tracer makes shrinking an engine run many times slower.
PHASES_WITHOUT_EXPLAIN = tuple(p for p in Phase if p is not Phase.explain)
PROPERTY_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    phases=PHASES_WITHOUT_EXPLAIN,
    suppress_health_check=[HealthCheck.too_slow],
)
MACHINE_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    phases=PHASES_WITHOUT_EXPLAIN,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

SETTLE_TIMEOUT_S = 1.5  # bound on waiting for the background delivery task


# -- harness -----------------------------------------------------------------------------


class EngineHost:
    """Owns the data directories of one example and the engine currently open on them."""

    def __init__(self, root: Path, clock: ManualClock, **config: Any) -> None:
        self.root = root
        self.clock = clock
        self.config = config
        self.generation = 0
        self.starts = 0
        self.path = root / "data-0"
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "engine not started"
        return self._engine

    async def start(self) -> Engine:
        config = EngineConfig(data_dir=self.path, durability=Durability.SYNC, **self.config)
        self._engine = Engine(config, clock=self.clock)
        await self._engine.start()
        self.starts += 1
        return self._engine

    async def reopen(self, how: str) -> Engine:
        old = self.engine
        if how == CLOSE:
            await old.close()
        else:
            if how == CHECKPOINT_CRASH:
                await old.checkpoint()
            # Every call we awaited is durable, so the files as they are now are what a
            # crash (kill -9, power loss after the last fsync) would leave behind.
            self.generation += 1
            image = self.root / f"data-{self.generation}"
            shutil.copytree(self.path, image)
            await old.close()
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = image
        return await self.start()

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()


@contextmanager
def temp_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="polymq-props-") as name:
        yield Path(name)


def data_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def settle(
    condition: Callable[[], Awaitable[bool]], timeout_s: float = SETTLE_TIMEOUT_S
) -> bool:
    """Let background tasks run until ``await condition()`` is true or the time is up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if await condition():
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.001)


async def quiesce() -> None:
    """A few turns of the loop, so anything a background task would wrongly do shows."""
    for _ in range(5):
        await asyncio.sleep(0.001)


class EngineMachine(RuleBasedStateMachine):
    """A state machine with an engine in a private loop, directory and clock."""

    reopen_modes: tuple[str, ...] = (CLOSE,)

    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="polymq-machine-")
        self.clock = ManualClock()
        self.host = EngineHost(Path(self._tmp.name), self.clock)
        self.runner = asyncio.Runner()
        self.run(self.host.start())

    @property
    def engine(self) -> Engine:
        return self.host.engine

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    @rule(data=st.data())
    def reopen(self, data: st.DataObject) -> None:
        how = data.draw(st.sampled_from(self.reopen_modes), label="reopen")
        self.run(self.host.reopen(how))

    def teardown(self) -> None:
        try:
            self.run(self.host.close())
        finally:
            self.runner.close()
            self._tmp.cleanup()


M = TypeVar("M", bound=EngineMachine)


def run_machine(machine: type[M], modes: tuple[str, ...]) -> None:
    """Run a machine whose reopen rule uses only ``modes``."""
    name = f"{machine.__name__}_{'_'.join(m.replace('+', '_') for m in modes)}"
    variant = cast(type[M], type(name, (machine,), {"reopen_modes": modes}))
    run_state_machine_as_test(variant, settings=MACHINE_SETTINGS)


# -- strategies --------------------------------------------------------------------------

SMALL_BLOB = st.binary(max_size=12)
BODIES = st.binary(max_size=48)
PROPERTIES = st.lists(
    st.tuples(st.sampled_from(["k", "k", "ü", "x-y"]), SMALL_BLOB), max_size=3
).map(tuple)


NO_GROUP: st.SearchStrategy[str | None] = st.none()


def plain_messages(groups: st.SearchStrategy[str | None] = NO_GROUP) -> st.SearchStrategy[Message]:
    """Messages that are visible at once and never expire (no timing fields set)."""
    return st.builds(
        Message,
        body=BODIES,
        key=st.none() | SMALL_BLOB,
        tag=st.none() | st.sampled_from(["a", "b"]),
        properties=PROPERTIES,
        message_group=groups,
        content_type=st.none() | st.just("text/plain"),
        correlation_id=st.none() | SMALL_BLOB,
        producer=st.none() | st.text(max_size=6),
        born_timestamp_ms=st.none() | st.integers(min_value=0, max_value=2**40),
    )


# A batch format for raw-only batches: the engine stores just ``raw`` and expands it
# with the registered function when a reader wants messages.
TEST_BATCH_FORMAT = "polymq.test.properties.v1"


def expand_test_batch(raw: bytes) -> tuple[Message, ...]:
    """u16 length + body, repeated."""
    messages = []
    position = 0
    while position < len(raw):
        (size,) = struct.unpack_from("<H", raw, position)
        body = raw[position + 2 : position + 2 + size]
        messages.append(Message(body=body, key=b"expanded", properties=(("i", b"%d" % position),)))
        position += 2 + size
    return tuple(messages)


def raw_only_batch(bodies: list[bytes]) -> BatchEntry:
    raw = b"".join(struct.pack("<H", len(body)) + body for body in bodies)
    return BatchEntry(format=TEST_BATCH_FORMAT, raw=raw, count=len(bodies))


batch_formats.register(TEST_BATCH_FORMAT, expand_test_batch)


def batch_messages(entry: BatchEntry) -> tuple[Message, ...]:
    """What a message-by-message reader gets from a batch."""
    return entry.messages or expand_test_batch(entry.raw)


BATCH_ENTRIES = st.builds(
    BatchEntry,
    format=st.sampled_from(["kafka.v2", "x", ""]),
    raw=st.binary(max_size=96),
    messages=st.lists(plain_messages(), min_size=1, max_size=4).map(tuple),
) | st.lists(BODIES, min_size=1, max_size=4).map(raw_only_batch)

JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates survive JSON escaping
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)


def subsets(items: Sequence[T]) -> st.SearchStrategy[tuple[T, ...]]:
    """Non-empty subsets, in random order (dispatch order is part of the request)."""
    return st.lists(st.sampled_from(items), min_size=1, max_size=len(items), unique=True).map(tuple)


# -- 2. offsets, placements, reads -------------------------------------------------------

OFFSET_QUEUES = (
    QueueRef(NS, "t", 0),
    QueueRef(NS, "t", 1),
    QueueRef(NS, "t", 2),
    QueueRef(NS, "ü topic", 0),
)


@dataclass(frozen=True)
class Expected:
    """One offset of a queue as the model predicts it."""

    message: Message
    message_id: str
    store_ms: int
    base: int  # first offset of the stored entry
    entry: Message | BatchEntry


def expected_entries(
    request: AppendRequest,
    result: AppendResult,
    offsets: dict[QueueRef, int],
    only: QueueRef | None = None,
) -> Iterator[tuple[QueueRef, list[Expected]]]:
    entry = request.entry
    messages = (entry,) if isinstance(entry, Message) else batch_messages(entry)
    for queue in request.queues if only is None else (only,):
        base = offsets[queue]
        expected = []
        for index, message in enumerate(messages):
            message_id = result.message_id
            if len(messages) > 1:
                message_id = f"{message_id}-{index}"
            expected.append(Expected(message, message_id, result.store_timestamp_ms, base, entry))
        yield queue, expected


async def check_offset_model(
    engine: Engine, model: dict[QueueRef, list[Expected]], data: st.DataObject
) -> None:
    for queue, expected in model.items():
        offsets = await engine.queue_offsets(queue)
        assert (offsets.earliest, offsets.latest) == (0, len(expected)), queue

        # Everything, in order, byte for byte.
        result = await engine.read(queue, 0, max_messages=len(expected) + 1, max_bytes=1 << 30)
        assert result.next_offset == len(expected)
        assert [m.offset for m in result.messages] == list(range(len(expected)))
        for stored, want in zip(result.messages, expected, strict=True):
            assert stored.queue == queue
            assert stored.message == want.message
            assert stored.message.body == want.message.body
            assert stored.message_id == want.message_id
            assert stored.store_timestamp_ms == want.store_ms
            assert stored.delivery_attempt == 0 and stored.receipt is None

        # A bounded read from anywhere returns a non-empty prefix within its limits.
        start = data.draw(st.integers(min_value=0, max_value=len(expected)), label="start")
        max_messages = data.draw(st.integers(min_value=1, max_value=5), label="max_messages")
        max_bytes = data.draw(st.integers(min_value=1, max_value=120), label="max_bytes")
        part = await engine.read(queue, start, max_messages=max_messages, max_bytes=max_bytes)
        got = [m.message for m in part.messages]
        assert got == [e.message for e in expected[start : start + len(got)]]
        assert part.next_offset == start + len(got)
        assert len(got) <= max_messages
        if start < len(expected):
            assert got, "a read returns at least one message when one is there"
        if len(got) > 1:
            assert sum(len(m.body) for m in got) <= max_bytes

        # Stored entries from the one holding ``start`` on, raw batches as produced.
        batches = await engine.read_batches(queue, start, max_bytes=1 << 30)
        if start == len(expected):
            assert batches == []
            continue
        position = expected[start].base
        for batch in batches:
            want = expected[position]
            assert batch.base_offset == want.base == position
            assert batch.queue == queue
            assert batch.store_timestamp_ms == want.store_ms
            if isinstance(want.entry, BatchEntry):
                assert batch.count == want.entry.size
                assert batch.format == want.entry.format
                assert batch.raw == want.entry.raw
            else:
                assert batch.count == 1
                assert batch.raw is None and batch.format is None
                assert [m.message for m in batch.messages] == [want.entry]
                assert [m.offset for m in batch.messages] == [position]
            position += batch.count
        assert position == len(expected), "read_batches stopped early with no byte limit"

        # The first offset stored at or after a time.
        if expected:
            when = data.draw(st.sampled_from([e.store_ms for e in expected]), label="when")
            first = next(i for i, e in enumerate(expected) if e.store_ms >= when)
            assert await engine.offset_for_timestamp(queue, when) == first
            after = expected[-1].store_ms + 1
            assert await engine.offset_for_timestamp(queue, after) == len(expected)


def test_crash_image_with_an_unchecked_log_tail_opens() -> None:
    """The smallest crash recovery: records after the last checkpoint are replayed."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            await engine.create_topic(NS, "t")
            queue = QueueRef(NS, "t", 0)
            await engine.append([AppendRequest(entry=Message(body=b"x"), queues=(queue,))])
            engine = await host.reopen(CRASH)
            assert [t.name for t in await engine.list_topics(NS)] == ["t"]
            assert (await engine.queue_offsets(queue)).latest == 1
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


APPEND_CALLS = st.lists(
    st.builds(
        AppendRequest,
        entry=plain_messages(st.none() | st.just("g")) | BATCH_ENTRIES,
        queues=subsets(OFFSET_QUEUES),
    ),
    min_size=1,
    max_size=3,
)


@dataclass(frozen=True)
class AppendPhase:
    """Append calls made one after another (advancing the clock between them), or all
    at once from concurrent tasks, optionally racing a checkpoint; then a reopen."""

    calls: list[tuple[list[AppendRequest], int]]
    concurrent: bool
    checkpoint: bool


PHASES = st.lists(
    st.builds(
        AppendPhase,
        calls=st.lists(st.tuples(APPEND_CALLS, st.integers(0, 20)), max_size=5),
        concurrent=st.booleans(),
        checkpoint=st.booleans(),
    ),
    min_size=1,
    max_size=3,
)


async def run_phase(engine: Engine, clock: ManualClock, phase: AppendPhase) -> list[AppendResult]:
    if not phase.concurrent:
        results = []
        for requests, advance in phase.calls:
            clock.advance(advance)
            results.extend(await engine.append(requests))
            assert all(r.store_timestamp_ms == clock.now_ms() for r in results[-len(requests) :])
        return results
    # Tasks start in creation order: appends before the checkpoint reserve at once, the
    # ones after it find the checkpoint's gate closed and wait for it.
    coroutines = [engine.append(requests) for requests, _ in phase.calls]
    if phase.checkpoint:
        coroutines.insert(len(coroutines) // 2, checkpoint_as_append(engine))
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    return [result for results in await asyncio.gather(*tasks) for result in results]


async def checkpoint_as_append(engine: Engine) -> list[AppendResult]:
    await engine.checkpoint()
    return []


@recovery_modes
@PROPERTY_SETTINGS
@given(
    phases=PHASES,
    segment_bytes=st.sampled_from([4096, 128 << 20]),
    data=st.data(),
)
def test_offsets_are_dense_and_reads_match_placements(
    modes: tuple[str, ...],
    phases: list[AppendPhase],
    segment_bytes: int,
    data: st.DataObject,
) -> None:
    """Appends in phases, each ending with a reopen: after every phase and reopen the
    queues hold exactly what the placements said, dense from 0 in placement order."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock(), segment_bytes=segment_bytes)
        engine = await host.start()
        try:
            await engine.create_topic(NS, "t", TopicConfig(queue_count=3))
            await engine.create_topic(NS, "ü topic")
            model: dict[QueueRef, list[Expected]] = {q: [] for q in OFFSET_QUEUES}
            seen_ids: set[str] = set()
            for phase in phases:
                requests = [r for call, _ in phase.calls for r in call]
                results = await run_phase(engine, host.clock, phase)
                assert len(results) == len(requests)
                # Each queue's placements continue its offsets without gaps or overlaps
                # (concurrent calls may interleave, so follow placement order).
                landed: list[tuple[int, QueueRef, AppendRequest, AppendResult]] = []
                for request, result in zip(requests, results, strict=True):
                    assert result.message_id not in seen_ids
                    seen_ids.add(result.message_id)
                    assert [p.queue for p in result.placements] == list(request.queues)
                    landed.extend((p.offset, p.queue, request, result) for p in result.placements)
                landed.sort(key=lambda item: item[0])
                for offset, queue, request, result in landed:
                    assert offset == len(model[queue]), f"{queue}: offset {offset} out of order"
                    for _, entries in expected_entries(request, result, {queue: offset}, queue):
                        model[queue].extend(entries)
                await check_offset_model(engine, model, data)
                engine = await host.reopen(data.draw(st.sampled_from(modes), label="reopen"))
                await check_offset_model(engine, model, data)
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


# -- 3 and 4. pop, ack, redelivery, dead letters, FIFO -----------------------------------

POP_TOPIC = "t"
POP_QUEUE_IDS = (0, 1)
PLAIN, FIFO = "plain", "fifo"
GROUPS = (PLAIN, FIFO)
MESSAGE_GROUPS = st.sampled_from([None, "A", "B", "C"])
INVISIBLE_MS = st.sampled_from([0, 1, 100, 1000, 30_000])


@dataclass(frozen=True)
class Appended:
    queue_id: int
    offset: int
    message: Message
    message_id: str


@dataclass
class Delivery:
    """One group's view of one message."""

    attempts: int = 0
    deadline: int | None = None  # while handed out and not acked
    receipt: str | None = None  # the only receipt that is not stale
    first_pop_ms: int | None = None
    done: bool = False  # acked, or moved to the dead-letter queue

    def visible(self, now: int) -> bool:
        return not self.done and (self.deadline is None or self.deadline <= now)


Key = tuple[int, int]  # (queue id, offset)


class PopMachine(EngineMachine):
    """Two groups consume one two-queue topic: ``plain`` (unordered, dead letters after
    ``k`` deliveries) and ``fifo`` (ordered per message group)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: dict[Key, Appended] = {}
        self.lengths = dict.fromkeys(POP_QUEUE_IDS, 0)
        self.state: dict[str, dict[Key, Delivery]] = {g: {} for g in GROUPS}
        self.receipts: dict[str, list[str]] = {g: [] for g in GROUPS}
        self.limits: dict[str, int | None] = {}
        self.dlq_read: dict[str, int] = dict.fromkeys(GROUPS, 0)

    def ref(self, queue_id: int) -> QueueRef:
        return QueueRef(NS, POP_TOPIC, queue_id)

    @initialize(
        plain_limit=st.sampled_from([None, 1, 2, 3]),
        fifo_limit=st.sampled_from([None, 2]),
        messages=st.lists(plain_messages(MESSAGE_GROUPS), max_size=8),
    )
    def setup(
        self, plain_limit: int | None, fifo_limit: int | None, messages: list[Message]
    ) -> None:
        self.limits = {PLAIN: plain_limit, FIFO: fifo_limit}

        async def go() -> None:
            await self.engine.create_topic(NS, POP_TOPIC, TopicConfig(queue_count=2))
            await self.engine.set_group_config(
                NS, PLAIN, GroupConfig(max_delivery_attempts=plain_limit)
            )
            await self.engine.set_group_config(
                NS, FIFO, GroupConfig(max_delivery_attempts=fifo_limit, fifo=True)
            )

        self.run(go())
        if messages:
            self.append(POP_QUEUE_IDS, messages)

    # -- rules

    @rule(
        queue_ids=subsets(POP_QUEUE_IDS),
        messages=st.lists(plain_messages(MESSAGE_GROUPS), min_size=1, max_size=4),
    )
    def append(self, queue_ids: tuple[int, ...], messages: list[Message]) -> None:
        queues = tuple(self.ref(q) for q in queue_ids)
        requests = [AppendRequest(entry=m, queues=queues) for m in messages]
        results = self.run(self.engine.append(requests))
        for message, result in zip(messages, results, strict=True):
            assert result.placements == tuple(
                Placement(q, self.lengths[q.queue_id]) for q in queues
            )
            for placement in result.placements:
                key = (placement.queue.queue_id, placement.offset)
                self.messages[key] = Appended(*key, message, result.message_id)
                self.lengths[placement.queue.queue_id] += 1
                for group in GROUPS:
                    self.state[group][key] = Delivery()

    @rule(
        group=st.sampled_from(GROUPS),
        queue_ids=subsets(POP_QUEUE_IDS),
        max_messages=st.integers(min_value=1, max_value=5),
        invisible_ms=INVISIBLE_MS,
    )
    def pop(
        self, group: str, queue_ids: tuple[int, ...], max_messages: int, invisible_ms: int
    ) -> None:
        self._pop(group, queue_ids, max_messages, invisible_ms)

    @rule(group=st.sampled_from(GROUPS), invisible_ms=INVISIBLE_MS)
    def pop_everything(self, group: str, invisible_ms: int) -> None:
        """A pop that is never short of room: it must serve everything servable."""
        self._pop(group, POP_QUEUE_IDS, 16, invisible_ms)

    @rule(
        group=st.sampled_from(GROUPS),
        count=st.integers(min_value=2, max_value=3),
        max_messages=st.integers(min_value=1, max_value=3),
        invisible_ms=st.sampled_from([1, 1000, 30_000]),
    )
    def concurrent_pops(self, group: str, count: int, max_messages: int, invisible_ms: int) -> None:
        """Pops racing each other: together they obey every rule of one pop (with room
        for all of them); in particular no message goes to two of them."""
        self._pop(group, POP_QUEUE_IDS, max_messages, invisible_ms, concurrent=count)

    def _pop(
        self,
        group: str,
        queue_ids: tuple[int, ...],
        max_messages: int,
        invisible_ms: int,
        concurrent: int = 1,
    ) -> None:
        now = self.clock.now_ms()
        state = self.state[group]
        visible_before = {k for k, d in state.items() if d.visible(now) and k[0] in queue_ids}

        async def go() -> list[StoredMessage]:
            calls = [
                self.engine.pop(
                    NS,
                    group,
                    [self.ref(q) for q in queue_ids],
                    max_messages=max_messages,
                    invisible_ms=invisible_ms,
                )
                for _ in range(concurrent)
            ]
            return [m for popped in await asyncio.gather(*calls) for m in popped]

        popped = self.run(go())
        max_messages *= concurrent
        dead = self.read_dead_letters(group)
        keys = [(m.queue.queue_id, m.offset) for m in popped]

        assert len(popped) <= max_messages
        assert len(set(keys)) == len(keys), "a message handed out twice in one pop"
        for message, key in zip(popped, keys, strict=True):
            delivery = state[key]
            assert message.queue == self.ref(key[0]) and key[0] in queue_ids
            assert key in visible_before, (
                f"{key} handed out while acked or still invisible: {delivery}"
            )
            assert message.delivery_attempt == delivery.attempts + 1
            limit = self.limits[group]
            assert limit is None or message.delivery_attempt <= limit
            self.check_message(message, key)
            assert message.receipt is not None
            assert message.next_visible_ms == now + invisible_ms
            assert message.first_pop_ms == (
                now if delivery.first_pop_ms is None else delivery.first_pop_ms
            )
        assert not set(dead) & set(keys)
        for key in dead:
            assert key in visible_before and key[0] in queue_ids
            assert state[key].attempts == self.limits[group], "dead-lettered too early"

        handled = set(keys) | set(dead)
        if group == PLAIN:
            self.check_unordered_pop(state, queue_ids, keys, handled, visible_before)
            if len(popped) < max_messages:
                missed = visible_before - handled
                assert not missed, f"pop left visible messages behind: {sorted(missed)}"
        else:
            # A message dead-lettered by this pop no longer holds back its group: the
            # next message of the group may go out in the same pop.
            for key in dead:
                state[key] = Delivery(attempts=state[key].attempts, done=True)
            self.check_fifo_pop(state, keys, handled, visible_before, len(popped) < max_messages)

        for message, key in zip(popped, keys, strict=True):
            delivery = state[key]
            delivery.attempts += 1
            delivery.deadline = now + invisible_ms
            delivery.receipt = message.receipt
            delivery.first_pop_ms = message.first_pop_ms
            assert message.receipt is not None
            self.receipts[group].append(message.receipt)
        for key in dead:
            state[key] = Delivery(attempts=state[key].attempts, done=True)

    def check_unordered_pop(
        self,
        state: dict[Key, Delivery],
        queue_ids: tuple[int, ...],
        keys: list[Key],
        handled: set[Key],
        visible_before: set[Key],
    ) -> None:
        for queue_id in queue_ids:
            new = sorted(k for k in visible_before if k[0] == queue_id and not state[k].attempts)
            new_popped = [k for k in keys if k[0] == queue_id and not state[k].attempts]
            # New messages go out in offset order, from the first never handed out.
            assert new_popped == new[: len(new_popped)]
            if new_popped:  # redeliveries come first
                expired = {k for k in visible_before if k[0] == queue_id and state[k].attempts}
                assert expired <= handled, f"new handed out before redelivering {expired}"

    def check_fifo_pop(
        self,
        state: dict[Key, Delivery],
        keys: list[Key],
        handled: set[Key],
        visible_before: set[Key],
        short: bool,
    ) -> None:
        handed_groups: set[tuple[int, str]] = set()
        for key in keys:
            group = self.messages[key].message.message_group
            if group is None:
                continue
            assert (key[0], group) not in handed_groups, "two of one message group in a pop"
            handed_groups.add((key[0], group))
            for earlier in self.earlier_in_group(key):
                assert state[earlier].done, (
                    f"{key} of message group {group!r} handed out while {earlier} is unacked "
                    f"({state[earlier]})"
                )
        if short:  # every visible head of a message group, and every ungrouped one, served
            heads = {
                key
                for key in visible_before
                if self.messages[key].message.message_group is None
                or all(state[e].done for e in self.earlier_in_group(key))
            }
            assert heads <= handled, f"visible heads left behind: {sorted(heads - handled)}"

    def earlier_in_group(self, key: Key) -> Iterator[Key]:
        group = self.messages[key].message.message_group
        for offset in range(key[1]):
            if self.messages[(key[0], offset)].message.message_group == group:
                yield (key[0], offset)

    def check_message(self, stored: StoredMessage, key: Key) -> None:
        appended = self.messages[key]
        assert stored.offset == key[1]
        assert stored.message == appended.message
        assert stored.message_id == appended.message_id

    def read_dead_letters(self, group: str) -> list[Key]:
        """Messages newly in the group's dead-letter queue, as (queue id, offset)."""
        queue = QueueRef(NS, f"%DLQ%{group}", 0)

        async def go() -> list[StoredMessage]:
            try:
                result = await self.engine.read(queue, self.dlq_read[group], max_messages=1000)
            except TopicNotFound:
                return []
            return list(result.messages)

        keys = []
        for stored in self.run(go()):
            self.dlq_read[group] += 1
            props = stored.message
            key = (
                int(props.property("DLQ_ORIGIN_QUEUE_ID") or b"-1"),
                int(props.property("DLQ_ORIGIN_OFFSET") or b"-1"),
            )
            assert props.property("DLQ_ORIGIN_TOPIC") == POP_TOPIC.encode()
            assert props.property("DLQ_GROUP") == group.encode()
            assert props.property("DLQ_DELIVERY_ATTEMPTS") == str(self.limits[group]).encode()
            original = self.messages[key]
            assert stored.message_id == original.message_id
            assert stored.message.body == original.message.body
            assert stored.message.properties[: len(original.message.properties)] == (
                original.message.properties
            )
            keys.append(key)
        if self.limits[group] is None:
            assert not keys, "dead letters with max_delivery_attempts=None"
        return keys

    def pick_receipt(self, group: str, data: st.DataObject) -> str:
        """A live receipt or any receipt ever issued (most are stale by now)."""
        live = [d.receipt for d in self.state[group].values() if d.receipt and not d.done]
        prefer_live = data.draw(st.booleans(), label="prefer live")
        if live and prefer_live:
            return data.draw(st.sampled_from(live), label="receipt")
        return data.draw(st.sampled_from(self.receipts[group]), label="receipt")

    def owner(self, group: str, receipt: str) -> tuple[Key, Delivery] | None:
        """The message a receipt is live for, or None if it is stale."""
        for key, delivery in self.state[group].items():
            if delivery.receipt == receipt and not delivery.done:
                return key, delivery
        return None

    @precondition(lambda self: any(self.receipts.values()))
    @rule(group=st.sampled_from(GROUPS), data=st.data())
    def ack(self, group: str, data: st.DataObject) -> None:
        if not self.receipts[group]:
            group = FIFO if group == PLAIN else PLAIN
        receipt = self.pick_receipt(group, data)
        live = self.owner(group, receipt)
        other = FIFO if group == PLAIN else PLAIN
        with pytest.raises(InvalidReceipt):  # receipts belong to one group
            self.run(self.engine.ack(NS, other, receipt))
        if live is None:
            with pytest.raises(InvalidReceipt):
                self.run(self.engine.ack(NS, group, receipt))
            return
        self.run(self.engine.ack(NS, group, receipt))
        _, delivery = live
        delivery.done = True
        delivery.deadline = delivery.receipt = None
        with pytest.raises(InvalidReceipt):  # now stale
            self.run(self.engine.ack(NS, group, receipt))

    @precondition(lambda self: any(self.receipts.values()))
    @rule(group=st.sampled_from(GROUPS), invisible_ms=INVISIBLE_MS, data=st.data())
    def change_invisibility(self, group: str, invisible_ms: int, data: st.DataObject) -> None:
        if not self.receipts[group]:
            group = FIFO if group == PLAIN else PLAIN
        receipt = self.pick_receipt(group, data)
        live = self.owner(group, receipt)
        call = self.engine.change_invisibility(NS, group, receipt, invisible_ms)
        if live is None:
            with pytest.raises(InvalidReceipt):
                self.run(call)
            return
        key, delivery = live
        now = self.clock.now_ms()
        stored = self.run(call)
        self.check_message(stored, key)
        assert stored.delivery_attempt == delivery.attempts, "a nack is not a delivery"
        assert stored.next_visible_ms == now + invisible_ms
        assert stored.receipt is not None and stored.receipt != receipt
        delivery.deadline = now + invisible_ms
        delivery.receipt = stored.receipt
        self.receipts[group].append(stored.receipt)
        with pytest.raises(InvalidReceipt):  # the old receipt is stale now
            self.run(self.engine.ack(NS, group, receipt))

    @rule(receipt=st.text(max_size=40) | st.binary(max_size=30).map(lambda b: b.hex()))
    def ack_garbage(self, receipt: str) -> None:
        for group in GROUPS:
            if self.owner(group, receipt) is None:
                with pytest.raises(InvalidReceipt):
                    self.run(self.engine.ack(NS, group, receipt))

    @rule(ms=st.sampled_from([1, 99, 100, 1000, 30_000]))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    # -- invariants

    @invariant()
    def counts_match_model(self) -> None:
        async def go() -> None:
            for group in GROUPS:
                for queue_id in POP_QUEUE_IDS:
                    ref = self.ref(queue_id)
                    mine = [d for k, d in self.state[group].items() if k[0] == queue_id]
                    pending = sum(not d.done for d in mine)
                    inflight = sum(not d.done and d.receipt is not None for d in mine)
                    assert await self.engine.pending_count(NS, group, ref) == pending
                    assert await self.engine.inflight_count(NS, group, ref) == inflight
                    offsets = await self.engine.queue_offsets(ref)
                    assert offsets.latest == self.lengths[queue_id]

        if self.limits:
            self.run(go())


@recovery_modes
def test_pop_ack_redelivery_state_machine(modes: tuple[str, ...]) -> None:
    run_machine(PopMachine, modes)


def test_fifo_ungrouped_messages_are_not_ordered() -> None:
    """In a FIFO group, messages without a message group carry no order: one pop hands
    out several at once. So an in-flight ungrouped message must not hold back a later
    ungrouped one either (only messages of the same message group wait)."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            queue = QueueRef(NS, "f", 0)
            await engine.create_topic(NS, "f")
            await engine.set_group_config(NS, "g", GroupConfig(fifo=True))
            await engine.append([AppendRequest(entry=Message(body=b"u0"), queues=(queue,))])
            await engine.append([AppendRequest(entry=Message(body=b"u1"), queues=(queue,))])
            first = await engine.pop(NS, "g", [queue], max_messages=10)
            assert [m.message.body for m in first] == [b"u0", b"u1"]  # not ordered
            await engine.append([AppendRequest(entry=Message(body=b"u2"), queues=(queue,))])
            second = await engine.pop(NS, "g", [queue], max_messages=10)
            assert [m.message.body for m in second] == [b"u2"]
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


def test_fifo_acked_message_is_not_handed_out_again_after_a_dead_letter() -> None:
    """An acked message stays acked when an earlier one is consumed in the same pop
    (here dead-lettered; a tag filter or an expiry consumes the same way)."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            queue = QueueRef(NS, "f", 0)
            await engine.create_topic(NS, "f")
            config = GroupConfig(fifo=True, max_delivery_attempts=1)
            await engine.set_group_config(NS, "g", config)
            await engine.append(
                [
                    AppendRequest(entry=Message(body=b"m0", message_group="A"), queues=(queue,)),
                    AppendRequest(entry=Message(body=b"m1", message_group="B"), queues=(queue,)),
                ]
            )
            first = await engine.pop(NS, "g", [queue], max_messages=2, invisible_ms=1000)
            assert [m.message.body for m in first] == [b"m0", b"m1"]
            receipt = first[1].receipt
            assert receipt is not None
            await engine.ack(NS, "g", receipt)
            host.clock.advance(1000)  # m0 is visible again: its next delivery dead-letters it
            second = await engine.pop(NS, "g", [queue], max_messages=2, invisible_ms=1000)
            assert [m.message.body for m in second] == [], "an acked message came back"
            assert await engine.pending_count(NS, "g", queue) == 0
            dead = await engine.read(QueueRef(NS, "%DLQ%g", 0), 0)
            assert [m.message.body for m in dead.messages] == [b"m0"]
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


FILTER_TAGS = st.none() | st.frozensets(st.sampled_from(["a", "b", "*"]), min_size=1)


@PROPERTY_SETTINGS
@given(
    fifo=st.booleans(),
    specs=st.lists(
        st.tuples(
            st.sampled_from([None, "a", "b", "c"]),  # tag
            st.sampled_from([None, "A", "B"]),  # message group
            st.none() | st.integers(min_value=1, max_value=3000),  # expires this much later
        ),
        min_size=1,
        max_size=16,
    ),
    tags=FILTER_TAGS,
    pops=st.lists(
        st.tuples(st.integers(min_value=1, max_value=4), st.integers(0, 1000)), max_size=8
    ),
)
def test_tag_filters_and_expiry_consume_silently(
    fifo: bool,
    specs: list[tuple[str | None, str | None, int | None]],
    tags: frozenset[str] | None,
    pops: list[tuple[int, int]],
) -> None:
    """A pop hands out only messages whose tag passes the filter and that have not
    expired; the rest are consumed for the group without being handed out. Each message
    goes out at most once (all are acked at once), in offset order (per message group
    when FIFO), and once drained nothing is pending. Offset reads still see everything."""

    def passes(message: Message) -> bool:
        return tags is None or "*" in tags or message.tag in tags

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            queue = QueueRef(NS, "tags", 0)
            await engine.create_topic(NS, "tags")
            await engine.set_group_config(NS, "g", GroupConfig(fifo=fifo))
            start = host.clock.now_ms()
            messages = [
                Message(
                    body=b"%d" % i,
                    tag=tag,
                    message_group=group,
                    expiry_ms=None if expires is None else start + expires,
                )
                for i, (tag, group, expires) in enumerate(specs)
            ]
            await engine.append([AppendRequest(entry=m, queues=(queue,)) for m in messages])
            handed: list[int] = []

            async def pop(max_messages: int) -> int:
                now = host.clock.now_ms()
                popped = await engine.pop(
                    NS, "g", [queue], max_messages=max_messages, invisible_ms=86_400_000, tags=tags
                )
                assert len(popped) <= max_messages
                for stored in popped:
                    message = messages[stored.offset]
                    assert stored.message == message
                    assert passes(message), f"tag {message.tag!r} passed filter {tags}"
                    assert message.expiry_ms is None or message.expiry_ms > now, "expired"
                    assert stored.offset not in handed, "handed out twice"
                    assert stored.delivery_attempt == 1
                    assert stored.receipt is not None
                    await engine.ack(NS, "g", stored.receipt)
                    handed.append(stored.offset)
                return len(popped)

            for max_messages, advance in pops:
                host.clock.advance(advance)
                await pop(max_messages)
            while await pop(100):
                pass
            end = host.clock.now_ms()

            assert set(handed) >= {
                i
                for i, m in enumerate(messages)
                if passes(m) and (m.expiry_ms is None or m.expiry_ms > end)
            }, "a message that passes the filter and has not expired was never handed out"
            if fifo:
                for group in {m.message_group for m in messages}:
                    mine = [i for i in handed if messages[i].message_group == group]
                    assert group is None or mine == sorted(mine), f"group {group} out of order"
            else:
                assert handed == sorted(handed)
            assert await engine.pending_count(NS, "g", queue) == 0
            assert await engine.inflight_count(NS, "g", queue) == 0
            read = await engine.read(queue, 0, max_messages=100, max_bytes=1 << 30)
            assert [m.message for m in read.messages] == messages
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


# -- 5. delayed messages -----------------------------------------------------------------

DELAY_TOPIC = "d"
DELAY_QUEUES = (QueueRef(NS, DELAY_TOPIC, 0), QueueRef(NS, DELAY_TOPIC, 1))


@dataclass
class Delayed:
    message: Message
    due: int
    queues: tuple[QueueRef, ...]


class DelayMachine(EngineMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, Delayed] = {}
        self.finished: list[str] = []  # delivered or cancelled: cancel_delayed is False
        self.visible: dict[QueueRef, list[tuple[str, Message]]] = {q: [] for q in DELAY_QUEUES}
        self.moved = False  # time moved since the last check
        self.popped: set[tuple[QueueRef, str]] = set()
        self.starts = self.host.starts
        self.run(self.engine.create_topic(NS, DELAY_TOPIC, TopicConfig(queue_count=2)))

    @rule(
        delay=st.sampled_from([-500, 0, 1, 100, 250, 1000, 3000]),
        queues=subsets(DELAY_QUEUES),
        message=plain_messages(),
    )
    def append(self, delay: int, queues: tuple[QueueRef, ...], message: Message) -> None:
        now = self.clock.now_ms()
        message = Message(
            body=message.body,
            key=message.key,
            properties=message.properties,
            delivery_time_ms=now + delay,
        )
        (result,) = self.run(self.engine.append([AppendRequest(entry=message, queues=queues)]))
        if delay > 0:
            assert result.placements == (), "a delayed message has no offsets yet"
            self.pending[result.message_id] = Delayed(message, now + delay, queues)
        else:
            assert [p.queue for p in result.placements] == list(queues)
            for placement in result.placements:
                assert placement.offset == len(self.visible[placement.queue])
                self.visible[placement.queue].append((result.message_id, message))
            self.finished.append(result.message_id)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        choices = [*self.pending, *self.finished, "01000000000000000000000000DEADBEEF"]
        message_id = data.draw(st.sampled_from(choices), label="message_id")
        cancelled = self.run(self.engine.cancel_delayed(NS, message_id))
        assert cancelled == (message_id in self.pending)
        if cancelled:
            del self.pending[message_id]
            self.finished.append(message_id)
        assert not self.run(self.engine.cancel_delayed(NS, message_id))

    @rule(ms=st.sampled_from([1, 50, 99, 100, 150, 500, 1000, 2999]))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)
        self.moved = True
        now = self.clock.now_ms()
        for message_id, delayed in sorted(self.pending.items(), key=lambda kv: kv[1].due):
            if delayed.due <= now:
                del self.pending[message_id]
                self.finished.append(message_id)
                for queue in delayed.queues:
                    self.visible[queue].append((message_id, delayed.message))

    @invariant()
    def exactly_the_due_messages_are_visible(self) -> None:
        async def delivered() -> bool:
            for queue, expected in self.visible.items():
                if (await self.engine.queue_offsets(queue)).latest < len(expected):
                    return False
            return True

        async def go() -> None:
            await settle(delivered)
            if self.moved or self.starts != self.host.starts:
                await quiesce()  # give a wrong (early, repeated) delivery the chance to show
                self.moved, self.starts = False, self.host.starts
            for queue, expected in self.visible.items():
                result = await self.engine.read(queue, 0, max_messages=1000, max_bytes=1 << 30)
                got = [(m.message_id, m.message) for m in result.messages]
                ids = [message_id for message_id, _ in got]
                assert len(ids) == len(set(ids)), f"a delayed message appeared twice: {ids}"
                assert sorted(got, key=repr) == sorted(expected, key=repr), (
                    f"{queue} at {self.clock.now_ms()}: pending {self.pending}"
                )
                for stored in result.messages:
                    assert stored.store_timestamp_ms <= self.clock.now_ms()
            # Poppable exactly when readable, and once: a consumer group holds every
            # message it was given (invisible far longer than any example runs).
            popped = await self.engine.pop(
                NS, "consumer", DELAY_QUEUES, max_messages=1000, invisible_ms=10 * 3600_000
            )
            fresh = [(m.queue, m.message_id) for m in popped]
            expected_fresh = {
                (queue, message_id)
                for queue, messages in self.visible.items()
                for message_id, _ in messages
            } - self.popped
            assert sorted(fresh, key=repr) == sorted(expected_fresh, key=repr)
            self.popped.update(fresh)

        self.run(go())


@recovery_modes
def test_delayed_delivery_state_machine(modes: tuple[str, ...]) -> None:
    run_machine(DelayMachine, modes)


@settings(PROPERTY_SETTINGS, max_examples=15)
@given(delay=st.integers(min_value=2, max_value=60_000), body=BODIES)
def test_long_poll_pop_wakes_when_a_delayed_message_is_due(delay: int, body: bytes) -> None:
    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            queue = QueueRef(NS, "lp", 0)
            await engine.create_topic(NS, "lp")
            due = host.clock.now_ms() + delay
            message = Message(body=body, delivery_time_ms=due)
            await engine.append([AppendRequest(entry=message, queues=(queue,))])
            popping = asyncio.ensure_future(
                engine.pop(NS, "g", [queue], wait_ms=delay + 60_000, invisible_ms=1000)
            )
            reading = asyncio.ensure_future(engine.read(queue, 0, wait_ms=delay + 60_000))
            await quiesce()
            host.clock.advance(delay - 1)
            await quiesce()
            assert not popping.done() and not reading.done(), "delivered before it was due"
            host.clock.advance(1)
            popped = await asyncio.wait_for(popping, SETTLE_TIMEOUT_S)
            read = await asyncio.wait_for(reading, SETTLE_TIMEOUT_S)
            assert [m.message for m in popped] == [message]
            assert [m.message for m in read.messages] == [message]
            assert (await engine.queue_offsets(queue)).latest == 1
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


# -- 6. multi-dispatch stores one body ---------------------------------------------------


@settings(PROPERTY_SETTINGS, max_examples=8)
@given(
    queue_count=st.integers(min_value=2, max_value=10),
    size=st.sampled_from([20 << 10, 100 << 10]),
    shape=st.sampled_from(["message", "batch", "raw batch"]),
    seed=st.binary(min_size=16, max_size=16),
)
def test_multi_dispatch_writes_the_body_once(
    queue_count: int, size: int, shape: str, seed: bytes
) -> None:
    """One append into N queues writes the entry once (plus a few bytes per queue)."""
    body = (seed * (size // len(seed) + 1))[:size]
    entry: Message | BatchEntry
    if shape == "batch":
        half = Message(body=body[: size // 2])
        entry = BatchEntry(format="kafka.v2", raw=body, messages=(half, half))
        stored_bytes = size * 2  # raw plus the messages' bodies
    elif shape == "raw batch":
        entry = raw_only_batch([body[: size // 2], body[size // 2 :]])
        body = entry.raw
        stored_bytes = len(body)  # raw alone: readers expand it
    else:
        entry = Message(body=body)
        stored_bytes = size

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            await engine.create_topic(NS, "fan", TopicConfig(queue_count=queue_count))
            queues = tuple(QueueRef(NS, "fan", q) for q in range(queue_count))
            before = data_size(host.path)
            (result,) = await engine.append([AppendRequest(entry=entry, queues=queues)])
            grown = data_size(host.path) - before
            assert result.placements == tuple(Placement(q, 0) for q in queues)
            assert stored_bytes <= grown < stored_bytes + 4096, (
                f"{queue_count} dispatches of {stored_bytes} bytes grew the data by {grown}"
            )
            for _ in range(2):
                for queue in queues:
                    read = await engine.read(queue, 0, max_messages=10, max_bytes=1 << 30)
                    if isinstance(entry, Message):
                        assert [m.message.body for m in read.messages] == [body]
                    else:
                        assert [m.message for m in read.messages] == list(batch_messages(entry))
                        (stored,) = await engine.read_batches(queue, 0, max_bytes=1 << 30)
                        assert stored.raw == body and stored.count == 2
                engine = await host.reopen(CLOSE)
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


# -- 7. transactions ---------------------------------------------------------------------

OTHER_NS = "other"
TX_QUEUES = (QueueRef(NS, "tx", 0), QueueRef(NS, "tx", 1), QueueRef(OTHER_NS, "tx", 0))


class TransactionMachine(EngineMachine):
    def __init__(self) -> None:
        super().__init__()
        self.undecided: dict[str, HalfMessage] = {}
        self.decided: dict[str, str] = {}  # transaction id -> namespace
        self.visible: dict[QueueRef, list[tuple[str, Message]]] = {q: [] for q in TX_QUEUES}

        async def go() -> None:
            await self.engine.create_namespace(OTHER_NS)
            await self.engine.create_topic(NS, "tx", TopicConfig(queue_count=2))
            await self.engine.create_topic(OTHER_NS, "tx")

        self.run(go())

    @rule(
        queues=st.sampled_from([TX_QUEUES[2:]]) | subsets(TX_QUEUES[:2]),
        message=plain_messages(st.none() | st.just("g")),
        producer_group=st.none() | st.sampled_from(["pg", "ü"]),
    )
    def half(
        self, queues: tuple[QueueRef, ...], message: Message, producer_group: str | None
    ) -> None:
        half = self.run(
            self.engine.append_half(
                AppendRequest(entry=message, queues=queues), producer_group=producer_group
            )
        )
        assert half.message == message
        assert half.queues == queues
        assert half.producer_group == producer_group
        assert half.store_timestamp_ms == self.clock.now_ms()
        assert half.transaction_id not in self.undecided and half.transaction_id not in self.decided
        self.undecided[half.transaction_id] = half

    @precondition(lambda self: bool(self.undecided))
    @rule(commit=st.booleans(), data=st.data())
    def end(self, commit: bool, data: st.DataObject) -> None:
        transaction_id = data.draw(st.sampled_from(sorted(self.undecided)), label="transaction")
        half = self.undecided[transaction_id]
        namespace = half.queues[0].namespace
        wrong = OTHER_NS if namespace == NS else NS
        with pytest.raises(TransactionNotFound):  # transactions belong to a namespace
            self.run(self.engine.end_transaction(wrong, transaction_id, commit=commit))
        result = self.run(self.engine.end_transaction(namespace, transaction_id, commit=commit))
        del self.undecided[transaction_id]
        self.decided[transaction_id] = namespace
        if not commit:
            assert result is None
            return
        assert result is not None
        assert result.message_id == half.message_id
        assert result.store_timestamp_ms == self.clock.now_ms()
        assert result.placements == tuple(Placement(q, len(self.visible[q])) for q in half.queues)
        for queue in half.queues:
            self.visible[queue].append((half.message_id, half.message))

    @rule(data=st.data(), commit=st.booleans())
    def end_unknown(self, data: st.DataObject, commit: bool) -> None:
        """Deciding twice, or a transaction that never was, is refused."""
        choices = [*sorted(self.decided.items()), (f"{'0' * 30}CAFE", NS)]
        transaction_id, namespace = data.draw(st.sampled_from(choices), label="transaction")
        with pytest.raises(TransactionNotFound):
            self.run(self.engine.end_transaction(namespace, transaction_id, commit=commit))

    @rule(ms=st.sampled_from([1, 500, 1000, 60_000]))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @invariant()
    def undecided_are_listed_and_invisible(self) -> None:
        now = self.clock.now_ms()

        async def go() -> None:
            listed = await self.engine.list_undecided()
            assert {h.transaction_id: h for h in listed} == self.undecided
            assert len(listed) == len(self.undecided)
            for namespace in (NS, OTHER_NS):
                mine = await self.engine.list_undecided(namespace)
                assert {h.transaction_id for h in mine} == {
                    t for t, h in self.undecided.items() if h.queues[0].namespace == namespace
                }
            for older_than in (1, 1000):
                old = await self.engine.list_undecided(older_than_ms=older_than)
                assert {h.transaction_id for h in old} == {
                    t for t, h in self.undecided.items() if h.store_timestamp_ms <= now - older_than
                }
            for queue, expected in self.visible.items():
                result = await self.engine.read(queue, 0, max_messages=1000, max_bytes=1 << 30)
                assert [(m.message_id, m.message) for m in result.messages] == expected

        self.run(go())


@recovery_modes
def test_transaction_state_machine(modes: tuple[str, ...]) -> None:
    run_machine(TransactionMachine, modes)


def test_committed_delayed_half_is_no_longer_undecided() -> None:
    """A half message with a future delivery time, once committed, becomes an ordinary
    delayed message: it must leave list_undecided, and it is delivered once when due."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            queue = QueueRef(NS, "txd", 0)
            await engine.create_topic(NS, "txd")
            message = Message(body=b"later", delivery_time_ms=host.clock.now_ms() + 1000)
            half = await engine.append_half(AppendRequest(entry=message, queues=(queue,)))
            result = await engine.end_transaction(NS, half.transaction_id, commit=True)
            assert result is not None and result.placements == ()
            assert await engine.list_undecided() == [], "a committed transaction is listed"
            host.clock.advance(1000)

            async def delivered() -> bool:
                return (await engine.queue_offsets(queue)).latest >= 1

            assert await settle(delivered)
            await quiesce()
            assert (await engine.queue_offsets(queue)).latest == 1
            assert await engine.list_undecided() == [], "a delivered transaction is listed"
            engine = await host.reopen(CLOSE)
            assert await engine.list_undecided() == []
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


# -- 8. keyed latest values and metadata -------------------------------------------------

KV_NAMESPACES = (NS, "ns2")
LATEST_TOPICS = ("r/1", "ü topic/#")
LATEST_KEYS = (b"", b"k", b"\x00\xff")
META_KINDS = ("exchange", "binding")
META_NAMES = ("a", "b", "ü x")
OFFSET_GROUPS = ("g1", "ü g")


class KeyedMachine(EngineMachine):
    """Keyed latest values, metadata and committed offsets: last write wins per key,
    deletes clear, every reopen keeps it all."""

    def __init__(self) -> None:
        super().__init__()
        self.latest: dict[tuple[str, str], dict[bytes, Message]] = {}
        self.meta: dict[tuple[str, str], dict[str, Any]] = {}
        self.offsets: dict[tuple[str, str], dict[QueueRef, CommittedOffset]] = {}

        async def go() -> None:
            await self.engine.create_namespace("ns2")
            for namespace in KV_NAMESPACES:
                await self.engine.create_topic(namespace, "c", TopicConfig(queue_count=2))

        self.run(go())

    @rule(
        namespace=st.sampled_from(KV_NAMESPACES),
        group=st.sampled_from(OFFSET_GROUPS),
        queue_id=st.sampled_from([0, 1]),
        offset=st.integers(min_value=0, max_value=2**40),
        metadata=st.text(max_size=8),
    )
    def commit_offset(
        self, namespace: str, group: str, queue_id: int, offset: int, metadata: str
    ) -> None:
        queue = QueueRef(namespace, "c", queue_id)
        self.run(self.engine.commit_offset(namespace, group, queue, offset, metadata))
        committed = CommittedOffset(offset=offset, metadata=metadata, commit_ms=self.clock.now_ms())
        self.offsets.setdefault((namespace, group), {})[queue] = committed

    @rule(
        namespace=st.sampled_from(KV_NAMESPACES),
        group=st.sampled_from(OFFSET_GROUPS),
        queue_ids=st.none() | subsets([0, 1]),
    )
    def delete_group_offsets(
        self, namespace: str, group: str, queue_ids: tuple[int, ...] | None
    ) -> None:
        queues = None if queue_ids is None else [QueueRef(namespace, "c", q) for q in queue_ids]
        self.run(self.engine.delete_group_offsets(namespace, group, queues))
        committed = self.offsets.get((namespace, group), {})
        for queue in list(committed) if queues is None else queues:
            committed.pop(queue, None)

    @rule(ms=st.sampled_from([1, 1000]))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(
        namespace=st.sampled_from(KV_NAMESPACES),
        topic=st.sampled_from(LATEST_TOPICS),
        key=st.sampled_from(LATEST_KEYS),
        message=st.none() | plain_messages(),
    )
    def put_latest(self, namespace: str, topic: str, key: bytes, message: Message | None) -> None:
        self.run(self.engine.put_latest(namespace, topic, key, message))
        values = self.latest.setdefault((namespace, topic), {})
        if message is None:
            values.pop(key, None)
        else:
            values[key] = message

    @rule(
        namespace=st.sampled_from(KV_NAMESPACES),
        kind=st.sampled_from(META_KINDS),
        name=st.sampled_from(META_NAMES),
        value=JSON_VALUES,
    )
    def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        self.run(self.engine.meta_put(namespace, kind, name, value))
        self.meta.setdefault((namespace, kind), {})[name] = value

    @rule(
        namespace=st.sampled_from(KV_NAMESPACES),
        kind=st.sampled_from(META_KINDS),
        name=st.sampled_from(META_NAMES),
    )
    def meta_delete(self, namespace: str, kind: str, name: str) -> None:
        existed = name in self.meta.get((namespace, kind), {})
        assert self.run(self.engine.meta_delete(namespace, kind, name)) == existed
        self.meta.get((namespace, kind), {}).pop(name, None)

    @invariant()
    def last_write_wins(self) -> None:
        async def go() -> None:
            for namespace, topic in itertools.product(KV_NAMESPACES, LATEST_TOPICS):
                values = self.latest.get((namespace, topic), {})
                listed = await self.engine.list_latest(namespace, topic)
                assert listed == sorted(values.items())
                for key in LATEST_KEYS:
                    assert await self.engine.get_latest(namespace, topic, key) == values.get(key)
            for namespace, kind in itertools.product(KV_NAMESPACES, META_KINDS):
                stored = self.meta.get((namespace, kind), {})
                assert await self.engine.meta_list(namespace, kind) == stored
                for name in META_NAMES:
                    assert await self.engine.meta_get(namespace, kind, name) == stored.get(name)
            for namespace in KV_NAMESPACES:
                for group in OFFSET_GROUPS:
                    committed = self.offsets.get((namespace, group), {})
                    assert await self.engine.list_group_offsets(namespace, group) == committed
                    for queue_id in (0, 1):
                        queue = QueueRef(namespace, "c", queue_id)
                        fetched = await self.engine.fetch_offset(namespace, group, queue)
                        assert fetched == committed.get(queue)
                # "Groups with committed offsets, pop state or a config": here, offsets.
                assert await self.engine.list_groups(namespace) == sorted(
                    group for (ns, group), c in self.offsets.items() if ns == namespace and c
                )

        self.run(go())


@recovery_modes
def test_keyed_latest_and_metadata_state_machine(modes: tuple[str, ...]) -> None:
    run_machine(KeyedMachine, modes)


def test_list_groups_forgets_a_group_whose_offsets_are_all_deleted() -> None:
    """A group with no committed offsets, pop state or config is not listed, and the
    answer does not change across a restart."""

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            await engine.create_topic(NS, "c")
            await engine.commit_offset(NS, "g1", QueueRef(NS, "c", 0), 5)
            await engine.delete_group_offsets(NS, "g1")
            assert await engine.list_group_offsets(NS, "g1") == {}
            before = await engine.list_groups(NS)
            engine = await host.reopen(CLOSE)
            after = await engine.list_groups(NS)
            assert before == after == [], f"listed {before} before a restart, {after} after"
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))


@recovery_modes
def test_deepest_metadata_value_accepted_survives_reopen(modes: tuple[str, ...]) -> None:
    """If meta_put accepts a value, the engine must be able to open its data again. The
    value is stored nested a few levels deeper (in the log record and the checkpoint)
    than the caller passed it, so take the deepest value meta_put accepts and reopen.
    (Too deep a value must be refused with InvalidArgument, not a RecursionError.)"""

    def nested(depth: int) -> list[Any]:
        value: list[Any] = []
        for _ in range(depth):
            value = [value]
        return value

    async def main(root: Path) -> None:
        host = EngineHost(root, ManualClock())
        engine = await host.start()
        try:
            accepted = 0
            for depth in itertools.count(1):
                try:
                    await engine.meta_put(NS, "deep", "value", nested(depth))
                except InvalidArgument:  # a refusal is fine; a RecursionError is not
                    break
                accepted = depth
            assert accepted >= 8, f"meta_put refused a value nested {accepted + 1} deep"
            for how in modes:
                engine = await host.reopen(how)
                assert await engine.meta_get(NS, "deep", "value") == nested(accepted)
        finally:
            await host.close()

    with temp_root() as root:
        asyncio.run(main(root))
