"""Fixtures for storage tests: a real engine on a temporary directory.

Contract tests take ``storage`` (a started :class:`StorageAPI`); the Cluster form will
parametrize the same fixture over a remote client (STYLE.md: contract tests are
written once and run over every backend).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from polymq.storage.clock import ManualClock
from polymq.storage.engine import Durability, Engine, EngineConfig

EngineFactory = Callable[..., Engine]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def engine_config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(data_dir=tmp_path / "data", durability=Durability.SYNC)


@pytest.fixture
def make_engine(engine_config: EngineConfig, clock: ManualClock) -> EngineFactory:
    """Build (not start) an engine over the test's data dir; reopen by calling again."""

    def build(**overrides: Any) -> Engine:
        use_clock = overrides.pop("clock", clock)
        config = EngineConfig(**{**_fields(engine_config), **overrides})
        return Engine(config, clock=use_clock)

    return build


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


@pytest.fixture
async def storage(make_engine: EngineFactory) -> AsyncIterator[Engine]:
    async with make_engine() as engine:
        yield engine
