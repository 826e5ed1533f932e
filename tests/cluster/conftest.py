"""The separated form as real processes (``polymq nameserver``, ``navigation``,
``storage``, ``gateway``), on free ports, for the tests that kill and restart its
parts, with short heartbeats and expiries (:mod:`tests.cluster.fast_failure`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polymq.gateway.cluster_tool import LocalCluster, layout
from tests.cluster.fast_failure import cluster_env


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
