"""The replicated log's own promises, with real owners of one shard in one process:

* the fence: once a new owner sealed the stream, the old one cannot append (its
  writes fail with ``ShardMoved``, none is acknowledged), and what it tried to write
  is not in the log a third owner recovers (broken on purpose, the expected-sequence
  check dropped, the old owner's late append lands and the test fails);
* a batch larger than a stream message, split into chunks, replays whole; the chunks
  of a batch whose writer died before sending them all are cut at the next takeover;
* retention purges the stream below what the replicated checkpoint still needs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from polymq.storage import errors
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.log import Claim, ReplicatedLog
from polymq.storage.replicated.stream import ShardStream
from tests.storage.test_replicated_contract import nats_url  # noqa: F401 (a fixture)

ONE_FORM = True
NS = "default"
_names = itertools.count()


@pytest.fixture
async def owners(
    nats_url: str,  # noqa: F811
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Engine]]:
    """Engines owning one shard, each with its own data directory and epoch."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    shard = f"fence{next(_names)}-{abs(hash(str(tmp_path))) % 10**8}"
    checkpoints = CheckpointStore(js, replicas=1)
    await ShardStream(js, shard, replicas=1).ensure()

    def owner(epoch: int, **config: Any) -> Engine:
        stream = ShardStream(js, shard, replicas=1, chunk_bytes=4096)  # each its own view

        async def claim() -> Claim:
            return Claim(stream=stream, checkpoints=checkpoints, epoch=epoch)

        settings = EngineConfig(
            data_dir=tmp_path / f"owner{epoch}", durability=Durability.SYNC, **config
        )

        def make_log(directory: Path) -> CommitLog:
            return ReplicatedLog(
                directory,
                claim=claim,
                segment_bytes=settings.segment_bytes,
                flush_interval_ms=50,
            )

        return Engine(settings, log=make_log)

    owner.js = js  # type: ignore[attr-defined]
    owner.shard = shard  # type: ignore[attr-defined]

    yield owner
    await ShardStream(js, shard, replicas=1).delete()
    await nc.close()


def _append(body: bytes) -> list[AppendRequest]:
    return [AppendRequest(entry=Message(body=body), queues=(QueueRef(NS, "t", 0),))]


async def _bodies(engine: Engine) -> list[bytes]:
    result = await engine.read(QueueRef(NS, "t", 0), 0, max_messages=100)
    return [m.message.body for m in result.messages]


async def test_a_deposed_owner_cannot_append_after_its_successor_sealed_the_stream(
    owners: Callable[..., Engine],
) -> None:
    old = owners(1)
    await old.start()
    try:
        await old.create_topic(NS, "t")
        await old.append(_append(b"before"))
        async with owners(2) as new:  # takes over while the old one still runs
            assert await _bodies(new) == [b"before"]
            with pytest.raises(errors.ShardMoved):
                await old.append(_append(b"late"))
            with pytest.raises(errors.ShardMoved):  # and it stays stopped
                await old.append(_append(b"later"))
            await new.append(_append(b"after"))
            assert await _bodies(new) == [b"before", b"after"]
    finally:
        await old.close()
    async with owners(3) as third:
        assert await _bodies(third) == [b"before", b"after"]


async def test_a_batch_larger_than_a_stream_message_replays_whole(
    owners: Callable[..., Engine],
) -> None:
    big = bytes(range(256)) * 100  # 25,600 bytes: seven chunks of 4 KiB
    async with owners(1) as first:
        await first.create_topic(NS, "t")
        await first.append(_append(big) + _append(b"small"))
    async with owners(2) as second:
        assert await _bodies(second) == [big, b"small"]


async def test_the_chunks_of_an_unfinished_batch_are_cut_at_the_next_takeover(
    owners: Callable[..., Engine],
) -> None:
    async with owners(1) as first:
        await first.create_topic(NS, "t")
        await first.append(_append(b"kept"))
        end = first._log.end
    # A writer that died after sending two chunks of a batch that needed more: they
    # are in the stream, the batch was never acknowledged.
    stream = ShardStream(owners.js, owners.shard, replicas=1, chunk_bytes=4096)  # type: ignore[attr-defined]
    stream.last_seq = await stream.last_sequence()
    stream.epoch = 7
    torn = b"\x10\x00\x10\x00" + b"y" * 8000  # a frame header claiming more than is sent
    await stream._publish_one(end, torn[:4096], False)
    await stream._publish_one(end + 4096, torn[4096:], True)
    async with owners(8) as second:
        assert await _bodies(second) == [b"kept"]
        await second.append(_append(b"after"))
    async with owners(9) as third:
        assert await _bodies(third) == [b"kept", b"after"]


async def test_retention_purges_the_stream_below_the_replicated_checkpoint(
    owners: Callable[..., Engine],
) -> None:
    async with owners(1, segment_bytes=4096, retention_bytes=8192) as engine:
        await engine.create_topic(NS, "t")
        for i in range(60):
            await engine.append(_append(b"%d" % i + b"x" * 500))
        await engine.checkpoint()
        await engine.enforce_retention()
        earliest = (await engine.queue_offsets(QueueRef(NS, "t", 0))).earliest
        assert earliest > 0

        async def first_seq() -> int:
            info = await owners.js.stream_info(engine._log.stream.name)  # type: ignore[attr-defined]
            return int(info.state.first_seq)

        deadline = asyncio.get_running_loop().time() + 30
        while await first_seq() <= 1:
            assert asyncio.get_running_loop().time() < deadline, "the stream was never purged"
            await asyncio.sleep(0.05)
    async with owners(2, segment_bytes=4096, retention_bytes=8192) as again:
        offsets = await again.queue_offsets(QueueRef(NS, "t", 0))
        assert offsets.latest == 60 and offsets.earliest == earliest
        first = (await again.read(QueueRef(NS, "t", 0), earliest)).messages[0]
        assert first.message.body.startswith(b"%d" % earliest)
