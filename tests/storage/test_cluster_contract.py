"""The engine's behaviour tests (tests/storage/test_engine.py), run again through a
ClusterStorage over two in-process nodes: topics created by a test spread over both,
so every call is routed, multi-topic pops and appends span nodes, and receipts carry
their node's prefix, and not a single answer may change (STYLE.md: contract tests
written once, run over each backend).

Tests that reach into the engine (its checkpoints, its internal state) or reopen it
stay with the engine's own suite."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polymq.storage.clock import ManualClock
from polymq.storage.cluster import ClusterStorage
from tests.storage import test_engine as contract
from tests.storage.conftest import EngineFactory
from tests.storage.test_cluster_harness import EngineNode, Pool, RegistrySource

ENGINE_ONLY = {
    # these call engine-only methods (checkpoint, enforce_retention) or read its state
    "test_hand_outs_lost_by_a_crash_never_share_a_receipt_with_later_ones",
    "test_a_pop_cancelled_while_waiting_for_durability_gives_its_messages_back",
    "test_a_pop_cancelled_while_a_checkpoint_holds_writers_gives_back_after_it",
    "test_topic_retention_by_time",
}
# Where a pool answers differently, as ClusterStorage's docstring states: an append over
# queues of two nodes stores a copy on each, and each node names its copy (the result
# carries the first queue's node's id).
POOL_DIFFERS = {"test_multi_dispatch_indexes_one_body_into_many_queues"}


@pytest.fixture
async def storage(
    make_engine: EngineFactory, tmp_path: Path, clock: ManualClock
) -> AsyncIterator[ClusterStorage]:
    engines = [make_engine(data_dir=tmp_path / f"node{i}") for i in (1, 2)]
    nodes = [EngineNode(f"n{i}", e, 20000 + i) for i, e in enumerate(engines, 1)]
    for engine in engines:
        await engine.start()
    pool = Pool(nodes, RegistrySource(nodes))
    cluster = pool.cluster(clock=clock)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()
        for engine in engines:
            await engine.close()


for _name, _test in list(vars(contract).items()):
    if (
        _name.startswith("test_")
        and _name not in ENGINE_ONLY | POOL_DIFFERS
        and "make_engine" not in inspect.signature(_test).parameters
    ):
        globals()[_name] = _test
