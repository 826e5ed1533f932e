"""The replicated pool as real processes: three NATS servers, a nameserver, navigation,
storage processes each preferring one shard, and gateways, all on free ports, with
short heartbeats, expiries and leases so a death is noticed within seconds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, layout
from polymq.storage.replicated.local_nats import LocalNats
from tests.cluster.fast_failure import cluster_env

LEASE_MS = 2000


@dataclass
class ReplicatedPool:
    nats: LocalNats
    cluster: LocalCluster
    storage: list[str]  # the storage processes' names in the cluster


def storage_specs(count: int, shards: int, nats: LocalNats, data_dir: Path) -> list[ProcessSpec]:
    servers = ",".join(url.removeprefix("nats://") for url in nats.urls)
    return [
        ProcessSpec(
            f"storage-{i}",
            (
                "storage",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--node-id",
                f"node-{i}",
                "--data-dir",
                str(data_dir / f"node-{i}"),
                "--nameserver",
                "{nameserver}",
                "--nats",
                servers,
                "--replicas",
                "3",
                "--shards",
                str(shards),
                "--prefer",
                f"shard-{i}",
            ),
        )
        for i in range(1, count + 1)
    ]


def replicated_env() -> dict[str, str]:
    env = cluster_env()
    env["POLYMQ_REPLICATION__LEASE_MS"] = str(LEASE_MS)
    return env


@asynccontextmanager
async def running_pool(directory: Path) -> AsyncIterator[ReplicatedPool]:
    """Three NATS servers, three storage processes over three shards, two gateways."""
    async with LocalNats(directory / "nats", 3) as nats:
        specs = layout(storage=0, gateways=2, data_dir=directory, port_offset=None)
        storage = storage_specs(3, 3, nats, directory)
        local = LocalCluster([*specs[:2], *storage, *specs[2:]], env=replicated_env())
        try:
            await local.start()
            yield ReplicatedPool(nats, local, [spec.name for spec in storage])
        finally:
            await local.stop()


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[ReplicatedPool]:
    async with running_pool(tmp_path) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ReplicatedPool]:
    """One pool for a module's tests (each leaves it whole again: ``healed``)."""
    async with running_pool(tmp_path_factory.mktemp("pool")) as started:
        yield started
