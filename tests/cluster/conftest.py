"""The separated form as real processes (``polymq nameserver``, ``navigation``,
``storage``, ``gateway``), on free ports, for the tests that kill and restart its
parts. Heartbeats and expiries are short so a death is noticed within seconds."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.cluster_tool import LocalCluster, layout
from gateway.config import ENV_PREFIX

# Fast failure detection: beats every 200 ms, a silent gateway or node dropped after 2 s.
_SETTINGS = {
    "CLUSTER__HEARTBEAT_MS": "200",
    "NAVIGATION__GATEWAY_EXPIRY_MS": "2000",
    "NAMESERVER__NODE_EXPIRY_MS": "2000",
}


def cluster_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + k: v for k, v in _SETTINGS.items()})
    return env


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    """Two storage nodes and two gateways; stopped (all of them) after the test."""
    specs = layout(storage=2, gateways=2, data_dir=tmp_path, port_offset=None)
    local = LocalCluster(specs, env=cluster_env())
    try:
        await local.start()
        yield local
    finally:
        await local.stop()
