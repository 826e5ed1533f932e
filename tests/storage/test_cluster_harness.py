"""A pool of in-process storage nodes for the cluster client's tests (no tests here).

Each node is a real :class:`Engine` in its own directory behind a client that, like
``storage.remote.RemoteStorage``, adds ``claim_home`` and can be switched down (every
call then raises :class:`StorageUnavailable`, as a refused connection does). Routes
come from a real :class:`nameserver.registry.Registry` fed with heartbeats built from
the engines, sent at every route fetch (as if nodes heartbeated at once after each
change), with time moved past the expiry at each fetch, so a node that is down
leaves the routes at the next fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from polymq.nameserver.registry import Registry
from polymq.storage.cluster import ClusterStorage
from polymq.storage.cluster_routes import NodeClient
from polymq.storage.engine import Durability, Engine, EngineConfig
from polymq.storage.errors import NamespaceAlreadyExists, StorageUnavailable
from polymq.storage.model import QueueRef
from polymq.storage.routes import NodeHeartbeat, NodeStatus, RouteTable

__all__ = [
    "EngineNode",
    "Pool",
    "RegistrySource",
    "cluster_fixture",
    "eventually",
    "pool_fixture",
    "pool_of",
]

_EXPIRY_MS = 1000


class EngineNode:
    """One storage node: an engine, a down switch, and a count of calls per method."""

    def __init__(self, node_id: str, engine: Engine, port: int) -> None:
        self.node_id = node_id
        self.engine = engine
        self.port = port
        self.down = False
        self.calls: Counter[str] = Counter()

    async def claim_home(self, namespace: str) -> None:
        """As ``storage.node.StorageNode.claim_home``: persisted in the namespace."""
        with contextlib.suppress(NamespaceAlreadyExists):
            await self.engine.create_namespace(namespace)
        await self.engine.meta_put(namespace, "_cluster", "home", {"claimed_ms": 1})

    async def heartbeat(self) -> NodeHeartbeat:
        topics: list[tuple[str, str]] = []
        homes: list[str] = []
        for namespace in await self.engine.list_namespaces():
            for info in await self.engine.list_topics(namespace, include_internal=True):
                topics.append((namespace, info.name))
            if await self.engine.meta_get(namespace, "_cluster", "home") is not None:
                homes.append(namespace)
        return NodeHeartbeat(
            node_id=self.node_id,
            host="127.0.0.1",
            port=self.port,
            topics=tuple(topics),
            homes=tuple(homes),
            load=len(topics),
        )

    def client(self) -> NodeClient:
        return cast(NodeClient, _EngineClient(self))


class _EngineClient:
    """What ``connect`` returns for an :class:`EngineNode`: every storage call
    forwarded to its engine unless the node is down. Closing it leaves the node up
    (several cluster clients share the nodes, as gateways do)."""

    def __init__(self, node: EngineNode) -> None:
        self._node = node

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        node = self._node
        target = node.claim_home if name == "claim_home" else getattr(node.engine, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if node.down:
                raise StorageUnavailable(f"cannot connect to 127.0.0.1:{node.port}")
            node.calls[name] += 1
            return await target(*args, **kwargs)

        return call


class RegistrySource:
    """The route source: a real registry, heartbeated by every up node at each fetch."""

    def __init__(self, nodes: list[EngineNode]) -> None:
        self.nodes = nodes
        self.registry = Registry(node_expiry_ms=_EXPIRY_MS, started_ms=1)
        self.now_ms = 1_000
        self.fetches = 0
        self.beating = True

    async def beat(self) -> None:
        self.now_ms += _EXPIRY_MS + 1
        if self.beating:
            for node in self.nodes:
                if not node.down:
                    self.registry.heartbeat(await node.heartbeat(), self.now_ms)
        self.registry.expire(self.now_ms)

    async def routes(self, since_version: int) -> RouteTable | None:
        self.fetches += 1
        await self.beat()
        return self.registry.routes(since_version)

    async def place_topic(self, namespace: str, topic: str) -> str:
        return self.registry.place_topic(namespace, topic, self.now_ms)

    async def place_home(self, namespace: str) -> str:
        return self.registry.place_home(namespace, self.now_ms)


class Pool:
    def __init__(self, nodes: list[EngineNode], source: RegistrySource) -> None:
        self.nodes = nodes
        self.source = source
        self.by_id = {n.node_id: n for n in nodes}

    def connect(self, status: NodeStatus) -> NodeClient:
        return self.by_id[status.node_id].client()

    def cluster(self, **options: Any) -> ClusterStorage:
        return ClusterStorage(self.source, self.connect, **options)

    def node_of(self, cluster: ClusterStorage, namespace: str, topic: str) -> EngineNode:
        node = cluster.routes.node(namespace, topic)
        assert node is not None, f"no route for {namespace}/{topic}"
        return self.by_id[node.node_id]

    def parked(self, cluster: ClusterStorage, queue: QueueRef) -> int:
        """Long polls (reads and pops) asleep in the queue's engine: the one way to
        know a waiting call has reached its node, not just been sent."""
        engine = self.node_of(cluster, queue.namespace, queue.topic).engine
        index = engine._state.topic(queue.namespace, queue.topic).queues[queue.queue_id]
        return len(index.waiters or ())


@contextlib.asynccontextmanager
async def pool_of(tmp_path: Path, count: int) -> AsyncIterator[Pool]:
    """``count`` started engines (node ids n1, n2, ...) and their route source."""
    engines = [
        Engine(EngineConfig(data_dir=tmp_path / f"node{i}", durability=Durability.ASYNC))
        for i in range(1, count + 1)
    ]
    nodes = [EngineNode(f"n{i}", e, 20000 + i) for i, e in enumerate(engines, 1)]
    async with contextlib.AsyncExitStack() as stack:
        for engine in engines:
            await stack.enter_async_context(engine)
        yield Pool(nodes, RegistrySource(nodes))


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` holds (polling), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture(name="pool")
async def pool_fixture(tmp_path: Path) -> AsyncIterator[Pool]:
    """Three nodes (n1, n2, n3)."""
    async with pool_of(tmp_path, 3) as pool:
        yield pool


@pytest.fixture(name="cluster")
async def cluster_fixture(pool: Pool) -> AsyncIterator[ClusterStorage]:
    """A started cluster client over :func:`pool`."""
    cluster = pool.cluster()
    await cluster.start()
    yield cluster
    await cluster.close()
