"""The engine's behaviour tests (tests/storage/test_engine.py), run again with the
commit log kept in a JetStream stream (STYLE.md: contract tests written once, run over
each backend). Every reopen of an engine (``make_engine`` called again) is a takeover
by a new owner: a fresh data directory rebuilt from the replicated checkpoint and the
stream, as after losing the machine, so the restart tests check exactly that."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from polymq.storage.clock import ManualClock
from polymq.storage.engine import Engine, EngineConfig
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.replicated.checkpoints import CheckpointStore
from polymq.storage.replicated.log import Claim, ReplicatedLog
from polymq.storage.replicated.stream import ShardStream
from tests.replicated.nats_server import running_nats_server
from tests.storage import test_engine as contract

ONE_FORM = True
_epochs = itertools.count(1)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_nats_server(tmp_path_factory.mktemp("nats")) as url:
        yield url


@pytest.fixture
async def make_engine(
    engine_config: EngineConfig, clock: ManualClock, nats_url: str, tmp_path: Path
) -> AsyncIterator[Callable[..., Engine]]:
    """Engines whose log is the stream of a shard named after the test's data dir; small
    chunks, so batches span several stream messages."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    shards: dict[Path, ShardStream] = {}

    def build(**overrides: Any) -> Engine:
        use_clock = overrides.pop("clock", clock)
        fields = {n: getattr(engine_config, n) for n in engine_config.__dataclass_fields__}
        config = EngineConfig(**{**fields, **overrides})
        key = Path(config.data_dir)
        if key not in shards:
            name = f"t{next(_epochs)}-{abs(hash(str(tmp_path))) % 10**8}"
            shards[key] = ShardStream(js, name, replicas=1, chunk_bytes=4096)
        stream = shards[key]
        checkpoints = CheckpointStore(js, replicas=1)
        epoch = next(_epochs)

        async def claim() -> Claim:
            return Claim(stream=stream, checkpoints=checkpoints, epoch=epoch)

        def make_log(directory: Path) -> CommitLog:
            return ReplicatedLog(
                directory,
                claim=claim,
                segment_bytes=config.segment_bytes,
                flush_interval_ms=config.flush_interval_ms,
            )

        return _EnsuringEngine(config, clock=use_clock, log=make_log, stream=stream)

    yield build
    for stream in shards.values():
        with contextlib.suppress(Exception):
            await stream.delete()
    await nc.close()


class _EnsuringEngine(Engine):
    """Creates its stream on start (the factory above is synchronous)."""

    def __init__(self, config: EngineConfig, *, stream: ShardStream, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._stream = stream

    async def start(self) -> None:
        await self._stream.ensure()
        await super().start()


@pytest.fixture
async def storage(make_engine: Callable[..., Engine]) -> AsyncIterator[Engine]:
    async with make_engine() as engine:
        yield engine


# Tests of the local files themselves: a crash played by copying the data directory
# (the replicated log's crash tests kill real processes: tests/replicated/), or the
# disk's fsync held (the replicated log waits for JetStream, not for the disk).
LOCAL_FILES_ONLY = {
    "test_internal_flag_survives_replay_and_checkpoint",
    "test_topics_stored_before_the_internal_flag_read_as_public",
    "test_hand_outs_lost_by_a_crash_never_share_a_receipt_with_later_ones",
    "test_dedup_keys_come_back_from_the_log_after_a_crash",
    "test_pop_without_durable_returns_once_its_hand_out_is_written",
    "test_a_pop_cancelled_while_waiting_for_durability_gives_its_messages_back",
    "test_a_pop_cancelled_while_a_checkpoint_holds_writers_gives_back_after_it",
}

for _name, _test in list(vars(contract).items()):
    if _name.startswith("test_") and _name not in LOCAL_FILES_ONLY:
        globals()[_name] = _test
