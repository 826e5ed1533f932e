"""StorageAPI.compact on the engine: gaps that every reader skips, rewritten batch
entries, offsets that never move, and a compaction that a crash leaves either not done
or done, never half done and never losing a kept record."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from polymq.storage.engine import Engine
from polymq.storage.errors import InvalidArgument
from polymq.storage.model import (
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
Q = QueueRef(NS, "t", 0)


def _message(i: int) -> Message:
    return Message(body=b"m%d" % i, key=b"k%d" % (i % 3))


def _batch(first: int, count: int, raw: bytes = b"") -> BatchEntry:
    messages = tuple(_message(i) for i in range(first, first + count))
    return BatchEntry(format="test.batch", raw=raw or b"batch%d" % first, messages=messages)


async def _fill(engine: Engine) -> None:
    """Offsets 0-5 single messages, 6-9 one batch entry, 10-11 single messages."""
    await engine.create_topic(NS, "t", TopicConfig(queue_count=1))
    singles = [AppendRequest(entry=_message(i), queues=(Q,)) for i in range(6)]
    await engine.append(singles)
    await engine.append([AppendRequest(entry=_batch(6, 4), queues=(Q,))])
    await engine.append([AppendRequest(entry=_message(i), queues=(Q,)) for i in (10, 11)])


async def _bodies(engine: Engine) -> dict[int, bytes]:
    """Offset -> body through ``read``, one small read after another."""
    found: dict[int, bytes] = {}
    offsets = await engine.queue_offsets(Q)
    offset = offsets.earliest
    while offset < offsets.latest:
        result = await engine.read(Q, offset, max_messages=2)
        found.update({m.offset: m.message.body for m in result.messages})
        assert result.next_offset > offset
        offset = result.next_offset
    return found


async def _batches(engine: Engine) -> list[tuple[int, int, bytes | None, list[int]]]:
    """(base, count, raw, message offsets) per entry through ``read_batches``."""
    found: list[tuple[int, int, bytes | None, list[int]]] = []
    offset = (await engine.queue_offsets(Q)).earliest
    while True:
        batches = await engine.read_batches(Q, offset, max_bytes=8)
        if not batches:
            return found
        for b in batches:
            found.append((b.base_offset, b.count, b.raw, [m.offset for m in b.messages]))
        offset = batches[-1].base_offset + batches[-1].count


ALL = {i: b"m%d" % i for i in range(12)}


async def test_dropped_offsets_become_gaps_every_reader_skips(storage: Engine) -> None:
    await _fill(storage)
    assert await storage.compact(Q, drop=[1, 3, 6, 7, 8, 9, 11]) == 7
    assert await storage.queue_offsets(Q) == QueueOffsets(0, 12)  # offsets never move
    assert await _bodies(storage) == {i: ALL[i] for i in (0, 2, 4, 5, 10)}
    assert [b[0] for b in await _batches(storage)] == [0, 2, 4, 5, 10]
    # a read starting on a gap answers from the next record
    result = await storage.read(Q, 6, max_messages=1)
    assert [m.offset for m in result.messages] == [10] and result.next_offset == 11
    assert (await storage.read(Q, 11)).next_offset == 12  # only gaps left: past them
    # pops hand out only what is left
    await storage.set_group_config(NS, "g", GroupConfig())
    popped = await storage.pop(NS, "g", [Q], max_messages=32, invisible_ms=30_000)
    assert [m.offset for m in popped] == [0, 2, 4, 5, 10]
    # appends go on at the end
    [placed] = await storage.append([AppendRequest(entry=_message(12), queues=(Q,))])
    assert placed.placements[0].offset == 12
    assert (await _bodies(storage))[12] == b"m12"


async def test_a_rewritten_batch_keeps_its_offsets(storage: Engine) -> None:
    await _fill(storage)
    kept = (_message(6), Message(), Message(), _message(9))  # 7 and 8 are dropped
    new = BatchEntry(format="test.batch", raw=b"rewritten", messages=kept)
    assert await storage.compact(Q, drop=[7, 8, 2], rewrite={6: new}) == 3
    batches = await _batches(storage)
    assert (6, 4, b"rewritten", []) in batches
    assert await _bodies(storage) == {i: ALL[i] for i in (0, 1, 3, 4, 5, 6, 9, 10, 11)}
    from_nine = await storage.read_batches(Q, 9)
    assert (from_nine[0].base_offset, from_nine[0].raw) == (6, b"rewritten")


async def test_compaction_refuses_what_it_cannot_do(storage: Engine) -> None:
    await _fill(storage)
    with pytest.raises(InvalidArgument):
        await storage.compact(Q, drop=[7])  # part of an entry, not rewritten
    with pytest.raises(InvalidArgument):
        await storage.compact(Q, drop=[12])  # past the end
    with pytest.raises(InvalidArgument):
        await storage.compact(Q, rewrite={7: _batch(7, 3)})  # starts no entry
    with pytest.raises(InvalidArgument):
        await storage.compact(Q, rewrite={6: _batch(6, 3)})  # another span
    assert await storage.compact(Q) == 0
    assert await _bodies(storage) == ALL  # nothing changed by the refusals


async def test_compaction_survives_restart_and_replay(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    engine = make_engine()
    async with engine:
        await _fill(engine)
        await engine.checkpoint()
        await engine.compact(Q, drop=[0, 4, 6, 7, 8, 9])
        expected = await _bodies(engine)
        # a copy of the directory now is the state a crash leaves: no checkpoint since
        shutil.copytree(engine.config.data_dir, tmp_path / "crashed")
        await engine.compact(Q, drop=[1])
    async with make_engine() as reopened:  # closed cleanly: from the checkpoint
        assert await _bodies(reopened) == {i: b for i, b in expected.items() if i != 1}
    async with make_engine(data_dir=tmp_path / "crashed") as replayed:
        assert await _bodies(replayed) == expected
        assert await replayed.queue_offsets(Q) == QueueOffsets(0, 12)
        await replayed.compact(Q, drop=[10])  # and compacts again
        assert 10 not in await _bodies(replayed)


def _cut_log(data_dir: Path, position: int) -> None:
    """Cut the commit log at byte ``position``, as a crash losing the tail does."""
    for segment in sorted((data_dir / "commitlog").glob("*.log")):
        base = int(segment.stem)
        if base >= position and base > 0:
            segment.unlink()
        elif base + segment.stat().st_size > position:
            with open(segment, "r+b") as handle:
                handle.truncate(position - base)


async def test_a_crash_leaves_compaction_undone_or_done(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    """Cut the log at positions across the compaction's records: recovery gives the
    queue as it was before, up to the last byte, and compacted once it is all there."""
    engine = make_engine()
    async with engine:
        await _fill(engine)
        await engine.checkpoint()
        before = engine._log.end
        new = BatchEntry(
            format="test.batch", raw=b"rw", messages=(Message(), _message(7), Message(), Message())
        )
        await engine.compact(Q, drop=[1, 6, 8, 9, 11], rewrite={6: new})
        after = engine._log.end
        compacted = await _bodies(engine)
        shutil.copytree(engine.config.data_dir, tmp_path / "image")
    assert compacted == {i: ALL[i] for i in (0, 2, 3, 4, 5, 7, 10)}
    cuts = sorted({before, before + 1, *range(before, after, max(1, (after - before) // 12))})
    for cut in [*cuts, after - 1, after]:
        data_dir = tmp_path / f"cut-{cut}"
        shutil.copytree(tmp_path / "image", data_dir)
        _cut_log(data_dir, cut)
        async with make_engine(data_dir=data_dir) as recovered:
            assert await _bodies(recovered) == (compacted if cut == after else ALL), cut
            assert await recovered.queue_offsets(Q) == QueueOffsets(0, 12)


async def test_old_segments_go_and_kept_records_stay(make_engine: EngineFactory) -> None:
    """Compaction copies what it keeps to the log's head, so retention can drop the
    segments that held the removed records."""
    engine = make_engine(segment_bytes=4096, retention_bytes=1)
    async with engine:
        config = TopicConfig(queue_count=1, retention_bytes=-1)  # keep everything
        await engine.create_topic(NS, "t", config)
        big = [Message(body=b"%d" % i + b"." * 400, key=b"k%d" % (i % 5)) for i in range(60)]
        await engine.append([AppendRequest(entry=m, queues=(Q,)) for m in big])
        before = engine._log.segment_stats()
        await engine.compact(Q, drop=list(range(55)))  # each key's last record stays
        await engine.checkpoint()
        await engine.enforce_retention()
        after = engine._log.segment_stats()
        assert sum(s for _, s, _ in after) < sum(s for _, s, _ in before) / 2
        assert [b[0] for b in await _batches(engine)] == list(range(55, 60))
    async with make_engine(segment_bytes=4096, retention_bytes=1) as reopened:
        bodies = await _bodies(reopened)
        assert sorted(bodies) == list(range(55, 60))
        assert bodies[59].startswith(b"59.")


async def test_a_rewritten_entry_compacts_again(storage: Engine) -> None:
    await _fill(storage)

    def entry(*kept: int) -> BatchEntry:
        messages = tuple(_message(i) if i in kept else Message() for i in range(6, 10))
        return BatchEntry(format="test.batch", raw=b"kept%r" % (kept,), messages=messages)

    assert await storage.compact(Q, drop=[7, 8], rewrite={6: entry(6, 9)}) == 2
    with pytest.raises(InvalidArgument):
        await storage.compact(Q, drop=[9])  # 6 is still there: rewrite or drop both
    assert await storage.compact(Q, drop=[9, 8], rewrite={6: entry(6)}) == 1  # 8: a gap already
    assert {6: b"m6"}.items() <= (await _bodies(storage)).items()
    assert 9 not in await _bodies(storage)
    assert await storage.compact(Q, drop=[6, 0]) == 2  # its last offset: the entry goes
    bodies = await _bodies(storage)
    assert bodies == {i: ALL[i] for i in (1, 2, 3, 4, 5, 10, 11)}
    assert [b[0] for b in await _batches(storage)] == [1, 2, 3, 4, 5, 10, 11]


async def test_appends_during_a_compaction_keep_offsets_and_order(storage: Engine) -> None:
    """Writers wait at the gate while the copies are reserved: appends racing a
    compaction land after it, and positions stay in offset order (what retention and
    recovery binary-search)."""
    await _fill(storage)

    async def append(i: int) -> int:
        [result] = await storage.append([AppendRequest(entry=_message(i), queues=(Q,))])
        return result.placements[0].offset

    reserved = [asyncio.ensure_future(append(i)) for i in range(12, 26)]
    await asyncio.sleep(0)  # reserved, not durable yet: the compaction waits for them
    compaction = asyncio.ensure_future(storage.compact(Q, drop=[0, 2, 4]))
    await asyncio.sleep(0)  # the compaction holds the gate now
    held = [asyncio.ensure_future(append(i)) for i in range(26, 40)]
    removed = await compaction
    offsets = await asyncio.gather(*reserved, *held)
    assert removed == 3
    assert sorted(offsets) == list(range(12, 40))
    bodies = await _bodies(storage)
    assert bodies == {i: b"m%d" % i for i in range(40) if i not in (0, 2, 4)}
    _, index = storage._state.queue(Q)
    positions = [index.position(o) for o in range(index.base, index.end)]
    assert positions == sorted(positions)


async def test_a_long_poll_over_trailing_gaps_waits_for_new_records(storage: Engine) -> None:
    await _fill(storage)
    await storage.compact(Q, drop=[10, 11])
    polling = asyncio.ensure_future(storage.read_batches(Q, 10, wait_ms=60_000))
    reading = asyncio.ensure_future(storage.read(Q, 11, wait_ms=60_000))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not polling.done() and not reading.done(), "only gaps ahead: nothing to answer yet"
    await storage.append([AppendRequest(entry=_message(12), queues=(Q,))])
    [batch] = await polling
    assert batch.base_offset == 12
    assert [m.offset for m in (await reading).messages] == [12]
