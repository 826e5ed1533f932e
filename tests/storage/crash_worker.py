"""A workload run as a child process by ``test_crash_recovery.py`` and SIGKILLed there.

Usage: ``python tests/storage/crash_worker.py MODE DATA_DIR [options]`` with MODE one of

* ``append``: create the topics (if missing) and append forever, following
  :func:`plan` from ``--seq-start``;
* ``ack``: pop the prefilled ``work`` topic with group ``workers`` and ack;
* ``commit``: commit ever growing offsets for two groups on the ``offs`` topic.

The child reports on stdout, one line per event, flushed at once, so that whatever
it reported before the kill is in the pipe for the parent to read:

``S <first_seq> <last_seq>``       (append) a step is about to be issued
``A <seq> <queue> <offset>``       (append) an append of this message returned
``P <queue> <offset> <attempt>``   (ack) pop returned this message
``T <queue> <offset>``             (ack) about to ack it
``A <queue> <offset>``             (ack) ack returned
``T <group> <queue> <offset>``     (commit) about to commit
``A <group> <queue> <offset>``     (commit) commit returned
``K <position>``                   a checkpoint finished

Everything the parent needs to recompute (message contents, the append plan) is a
pure function of sequence numbers, defined here and imported by the test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.errors import TopicAlreadyExists
from polymq.storage.model import (
    DEFAULT_NAMESPACE,
    AppendRequest,
    BatchEntry,
    Message,
    QueueRef,
    StoredMessage,
    TopicConfig,
)

NS = DEFAULT_NAMESPACE

# The append workload's queues, by the label used on stdout.
APPEND_TOPICS: dict[str, int] = {"crash-a": 2, "crash-b": 1}
APPEND_QUEUES: dict[str, QueueRef] = {
    "A0": QueueRef(NS, "crash-a", 0),
    "A1": QueueRef(NS, "crash-a", 1),
    "B0": QueueRef(NS, "crash-b", 0),
}

# The ack workload: a prefilled topic popped by one group.
WORK_TOPIC = "work"
WORK_GROUP = "workers"
WORK_QUEUES: dict[str, QueueRef] = {
    "W0": QueueRef(NS, WORK_TOPIC, 0),
    "W1": QueueRef(NS, WORK_TOPIC, 1),
}
ACK_INVISIBLE_MS = 600_000  # the child never sees a redelivery

# The offset-commit workload.
OFFSETS_TOPIC = "offs"
OFFSETS_GROUPS = ("g1", "g2")
OFFSETS_QUEUES: dict[str, QueueRef] = {f"O{i}": QueueRef(NS, OFFSETS_TOPIC, i) for i in range(3)}

BATCH_FORMAT = "crash.v1"


def label_of(queue: QueueRef) -> str:
    for table in (APPEND_QUEUES, WORK_QUEUES, OFFSETS_QUEUES):
        for label, ref in table.items():
            if ref == queue:
                return label
    raise KeyError(queue)


# -- deterministic contents -----------------------------------------------------------


def body_size(seq: int) -> int:
    """1 B to 64 KiB, mostly small: derived from ``seq`` alone."""
    rnd = random.Random(seq * 7919 + 17)
    pick = rnd.random()
    if pick < 0.5:
        return rnd.randint(1, 256)
    if pick < 0.85:
        return rnd.randint(257, 8 << 10)
    return rnd.randint((8 << 10) + 1, 64 << 10)


def make_message(seq: int) -> Message:
    """The message with sequence number ``seq``, byte for byte."""
    rnd = random.Random(seq)
    body = rnd.randbytes(body_size(seq))
    properties: list[tuple[str, bytes]] = [("seq", str(seq).encode())]
    if seq % 3:
        properties.append(("bin", rnd.randbytes(rnd.randint(0, 40))))
    if seq % 4 == 1:  # repeated names keep their order
        properties += [("dup", b"first"), ("dup", b""), ("dup", b"\x00\xff")]
    return Message(
        body=body,
        key=None if seq % 5 == 0 else b"key-%d" % seq,
        tag=None if seq % 2 else f"tag{seq % 3}",
        properties=tuple(properties),
        content_type="application/octet-stream" if seq % 6 == 2 else None,
        born_timestamp_ms=1_700_000_000_000 + seq,
    )


def seq_of(message: Message) -> int:
    value = message.property("seq")
    if value is None:
        raise ValueError(f"message without a seq property: {message!r:.200}")
    return int(value)


def make_raw(first_seq: int, count: int) -> bytes:
    """The pass-through bytes of the batch entry holding ``first_seq`` on."""
    rnd = random.Random(-first_seq)
    return b"RAW%d/%d:" % (first_seq, count) + rnd.randbytes(rnd.randint(0, 4096))


@dataclass(frozen=True, slots=True)
class Req:
    """One AppendRequest of the plan: messages ``first_seq .. first_seq+count-1``,
    as a single message (``batch`` False, count 1) or one BatchEntry, dispatched to
    the queues labelled ``dsts``."""

    first_seq: int
    count: int
    batch: bool
    dsts: tuple[str, ...]

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + self.count)

    def entry(self) -> Message | BatchEntry:
        if not self.batch:
            return make_message(self.first_seq)
        return BatchEntry(
            format=BATCH_FORMAT,
            raw=make_raw(self.first_seq, self.count),
            messages=tuple(make_message(s) for s in self.seqs),
        )

    def request(self) -> AppendRequest:
        return AppendRequest(entry=self.entry(), queues=tuple(APPEND_QUEUES[d] for d in self.dsts))


# A step: append calls issued concurrently (asyncio.gather), each a list of requests.
Step = tuple[tuple[Req, ...], ...]


def plan(seq_start: int) -> Iterator[Step]:
    """The endless, deterministic append workload starting at ``seq_start``."""
    rnd = random.Random(seq_start)
    seq = seq_start
    labels = tuple(APPEND_QUEUES)

    def req(batch: bool, dsts: tuple[str, ...]) -> Req:
        nonlocal seq
        count = rnd.randint(2, 5) if batch else 1
        made = Req(seq, count, batch, dsts)
        seq += count
        return made

    while True:
        kind = rnd.random()
        if kind < 0.25:  # one single append
            yield ((req(False, (rnd.choice(labels),)),),)
        elif kind < 0.50:  # concurrent appends: group commit batches them
            calls = []
            for _ in range(rnd.randint(2, 6)):
                calls.append((req(rnd.random() < 0.2, (rnd.choice(labels),)),))
            yield tuple(calls)
        elif kind < 0.65:  # several requests in one call
            yield (tuple(req(False, (rnd.choice(labels),)) for _ in range(rnd.randint(2, 4))),)
        elif kind < 0.85:  # multi-dispatch: one body, several queues
            fanout: tuple[str, ...] = ("A1", "B0") if rnd.random() < 0.7 else labels
            yield ((req(False, fanout),),)
        else:  # a batch entry, sometimes multi-dispatched
            into: tuple[str, ...] = (rnd.choice(labels),) if rnd.random() < 0.6 else ("A0", "B0")
            yield ((req(True, into),),)


def plan_requests(seq_start: int, last_seq: int) -> dict[int, Req]:
    """The request holding each sequence number of the plan up to ``last_seq``."""
    by_seq: dict[int, Req] = {}
    for step in plan(seq_start):
        for call in step:
            for r in call:
                for s in r.seqs:
                    by_seq[s] = r
        if by_seq and max(by_seq) >= last_seq:
            return by_seq
    raise AssertionError("unreachable: the plan is endless")


# -- the child ----------------------------------------------------------------------


def emit(*lines: str) -> None:
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        data_dir=Path(args.data_dir),
        durability=Durability(args.durability),
        flush_interval_ms=args.flush_interval_ms,
        segment_bytes=args.segment_bytes,
        checkpoint_interval_ms=args.checkpoint_interval_ms,
        checkpoint_log_bytes=args.checkpoint_log_bytes,
    )


async def _checkpoints(engine: Engine, every_ms: int) -> None:
    """Checkpoint continuously, concurrently with the workload."""
    while True:
        await asyncio.sleep(every_ms / 1000)
        emit(f"K {await engine.checkpoint()}")


async def _append_workload(engine: Engine, seq_start: int) -> None:
    for topic, queues in APPEND_TOPICS.items():
        with contextlib.suppress(TopicAlreadyExists):
            await engine.create_topic(NS, topic, TopicConfig(queue_count=queues))

    async def call(reqs: Sequence[Req]) -> None:
        results = await engine.append([r.request() for r in reqs])
        lines = []
        for r, result in zip(reqs, results, strict=True):
            assert len(result.placements) == len(r.dsts), result
            for placement in result.placements:
                label = label_of(placement.queue)
                for i, s in enumerate(r.seqs):
                    lines.append(f"A {s} {label} {placement.offset + i}")
        emit(*lines)

    for step in plan(seq_start):
        seqs = [s for c in step for r in c for s in r.seqs]
        emit(f"S {min(seqs)} {max(seqs)}")
        await asyncio.gather(*(call(c) for c in step))


async def _ack_workload(engine: Engine) -> None:
    queues = list(WORK_QUEUES.values())
    rnd = random.Random(4242)

    async def ack(message: StoredMessage) -> None:
        assert message.receipt is not None
        await engine.ack(NS, WORK_GROUP, message.receipt)
        emit(f"A {label_of(message.queue)} {message.offset}")

    while True:
        popped = await engine.pop(
            NS,
            WORK_GROUP,
            queues,
            max_messages=rnd.randint(1, 8),
            invisible_ms=ACK_INVISIBLE_MS,
        )
        if not popped:
            await asyncio.sleep(3600)  # drained: wait for the kill
            continue
        emit(*(f"P {label_of(m.queue)} {m.offset} {m.delivery_attempt}" for m in popped))
        # Leave about one in eight in flight: after recovery they must come back.
        acking = [m for m in popped if rnd.random() >= 0.125]
        if acking:
            emit(*(f"T {label_of(m.queue)} {m.offset}" for m in acking))
            await asyncio.gather(*(ack(m) for m in acking))


def commit_metadata(group: str, label: str, offset: int) -> str:
    return f"meta/{group}/{label}/{offset}"


async def _commit_workload(engine: Engine) -> None:
    rnd = random.Random(777)
    keys = [(g, label) for g in OFFSETS_GROUPS for label in OFFSETS_QUEUES]
    current = dict.fromkeys(keys, 0)

    async def commit(group: str, label: str, offset: int) -> None:
        metadata = commit_metadata(group, label, offset)
        await engine.commit_offset(NS, group, OFFSETS_QUEUES[label], offset, metadata)
        emit(f"A {group} {label} {offset}")

    while True:
        # Distinct keys per step, committed concurrently: each key's offsets only grow.
        chosen = rnd.sample(keys, rnd.randint(1, len(keys)))
        calls: list[Awaitable[None]] = []
        for group, label in chosen:
            current[(group, label)] += rnd.randint(1, 5)
            offset = current[(group, label)]
            emit(f"T {group} {label} {offset}")
            calls.append(commit(group, label, offset))
        await asyncio.gather(*calls)


async def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.max_seconds
    async with Engine(_config(args)) as engine:
        tasks = []
        if args.checkpoint_every_ms:
            tasks.append(asyncio.create_task(_checkpoints(engine, args.checkpoint_every_ms)))
        if args.mode == "append":
            work: Awaitable[None] = _append_workload(engine, args.seq_start)
        elif args.mode == "ack":
            work = _ack_workload(engine)
        else:
            work = _commit_workload(engine)
        try:
            # Never outlive a parent that failed to kill us.
            await asyncio.wait_for(work, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            sys.exit(f"crash_worker: not killed within {args.max_seconds} s, giving up")
        finally:
            for task in tasks:
                task.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=("append", "ack", "commit"))
    parser.add_argument("data_dir")
    parser.add_argument("--durability", choices=[d.value for d in Durability], default="sync")
    parser.add_argument("--flush-interval-ms", type=int, default=1000)
    parser.add_argument("--segment-bytes", type=int, default=128 << 20)
    parser.add_argument("--checkpoint-interval-ms", type=int, default=30_000)
    parser.add_argument("--checkpoint-log-bytes", type=int, default=256 << 20)
    parser.add_argument("--checkpoint-every-ms", type=int, default=0)
    parser.add_argument("--seq-start", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
