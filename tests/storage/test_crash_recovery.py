"""Crash recovery for real: a child process (``crash_worker.py``) works on a store and
is SIGKILLed mid-stream; the store is then reopened here and must hold exactly what
the child was told is durable, nothing torn, and keep working.

The child reports every acknowledged operation on stdout, flushed before it goes on,
so the pipe holds the full list of acknowledgements when the kill lands. The parent
never sleeps to let things happen: it waits for lines (with a timeout).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import struct
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import crc32c
import pytest

from polymq.storage.clock import ManualClock
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.model import (
    AppendRequest,
    BatchEntry,
    Message,
    QueueRef,
    StoredMessage,
    TopicConfig,
)
from tests.storage import crash_worker as worker

WORKER = Path(worker.__file__).resolve()
NS = worker.NS
LINE_TIMEOUT_S = 30.0  # generous: a slow CI box must not fail a correct engine
ROUND_SEQS = 1_000_000  # sequence numbers per round; the parent's own start half-way

_FRAME = struct.Struct("<II")


# -- the child process ---------------------------------------------------------------


class Child:
    """A running ``crash_worker.py`` and the lines it has reported so far."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.lines: list[list[str]] = []
        self.counts: dict[str, int] = defaultdict(int)

    def _stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _take(self, raw: bytes) -> list[str]:
        tokens = raw.decode().split()
        if tokens:
            self.lines.append(tokens)
            self.counts[tokens[0]] += 1
        return tokens

    async def read_until(
        self, done: Callable[[list[str]], bool], what: str, timeout_s: float = LINE_TIMEOUT_S
    ) -> None:
        """Read lines until ``done(line)`` is true for one of them."""
        assert self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                pytest.fail(f"child: no {what} within {timeout_s} s; stderr:\n{self._stderr()}")
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not raw.endswith(b"\n"):
                await self.proc.wait()
                pytest.fail(
                    f"child exited ({self.proc.returncode}) before {what}; "
                    f"stderr:\n{self._stderr()}"
                )
            if done(self._take(raw)):
                return

    async def read_count(self, kind: str, count: int) -> None:
        if self.counts[kind] < count:
            await self.read_until(lambda _: self.counts[kind] >= count, f"{count} {kind!r} lines")

    async def kill(self) -> list[list[str]]:
        """SIGKILL the child, then read what it reported before dying; all lines."""
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGKILL)
        rest = await asyncio.wait_for(self.proc.stdout.read(), LINE_TIMEOUT_S)
        await asyncio.wait_for(self.proc.wait(), LINE_TIMEOUT_S)
        assert self.proc.returncode == -signal.SIGKILL, (
            f"the child was not killed mid-stream (exit {self.proc.returncode}); "
            f"stderr:\n{self._stderr()}"
        )
        for raw in rest.splitlines(keepends=True):
            if raw.endswith(b"\n"):  # a line cut by the kill was never reported
                self._take(raw)
        return self.lines


@asynccontextmanager
async def spawn(mode: str, data_dir: Path, *options: str) -> AsyncIterator[Child]:
    stderr_path = data_dir.parent / f"child-{mode}-{time.monotonic_ns()}.stderr"
    with open(stderr_path, "wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            mode,
            str(data_dir),
            *options,
            "--max-seconds",
            "90",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    child = Child(proc, stderr_path)
    try:
        yield child
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@dataclass(frozen=True, slots=True)
class Setup:
    """Engine settings shared by the child (as options) and the parent."""

    durability: Durability = Durability.SYNC
    segment_bytes: int = 128 << 20
    checkpoint_interval_ms: int = 30_000
    checkpoint_log_bytes: int = 256 << 20
    flush_interval_ms: int = 1000
    checkpoint_every_ms: int = 0  # the child's own checkpoint() loop; 0: none

    def config(self, data_dir: Path) -> EngineConfig:
        return EngineConfig(
            data_dir=data_dir,
            durability=self.durability,
            segment_bytes=self.segment_bytes,
            checkpoint_interval_ms=self.checkpoint_interval_ms,
            checkpoint_log_bytes=self.checkpoint_log_bytes,
            flush_interval_ms=self.flush_interval_ms,
        )

    def options(self) -> list[str]:
        return [
            f"--durability={self.durability.value}",
            f"--segment-bytes={self.segment_bytes}",
            f"--checkpoint-interval-ms={self.checkpoint_interval_ms}",
            f"--checkpoint-log-bytes={self.checkpoint_log_bytes}",
            f"--flush-interval-ms={self.flush_interval_ms}",
            f"--checkpoint-every-ms={self.checkpoint_every_ms}",
        ]

    @property
    def checkpoints(self) -> bool:
        return self.checkpoint_every_ms > 0


def checkpointed(durability: Durability = Durability.SYNC, flush_interval_ms: int = 1000) -> Setup:
    """A checkpoint every few dozen ms (the child's loop, plus the engine's own timer
    and log-size trigger) and 64 KiB segments: kills land across checkpoints and rolls."""
    return Setup(
        durability=durability,
        flush_interval_ms=flush_interval_ms,
        segment_bytes=64 << 10,
        checkpoint_interval_ms=200,
        checkpoint_log_bytes=256 << 10,
        checkpoint_every_ms=25,
    )


PLAIN_SYNC = Setup()
POP_SETUPS = {"plain": PLAIN_SYNC, "checkpoints": checkpointed()}


# -- the append workload's model -----------------------------------------------------


@dataclass
class AppendModel:
    """What the store must hold: every request tried (by sequence number) and every
    acknowledged placement; ``snapshot`` is the last verified content, per queue the
    sequence numbers by offset."""

    reqs: dict[int, worker.Req] = field(default_factory=dict)
    acked: dict[tuple[str, int], int] = field(default_factory=dict)
    snapshot: dict[str, list[int]] = field(default_factory=dict)

    def ack(self, label: str, offset: int, seq: int) -> None:
        previous = self.acked.setdefault((label, offset), seq)
        assert previous == seq, f"{label}@{offset} acknowledged for seq {previous} and {seq}"

    def absorb(self, seq_start: int, lines: Iterable[list[str]]) -> int:
        """Take in a killed child's report; returns how many placements it acked."""
        lines = list(lines)
        tried = [int(t[2]) for t in lines if t[0] == "S"]
        if not tried:
            return 0
        last = max(tried)
        for seq, req in worker.plan_requests(seq_start, last).items():
            if seq <= last:
                self.reqs[seq] = req
        acks = 0
        for tokens in lines:
            if tokens[0] != "A":
                continue
            seq, label, offset = int(tokens[1]), tokens[2], int(tokens[3])
            assert seq in self.reqs, f"seq {seq} acknowledged but never announced"
            assert label in self.reqs[seq].dsts, f"seq {seq} acknowledged in {label}"
            self.ack(label, offset, seq)
            acks += 1
        return acks


async def read_queue(engine: Engine, ref: QueueRef) -> list[StoredMessage]:
    offsets = await engine.queue_offsets(ref)
    assert offsets.earliest == 0, f"{ref} lost its head: {offsets}"
    messages: list[StoredMessage] = []
    offset = 0
    while offset < offsets.latest:
        result = await engine.read(ref, offset, max_messages=512, max_bytes=16 << 20)
        assert result.messages, f"{ref}: nothing readable at {offset} below {offsets.latest}"
        messages.extend(result.messages)
        offset = result.next_offset
    assert [m.offset for m in messages] == list(range(offsets.latest)), f"{ref}: offsets gap"
    return messages


async def verify_append_store(engine: Engine, model: AppendModel) -> dict[str, list[int]]:
    """Check the whole store against the model; returns (and keeps) its content."""
    content: dict[str, list[int]] = {}
    where: dict[str, dict[int, int]] = {}
    for label, ref in worker.APPEND_QUEUES.items():
        seqs: list[int] = []
        for stored in await read_queue(engine, ref):
            seq = worker.seq_of(stored.message)
            assert seq in model.reqs, f"{label}@{stored.offset}: seq {seq} was never written"
            assert label in model.reqs[seq].dsts, f"{label}@{stored.offset}: seq {seq} misplaced"
            expected = worker.make_message(seq)
            if stored.message != expected:  # compare first: a diff of 64 KiB bodies is noise
                pytest.fail(f"{label}@{stored.offset}: seq {seq} is not byte-exact")
            seqs.append(seq)
        assert len(set(seqs)) == len(seqs), f"{label}: a message is stored twice"
        content[label] = seqs
        where[label] = {seq: offset for offset, seq in enumerate(seqs)}

    # Every acknowledged placement, at its offset.
    for (label, offset), seq in model.acked.items():
        seqs = content[label]
        assert offset < len(seqs), f"acknowledged {label}@{offset} (seq {seq}) is lost"
        assert seqs[offset] == seq, f"{label}@{offset}: seq {seqs[offset]}, acked seq {seq}"

    # A request is all or nothing: every message, in every queue, at adjacent offsets.
    for label, seqs in content.items():
        for seq in seqs:
            req = model.reqs[seq]
            base = where[label][seq] - (seq - req.first_seq)
            for dst in req.dsts:
                assert dst in where and req.first_seq in where[dst], (
                    f"seq {seq} is in {label} but request {req} is missing from {dst}"
                )
                first = where[dst][req.first_seq]
                assert content[dst][first : first + req.count] == list(req.seqs), (
                    f"request {req} is not whole in {dst}"
                )
            assert where[label][req.first_seq] == base

    # Batch entries come back as stored, raw bytes included.
    for label, ref in worker.APPEND_QUEUES.items():
        offset = 0
        while offset < len(content[label]):
            batches = await engine.read_batches(ref, offset, max_bytes=4 << 20)
            assert batches, f"{label}: read_batches returned nothing at {offset}"
            for batch in batches:
                req = model.reqs[content[label][batch.base_offset]]
                assert batch.base_offset == offset, f"{label}: batch boundary off at {offset}"
                assert batch.count == req.count
                if req.batch:
                    assert batch.format == worker.BATCH_FORMAT
                    assert batch.raw == worker.make_raw(req.first_seq, req.count)
                else:
                    assert batch.format is None and batch.raw is None
                offset += batch.count
    model.snapshot = content
    return content


def assert_extends(before: dict[str, list[int]], after: dict[str, list[int]]) -> None:
    for label, seqs in before.items():
        assert after[label][: len(seqs)] == seqs, f"{label}: verified content changed"


async def append_more(engine: Engine, model: AppendModel, steps: Iterable[worker.Step]) -> None:
    """Append in-process (as the child does) and check the offsets continue densely."""
    before = {
        label: (await engine.queue_offsets(ref)).latest
        for label, ref in worker.APPEND_QUEUES.items()
    }
    assigned: dict[str, list[int]] = defaultdict(list)
    for step in steps:
        calls = [engine.append([r.request() for r in call]) for call in step]
        for call, results in zip(step, await asyncio.gather(*calls), strict=True):
            for req, result in zip(call, results, strict=True):
                for seq in req.seqs:
                    model.reqs[seq] = req
                labels = tuple(worker.label_of(p.queue) for p in result.placements)
                assert labels == req.dsts
                for placement in result.placements:
                    label = worker.label_of(placement.queue)
                    for i, seq in enumerate(req.seqs):
                        model.ack(label, placement.offset + i, seq)
                        assigned[label].append(placement.offset + i)
    for label, start in before.items():
        offsets = sorted(assigned[label])
        assert offsets == list(range(start, start + len(offsets))), (
            f"{label}: new appends after recovery do not continue at {start}: {offsets[:8]}"
        )


async def check_recovered_append_store(
    config: EngineConfig, model: AppendModel, round_no: int
) -> None:
    """Reopen after a crash: verify, append more, and verify across another reopen."""
    async with Engine(config) as engine:
        content = await verify_append_store(engine, model)
        steps = islice(worker.plan(round_no * ROUND_SEQS + ROUND_SEQS // 2), 6)
        await append_more(engine, model, steps)
        extended = await verify_append_store(engine, model)
        assert_extends(content, extended)
    async with Engine(config) as engine:
        again = await verify_append_store(engine, model)
        assert again == extended, "a clean reopen changed the store"


async def crash_append_child(
    setup: Setup, data_dir: Path, model: AppendModel, round_no: int, acks: int, kill_on: str
) -> None:
    """Run the append child until ``acks`` placements are acknowledged (and, with
    checkpoints, a few checkpoints done), then SIGKILL it at the next ``kill_on`` line."""
    seq_start = round_no * ROUND_SEQS + 1
    async with spawn("append", data_dir, *setup.options(), f"--seq-start={seq_start}") as child:
        await child.read_count("A", acks)
        if setup.checkpoints:
            await child.read_count("K", child.counts["K"] + 3)
        await child.read_until(lambda t: t[0] == kill_on, f"a {kill_on!r} line")
        lines = await child.kill()
    acked = model.absorb(seq_start, lines)
    assert acked >= acks


APPEND_SETUPS = {
    "sync": PLAIN_SYNC,
    # async durability writes before acknowledging: a process crash loses nothing.
    "async": Setup(durability=Durability.ASYNC, flush_interval_ms=60_000),
    "sync-checkpoints-segment-rolls": checkpointed(),
    "async-checkpoints-segment-rolls": checkpointed(Durability.ASYNC, flush_interval_ms=60_000),
}


@pytest.mark.parametrize("setup", APPEND_SETUPS.values(), ids=APPEND_SETUPS.keys())
async def test_acknowledged_appends_survive_sigkill(tmp_path: Path, setup: Setup) -> None:
    data_dir = tmp_path / "data"
    config = setup.config(data_dir)
    model = AppendModel()
    # Three crashes of the same store, each recovered, extended and reopened; the
    # kill lands after an append's report, as a step starts, or after a checkpoint.
    for round_no, kill_on in enumerate(("A", "K" if setup.checkpoints else "S", "S")):
        before = dict(model.snapshot)
        await crash_append_child(setup, data_dir, model, round_no, acks=250, kill_on=kill_on)
        await check_recovered_append_store(config, model, round_no)
        assert_extends(before, model.snapshot)
    if setup.segment_bytes < (1 << 20):
        assert len(list((data_dir / "commitlog").glob("*.log"))) > 10, "segments did not roll"


# -- acks ----------------------------------------------------------------------------


def work_message(seq: int) -> Message:
    return Message(body=b"work-%d" % seq, key=b"%d" % seq, properties=(("seq", b"%d" % seq),))


async def prefill_work(config: EngineConfig, count: int) -> None:
    async with Engine(config) as engine:
        await engine.create_topic(NS, worker.WORK_TOPIC, TopicConfig(queue_count=2))
        refs = list(worker.WORK_QUEUES.values())
        seq = 0
        while seq < count:
            requests = []
            for i in range(64):
                ref = refs[(seq + i) % 2]
                if i % 16 == 5:  # some batch entries: one record, several offsets
                    entry: Message | BatchEntry = BatchEntry(
                        format="work.v1",
                        raw=b"batch",
                        messages=(work_message(seq + i),) * 3,
                    )
                else:
                    entry = work_message(seq + i)
                requests.append(AppendRequest(entry=entry, queues=(ref,)))
            await engine.append(requests)
            seq += len(requests)


@pytest.mark.parametrize("setup", POP_SETUPS.values(), ids=POP_SETUPS.keys())
async def test_acknowledged_acks_survive_sigkill(tmp_path: Path, setup: Setup) -> None:
    data_dir = tmp_path / "data"
    config = setup.config(data_dir)
    await prefill_work(config, 4000)
    async with spawn("ack", data_dir, *setup.options()) as child:
        await child.read_count("A", 400)
        if setup.checkpoints:
            await child.read_count("K", child.counts["K"] + 3)
        await child.read_until(lambda t: t[0] == "A", "one more ack")
        lines = await child.kill()

    popped: dict[tuple[str, int], int] = {}  # reported by pop, with its attempt
    tried: set[tuple[str, int]] = set()  # ack called
    acked: set[tuple[str, int]] = set()  # ack returned
    for kind, *rest in lines:
        if kind == "P":
            popped[(rest[0], int(rest[1]))] = int(rest[2])
        elif kind == "T":
            tried.add((rest[0], int(rest[1])))
        elif kind == "A":
            acked.add((rest[0], int(rest[1])))
    assert acked <= tried <= set(popped)
    assert all(attempt == 1 for attempt in popped.values())

    # The child's in-flight messages were due back long ago for a clock an hour ahead.
    clock = ManualClock(start_ms=time.time_ns() // 1_000_000 + 3_600_000)
    async with Engine(config, clock=clock) as engine:
        total = {
            label: (await engine.queue_offsets(ref)).latest
            for label, ref in worker.WORK_QUEUES.items()
        }
        assert sum(total.values()) > len(acked), "the child drained the queue before the kill"
        redelivered: dict[tuple[str, int], int] = {}
        refs = list(worker.WORK_QUEUES.values())
        while batch := await engine.pop(
            NS, worker.WORK_GROUP, refs, max_messages=64, invisible_ms=600_000
        ):
            for message in batch:
                key = (worker.label_of(message.queue), message.offset)
                assert key not in redelivered, f"{key} handed out twice"
                redelivered[key] = message.delivery_attempt
            await asyncio.gather(
                *(engine.ack(NS, worker.WORK_GROUP, m.receipt or "") for m in batch)
            )
        every = {(label, o) for label, end in total.items() for o in range(end)}
        assert not acked & set(redelivered), "an acknowledged ack was undone by the crash"
        missing = every - set(redelivered)
        assert missing <= tried, f"never acked, yet not handed out: {sorted(missing - tried)[:10]}"
        for key, attempt in redelivered.items():
            if key in popped:  # its pop was durable: this is the second delivery
                assert attempt == popped[key] + 1, f"{key}: attempt {attempt} after a crash"
            else:
                assert attempt in (1, 2), f"{key}: attempt {attempt}"
        for ref in refs:
            assert await engine.pending_count(NS, worker.WORK_GROUP, ref) == 0
            assert await engine.inflight_count(NS, worker.WORK_GROUP, ref) == 0
        # The queue still takes appends, at the right offset, and pops them.
        ref = refs[0]
        [result] = await engine.append([AppendRequest(entry=work_message(-1), queues=(ref,))])
        assert result.placements[0].offset == total["W0"]
    async with Engine(config, clock=clock) as engine:
        [fresh] = await engine.pop(NS, worker.WORK_GROUP, refs, max_messages=64)
        assert (fresh.queue, fresh.offset) == (ref, total["W0"])
        assert fresh.message == work_message(-1)
        assert fresh.receipt is not None
        await engine.ack(NS, worker.WORK_GROUP, fresh.receipt)
    async with Engine(config, clock=clock) as engine:
        assert await engine.pop(NS, worker.WORK_GROUP, refs, max_messages=64) == []


# -- offset commits ------------------------------------------------------------------


@pytest.mark.parametrize("setup", POP_SETUPS.values(), ids=POP_SETUPS.keys())
async def test_acknowledged_offset_commits_survive_sigkill(tmp_path: Path, setup: Setup) -> None:
    data_dir = tmp_path / "data"
    config = setup.config(data_dir)
    async with Engine(config) as engine:
        await engine.create_topic(NS, worker.OFFSETS_TOPIC, TopicConfig(queue_count=3))
    async with spawn("commit", data_dir, *setup.options()) as child:
        await child.read_count("A", 600)
        if setup.checkpoints:
            await child.read_count("K", child.counts["K"] + 3)
        await child.read_until(lambda t: t[0] == "T", "one more commit")
        lines = await child.kill()

    tried: dict[tuple[str, str], set[int]] = defaultdict(set)
    last_acked: dict[tuple[str, str], int] = {}
    for kind, *rest in lines:
        if kind in ("T", "A"):
            key, offset = (rest[0], rest[1]), int(rest[2])
            if kind == "T":
                tried[key].add(offset)
            else:
                assert offset in tried[key]
                last_acked[key] = max(offset, last_acked.get(key, 0))
    assert len(last_acked) == len(worker.OFFSETS_GROUPS) * len(worker.OFFSETS_QUEUES)

    async def check(engine: Engine) -> dict[tuple[str, str], int]:
        found: dict[tuple[str, str], int] = {}
        for group in worker.OFFSETS_GROUPS:
            listed = await engine.list_group_offsets(NS, group)
            for label, ref in worker.OFFSETS_QUEUES.items():
                committed = await engine.fetch_offset(NS, group, ref)
                key = (group, label)
                assert committed is not None, f"{key}: the committed offset is lost"
                assert listed[ref] == committed
                assert committed.offset >= last_acked[key], (
                    f"{key}: committed {committed.offset} went back below the acknowledged "
                    f"{last_acked[key]}"
                )
                assert committed.offset in tried[key], f"{key}: {committed.offset} never sent"
                assert committed.metadata == worker.commit_metadata(group, label, committed.offset)
                found[key] = committed.offset
        return found

    async with Engine(config) as engine:
        found = await check(engine)
        assert sorted(await engine.list_groups(NS)) == sorted(worker.OFFSETS_GROUPS)
        ref = worker.OFFSETS_QUEUES["O1"]
        offset = found[("g2", "O1")] + 1000
        await engine.commit_offset(
            NS, "g2", ref, offset, worker.commit_metadata("g2", "O1", offset)
        )
        tried[("g2", "O1")].add(offset)
        last_acked[("g2", "O1")] = offset
    async with Engine(config) as engine:
        found = await check(engine)
        assert found[("g2", "O1")] == offset


# -- torn tails ----------------------------------------------------------------------


def log_segments(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "commitlog").glob("*.log"))


def frames(path: Path) -> list[tuple[int, bytes]]:
    """``(position in file, payload)`` of every record; fails on anything invalid."""
    data = path.read_bytes()
    found: list[tuple[int, bytes]] = []
    local = 0
    while local < len(data):
        assert local + _FRAME.size <= len(data), f"{path.name}: partial header at {local}"
        length, crc = _FRAME.unpack_from(data, local)
        payload = data[local + _FRAME.size : local + _FRAME.size + length]
        assert length > 0 and len(payload) == length, f"{path.name}: torn record at {local}"
        assert crc32c.crc32c(payload) == crc, f"{path.name}: bad CRC at {local}"
        found.append((local, payload))
        local += _FRAME.size + length
    return found


def frame(payload: bytes, *, crc: int | None = None) -> bytes:
    return _FRAME.pack(len(payload), crc32c.crc32c(payload) if crc is None else crc) + payload


def tear(kind: str, last_payload: bytes) -> bytes:
    """Bytes a crash could leave after the last whole record."""
    whole = frame(last_payload)
    rnd = random.Random(kind)
    if kind == "length-past-eof":  # a header whose record never made it
        return _FRAME.pack(1 << 20, 0x12345678) + rnd.randbytes(300)
    if kind == "half-record":  # a real record cut halfway
        return whole[: max(_FRAME.size + 1, len(whole) // 2)]
    if kind == "partial-header":
        return whole[:5]
    if kind == "bad-crc":  # complete and decodable, but the checksum says no
        return frame(last_payload, crc=crc32c.crc32c(last_payload) ^ 0x1)
    if kind == "bad-crc-then-valid":  # nothing after a bad record is trusted
        return frame(last_payload, crc=0) + whole
    if kind == "zeros":  # a file extended but never written (as ext4 may show)
        return bytes(4096)
    raise ValueError(kind)


TEARS = [
    "length-past-eof",
    "half-record",
    "partial-header",
    "bad-crc",
    "bad-crc-then-valid",
    "zeros",
    "new-segment",
]


async def create_append_topics(engine: Engine) -> None:
    existing = {t.name for t in await engine.list_topics(NS)}
    for topic, queues in worker.APPEND_TOPICS.items():
        if topic not in existing:
            await engine.create_topic(NS, topic, TopicConfig(queue_count=queues))


async def fill(config: EngineConfig, model: AppendModel, steps: int, seq_start: int) -> None:
    async with Engine(config) as engine:
        await create_append_topics(engine)
        await append_more(engine, model, islice(worker.plan(seq_start), steps))
        await verify_append_store(engine, model)


def write_tear(data_dir: Path, kind: str) -> tuple[Path, int]:
    """Tear the log's tail; returns the segment torn and its size before."""
    segments = log_segments(data_dir)
    last = segments[-1]
    records = frames(last) or frames(segments[-2])
    size = last.stat().st_size
    if kind == "new-segment":  # a crash right after rolling to a new segment
        base = int(last.stem) + size
        torn = data_dir / "commitlog" / f"{base:020d}.log"
        torn.write_bytes(tear("half-record", records[-1][1]))
        return torn, 0
    with open(last, "ab") as handle:
        handle.write(tear(kind, records[-1][1]))
    return last, size


async def test_reopen_replays_records_written_since_the_checkpoint(tmp_path: Path) -> None:
    """The smallest crash, in-process: the files of a live engine copied as they are
    after acknowledged appends (no checkpoint yet), so recovery must replay the log."""
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    model = AppendModel()
    async with Engine(EngineConfig(data_dir=live)) as engine:
        await create_append_topics(engine)
        await append_more(engine, model, islice(worker.plan(1), 5))
        shutil.copytree(live, crashed)  # nothing runs on the loop meanwhile
    assert not (crashed / "checkpoint.json").exists()
    await check_recovered_append_store(EngineConfig(data_dir=crashed), model, round_no=1)


@pytest.mark.parametrize("kind", TEARS)
async def test_torn_tail_is_cut(tmp_path: Path, kind: str) -> None:
    data_dir = tmp_path / "data"
    config = EngineConfig(data_dir=data_dir, segment_bytes=64 << 10)
    model = AppendModel()
    await fill(config, model, steps=30, seq_start=1)
    torn, size = write_tear(data_dir, kind)
    async with Engine(config) as engine:
        # Cut exactly at the last whole record; only whole records remain.
        assert (torn.stat().st_size if torn.exists() else 0) == size
        for segment in log_segments(data_dir):
            frames(segment)
        await verify_append_store(engine, model)
    await check_recovered_append_store(config, model, round_no=1)


async def test_torn_tail_after_sigkill(tmp_path: Path) -> None:
    """A crash without any checkpoint (recovery replays the whole log), then a torn
    record on top of whatever the kill left."""
    data_dir = tmp_path / "data"
    setup = Setup(segment_bytes=256 << 10)
    model = AppendModel()
    await crash_append_child(setup, data_dir, model, round_no=0, acks=200, kill_on="A")
    assert not (data_dir / "checkpoint.json").exists()
    write_tear(data_dir, "half-record")
    await check_recovered_append_store(setup.config(data_dir), model, round_no=0)
    for segment in log_segments(data_dir):
        frames(segment)


async def test_torn_index_file_append(tmp_path: Path) -> None:
    """A crash while a checkpoint appends to an index file (before it writes the new
    checkpoint) leaves the old checkpoint and a partial index entry; with a power
    loss the cut falls on a block boundary, and the index header puts that inside
    an entry. Recovery must drop the partial entry for good, not append after it."""
    data_dir = tmp_path / "data"
    config = EngineConfig(data_dir=data_dir)
    model = AppendModel()
    await fill(config, model, steps=10, seq_start=1)  # closed: checkpoint 1
    # The checkpoint and the files it names (topics, cursors) as checkpoint 1 left them.
    old_checkpoint = {p.name: p.read_bytes() for p in data_dir.glob("*.json*")}
    index_sizes = {p: p.stat().st_size for p in (data_dir / "index").glob("*.idx")}
    await fill(config, model, steps=10, seq_start=ROUND_SEQS)  # checkpoint 2 appends
    # Undo checkpoint 2 as a crash in the middle of its index writes would: before it
    # replaces checkpoint.json, and so before it removes checkpoint 1's files.
    for name, content in old_checkpoint.items():
        (data_dir / name).write_bytes(content)
    for path, size in index_sizes.items():
        if path.stat().st_size > size:
            with open(path, "r+b") as handle:
                handle.truncate(size + 16)  # half of the first new entry
    await check_recovered_append_store(config, model, round_no=2)
    async with Engine(config) as engine:
        await verify_append_store(engine, model)


# -- helpers' own sanity -------------------------------------------------------------


def test_plan_is_deterministic_and_dense() -> None:
    first = list(islice(worker.plan(5), 200))
    assert first == list(islice(worker.plan(5), 200))
    seqs = [s for step in first for call in step for r in call for s in r.seqs]
    assert seqs == list(range(5, 5 + len(seqs)))
    reqs = [r for step in first for call in step for r in call]
    assert any(r.batch for r in reqs) and any(len(r.dsts) > 1 for r in reqs)
    assert any(len(step) > 1 for step in first) and any(len(step[0]) > 1 for step in first)
    sizes = [worker.body_size(s) for s in range(2000)]
    assert min(sizes) == 1 and max(sizes) > 60 << 10
    assert worker.make_message(77) == worker.make_message(77) != worker.make_message(78)
