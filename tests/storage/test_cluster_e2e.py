"""ClusterStorage end to end over real sockets: a nameserver, two storage nodes
heartbeating it, RemoteStorage clients; a node killed and restarted on its data."""

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
from polymq.storage.errors import StorageUnavailable, TopicNotFound
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from polymq.storage.routes import NodeStatus
from tests.storage.test_cluster_harness import eventually

NS = "default"


def _node(tmp_path: Path, node_id: str, nameserver: str, port: int = 0) -> StorageNode:
    engine = Engine(EngineConfig(data_dir=tmp_path / node_id, durability=Durability.ASYNC))
    return StorageNode(engine, node_id, port=port, nameservers=[nameserver], heartbeat_ms=100)


def _connect(status: NodeStatus) -> NodeClient:
    return cast(NodeClient, RemoteStorage(status.host, status.port))


def _holder(cluster: ClusterStorage, topic: str) -> str:
    node = cluster.routes.node(NS, topic)
    assert node is not None
    return node.node_id


@contextlib.asynccontextmanager
async def _running(node: StorageNode) -> AsyncIterator[StorageNode]:
    await node.start()
    try:
        yield node
    finally:
        await node.close()


async def test_a_pool_over_real_sockets(tmp_path: Path) -> None:
    async with Nameserver(node_expiry_ms=1000) as nameserver:
        address = "{}:{}".format(*nameserver.address)
        source = NameserverClient([address])
        nodes = {i: _node(tmp_path, i, address) for i in ("n1", "n2")}
        async with contextlib.AsyncExitStack() as stack:
            for node in nodes.values():
                await stack.enter_async_context(_running(node))
            cluster = ClusterStorage(source, _connect, refresh_ms=50)
            await cluster.start()
            stack.push_async_callback(source.close)
            stack.push_async_callback(cluster.close)
            await eventually(lambda: len(cluster.routes.live_nodes()) == 2)

            for name in ("a", "b"):
                await cluster.create_topic(NS, name)
            holders = {n: _holder(cluster, n) for n in "ab"}
            assert sorted(holders.values()) == ["n1", "n2"]
            a, b = QueueRef(NS, "a"), QueueRef(NS, "b")
            [result] = await cluster.append(
                [AppendRequest(entry=Message(body=b"both"), queues=(a, b))]
            )
            assert [p.queue for p in result.placements] == [a, b]
            popped = await cluster.pop(NS, "g", [a, b], max_messages=2)
            assert sorted(cast(str, m.receipt)[:3] for m in popped) == ["n1:", "n2:"]
            assert await cluster.ack_many(NS, "g", [cast(str, m.receipt) for m in popped]) == [
                None,
                None,
            ]
            await cluster.meta_put(NS, "exchange", "x", {"durable": True})
            assert await cluster.meta_get(NS, "exchange", "x") == {"durable": True}

            # Kill b's node: b answers "unavailable, retry"; a keeps working.
            victim_id = holders["b"]
            victim = nodes[victim_id]
            port = victim.address[1]
            await victim.close()
            with pytest.raises(StorageUnavailable, match=victim_id):
                await cluster.read(b, 0)
            await cluster.append([AppendRequest(entry=Message(body=b"a2"), queues=(a,))])
            assert len((await cluster.read(a, 0)).messages) == 2
            # The nameserver notices, and so do the routes: b is still b's node's.
            await eventually(lambda: not cluster.routes.nodes[victim_id].alive)
            with pytest.raises(StorageUnavailable, match=victim_id):
                await cluster.read(b, 0)

            # Restarted on its data: all there, traffic resumes.
            revived = _node(tmp_path, victim_id, address, port=port)
            await stack.enter_async_context(_running(revived))
            await eventually(lambda: cluster.routes.nodes[victim_id].alive)
            assert [m.message.body for m in (await cluster.read(b, 0)).messages] == [b"both"]
            await cluster.append([AppendRequest(entry=Message(body=b"b2"), queues=(b,))])
            assert (await cluster.queue_offsets(b)).latest == 2


async def test_two_gateways_share_the_pool(tmp_path: Path) -> None:
    async with Nameserver(node_expiry_ms=1000) as nameserver:
        address = "{}:{}".format(*nameserver.address)
        async with contextlib.AsyncExitStack() as stack:
            for node_id in ("n1", "n2"):
                await stack.enter_async_context(_running(_node(tmp_path, node_id, address)))
            one = ClusterStorage(NameserverClient([address]), _connect, refresh_ms=60_000)
            two = ClusterStorage(NameserverClient([address]), _connect, refresh_ms=60_000)
            for gateway in (one, two):
                await gateway.start()
                stack.push_async_callback(gateway.close)
            await one.create_topic(NS, "shared")
            queue = QueueRef(NS, "shared")

            async def found_by_two() -> bool:
                # The node announces the topic at once; until the nameserver has it,
                # the other gateway answers "no such topic".
                try:
                    await two.append([AppendRequest(entry=Message(body=b"x"), queues=(queue,))])
                except TopicNotFound:
                    return False
                return True

            deadline = asyncio.get_running_loop().time() + 10
            while not await found_by_two():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            [popped] = await one.pop(NS, "g", [queue])
            await two.ack(NS, "g", cast(str, popped.receipt))  # a receipt works anywhere
            await two.meta_put(NS, "k", "n", 1)
            assert await one.meta_get(NS, "k", "n") == 1
