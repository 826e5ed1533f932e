"""The engine's behaviour tests (tests/storage/test_engine.py), run again through a
RemoteStorage talking to a StorageNode over loopback: the network form must not
change a single answer (STYLE.md: contract tests written once, run over each backend).

Tests that reach into the engine (its checkpoints, its internal state) or reopen it
stay with the engine's own suite."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

import pytest

from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from tests.storage import test_engine as contract
from tests.storage.conftest import EngineFactory

ENGINE_ONLY = {
    # these call engine-only methods (checkpoint, enforce_retention) or read its state
    "test_hand_outs_lost_by_a_crash_never_share_a_receipt_with_later_ones",
    "test_a_pop_cancelled_while_waiting_for_durability_gives_its_messages_back",
    "test_a_pop_cancelled_while_a_checkpoint_holds_writers_gives_back_after_it",
    "test_topic_retention_by_time",
    # these advance the manual clock one loop tick after starting a long poll, which
    # in-process is enough for the poll to have begun; over a socket it is not (the
    # remote versions, which wait for the node to hold the poll, are in
    # test_remote_storage.py)
    "test_long_poll_times_out_empty",
}


@pytest.fixture
async def storage(make_engine: EngineFactory) -> AsyncIterator[RemoteStorage]:
    node = StorageNode(make_engine(), "node-a")
    await node.start()
    remote = RemoteStorage(*node.address)
    try:
        yield remote
    finally:
        await remote.close()
        await node.close()


for _name, _test in list(vars(contract).items()):
    if (
        _name.startswith("test_")
        and _name not in ENGINE_ONLY
        and "make_engine" not in inspect.signature(_test).parameters
    ):
        globals()[_name] = _test
