"""The engine's behaviour tests (tests/storage/test_engine.py), run again over the
``memory://`` engine: the storage the gateway tests stand on must answer exactly as
the engine on disk does (STYLE.md: contract tests written once, run over each
backend).

Tests that build or reopen engines over a data directory of their own
(``make_engine``) stay with the engine's suite: a memory engine has no directory to
reopen. So do those that hold the disk's fsync to catch a call waiting for it: with
nothing to outlive the process, the memory engine never waits for one."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

import pytest

from polymq.storage.clock import ManualClock
from polymq.storage.engine import Durability, EngineConfig
from polymq.storage.memory import MemoryEngine
from tests.storage import test_engine as contract


@pytest.fixture
async def storage(engine_config: EngineConfig, clock: ManualClock) -> AsyncIterator[MemoryEngine]:
    engine = MemoryEngine(engine_config, clock=clock)
    assert engine.config.durability is Durability.ASYNC
    assert engine.config.data_dir == engine.scratch != engine_config.data_dir
    async with engine:
        yield engine
    assert not engine.scratch.exists()


WAITS_FOR_FSYNC = {
    "test_a_pop_cancelled_while_a_checkpoint_holds_writers_gives_back_after_it",
    "test_a_pop_cancelled_while_waiting_for_durability_gives_its_messages_back",
}

for _name, _test in list(vars(contract).items()):
    if (
        _name.startswith("test_")
        and _name not in WAITS_FOR_FSYNC
        and "make_engine" not in inspect.signature(_test).parameters
    ):
        globals()[_name] = _test
