"""The fence of the replicated log, with two real owners of one shard in one process:
once a new owner sealed the stream, the old one cannot append (its writes fail with
``ShardMoved``, none is acknowledged), and what it tried to write is not in the log a
third owner recovers. Broken on purpose (the expected-sequence check dropped), the
old owner's late append would land and this test fails."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

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
) -> AsyncIterator[Callable[[int], Engine]]:
    """Engines owning one shard, each with its own data directory and epoch."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    shard = f"fence{next(_names)}-{abs(hash(str(tmp_path))) % 10**8}"
    checkpoints = CheckpointStore(js, replicas=1)
    await ShardStream(js, shard, replicas=1).ensure()

    def owner(epoch: int) -> Engine:
        stream = ShardStream(js, shard, replicas=1)  # each owner its own view

        async def claim() -> Claim:
            return Claim(stream=stream, checkpoints=checkpoints, epoch=epoch)

        def make_log(directory: Path) -> CommitLog:
            return ReplicatedLog(
                directory, claim=claim, segment_bytes=1 << 20, flush_interval_ms=50
            )

        config = EngineConfig(data_dir=tmp_path / f"owner{epoch}", durability=Durability.SYNC)
        return Engine(config, log=make_log)

    yield owner
    await ShardStream(js, shard, replicas=1).delete()
    await nc.close()


def _append(body: bytes) -> list[AppendRequest]:
    return [AppendRequest(entry=Message(body=body), queues=(QueueRef(NS, "t", 0),))]


async def _bodies(engine: Engine) -> list[bytes]:
    result = await engine.read(QueueRef(NS, "t", 0), 0, max_messages=100)
    return [m.message.body for m in result.messages]


async def test_a_deposed_owner_cannot_append_after_its_successor_sealed_the_stream(
    owners: Callable[[int], Engine],
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
