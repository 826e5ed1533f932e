"""A shard of the replicated pool served again at a new address (taken over by another
process, or re-served after its log failed) while a gateway still routes to the old
one: a call the old address refuses was never sent, so the gateway sends it to the new
address once the routes show it, and the client sees a wait instead of an error.

Over real sockets: a nameserver, a storage node that says it serves shard ``shard-1``
for an owner (as ``ShardHost`` starts them), and the gateway's ``ClusterStorage``, whose
background refresh is too slow to hide anything. A bench run on a loaded CI machine
failed Kafka CreateTopics with "shard shard-3 (…): cannot reach …: Connection refused"
this way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from polymq.nameserver.client import NameserverClient
from polymq.nameserver.server import Nameserver
from polymq.storage.cluster import ClusterStorage
from polymq.storage.cluster_routes import NodeClient
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.errors import StorageUnavailable
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from polymq.storage.routes import NodeStatus
from tests.storage.test_cluster_harness import eventually

ONE_FORM = True
NS = "default"
SHARD = "shard-1"
QUEUE = QueueRef(NS, "orders")


def _shard(data: Path, nameserver: str, epoch: int, owner: str) -> StorageNode:
    engine = Engine(EngineConfig(data_dir=data, durability=Durability.ASYNC))
    return StorageNode(
        engine, SHARD, nameservers=[nameserver], heartbeat_ms=100, epoch=epoch, owner=owner
    )


def _connect(status: NodeStatus) -> NodeClient:
    return cast(NodeClient, RemoteStorage(status.host, status.port))


@contextlib.asynccontextmanager
async def _gateway(nameserver: str) -> AsyncIterator[ClusterStorage]:
    source = NameserverClient([nameserver])
    # An hour between background refreshes: only the gateway's own fetch on a refused
    # call can find the new address.
    cluster = ClusterStorage(source, _connect, refresh_ms=3_600_000)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()
        await source.close()


async def _wait_listed_at(source: NameserverClient, port: int, timeout_s: float = 10.0) -> None:
    """Until the nameserver lists the shard alive at ``port``."""
    async with asyncio.timeout(timeout_s):
        while True:
            table = await source.routes(0)
            assert table is not None
            if any(s.node_id == SHARD and s.alive and s.port == port for s in table.nodes):
                return
            await asyncio.sleep(0.02)


async def _bodies(cluster: ClusterStorage) -> list[bytes]:
    return [m.message.body for m in (await cluster.read(QUEUE, 0)).messages]


async def _append(cluster: ClusterStorage, body: bytes) -> None:
    await cluster.append([AppendRequest(entry=Message(body=body), queues=(QUEUE,))])


@pytest.mark.parametrize("new_owner_listed", [True, False], ids=["listed", "listed-later"])
async def test_a_call_refused_by_a_moved_shard_goes_to_its_new_address(
    tmp_path: Path, new_owner_listed: bool
) -> None:
    async with Nameserver(node_expiry_ms=10_000) as nameserver:
        address = "{}:{}".format(*nameserver.address)
        first = _shard(tmp_path / "a", address, epoch=1, owner="host-a")
        await first.start()
        async with _gateway(address) as cluster:
            await eventually(lambda: len(cluster.routes.live_nodes()) == 1)
            await cluster.create_topic(NS, QUEUE.topic)
            await _append(cluster, b"before")
            old_port = first.address[1]
            await first.close()  # its port now refuses connections

            # The new owner: same shard, a higher epoch, another port, the same data
            # (the replicated pool rebuilds it from the stream; here, the same disk).
            second = _shard(tmp_path / "a", address, epoch=2, owner="host-b")
            probe = NameserverClient([address])
            try:
                if new_owner_listed:
                    await second.start()
                    assert second.address[1] != old_port
                    port = second.address[1]
                    await _wait_listed_at(probe, port)
                    await _append(cluster, b"after")
                else:
                    # The call starts while the routes still name the old address only.
                    appending = asyncio.create_task(_append(cluster, b"after"))
                    await asyncio.sleep(0.3)
                    assert not appending.done()
                    await second.start()
                    await appending
                assert cluster.routes.nodes[SHARD].status.port == second.address[1]
                assert await _bodies(cluster) == [b"before", b"after"]
            finally:
                await probe.close()
                await second.close()


async def test_a_plain_node_that_refuses_fails_at_once_naming_it(tmp_path: Path) -> None:
    """No owner: a node that is down stays down until restarted, so nothing waits."""
    async with Nameserver(node_expiry_ms=10_000) as nameserver:
        address = "{}:{}".format(*nameserver.address)
        engine = Engine(EngineConfig(data_dir=tmp_path / "n1", durability=Durability.ASYNC))
        node = StorageNode(engine, "n1", nameservers=[address], heartbeat_ms=100)
        await node.start()
        async with _gateway(address) as cluster:
            await eventually(lambda: len(cluster.routes.live_nodes()) == 1)
            await cluster.create_topic(NS, QUEUE.topic)
            await node.close()
            with pytest.raises(StorageUnavailable, match="n1") as raised:
                await _append(cluster, b"lost")
            assert "cannot reach" in str(raised.value)
