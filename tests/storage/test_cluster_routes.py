"""The route cache: refreshed on a miss and in the background, shared knowledge
between gateways over the same nodes, and the rules for folding tables in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest

from polymq.storage.cluster import ClusterStorage
from polymq.storage.cluster_routes import LOCAL_GRACE_MS, NodeClient, RouteCache
from polymq.storage.errors import TopicNotFound
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.routes import NodeStatus, RouteTable
from tests.storage.test_cluster_harness import Pool, eventually, pool_fixture  # noqa: F401

NS = "default"


@pytest.fixture
async def gateways(pool: Pool) -> AsyncIterator[tuple[ClusterStorage, ClusterStorage]]:
    one, two = pool.cluster(refresh_ms=60_000), pool.cluster(refresh_ms=60_000)
    await one.start()
    await two.start()
    yield one, two
    await one.close()
    await two.close()


async def test_a_topic_created_through_one_gateway_is_found_by_another(
    pool: Pool, gateways: tuple[ClusterStorage, ClusterStorage]
) -> None:
    one, two = gateways
    await one.create_topic(
        NS,
        "orders",
    )
    queue = QueueRef(NS, "orders")
    assert two.routes.node(NS, "orders") is None
    fetches = pool.source.fetches
    await two.append([AppendRequest(entry=Message(body=b"via two"), queues=(queue,))])
    assert pool.source.fetches == fetches + 1  # the miss fetched routes once
    read = await one.read(queue, 0)
    assert [m.message.body for m in read.messages] == [b"via two"]
    # A hit costs no fetch.
    await two.read(queue, 0)
    assert pool.source.fetches == fetches + 1


async def test_a_topic_that_does_not_exist_stays_not_found(
    gateways: tuple[ClusterStorage, ClusterStorage],
) -> None:
    one, _ = gateways
    with pytest.raises(TopicNotFound):
        await one.read(QueueRef(NS, "missing"), 0)
    with pytest.raises(TopicNotFound):
        await one.append([AppendRequest(entry=Message(), queues=(QueueRef(NS, "missing"),))])


async def test_background_refresh_learns_new_topics(pool: Pool) -> None:
    one = pool.cluster()
    two = pool.cluster(refresh_ms=20)
    await one.start()
    await two.start()
    try:
        await one.create_topic(NS, "fresh")
        await eventually(lambda: two.routes.node(NS, "fresh") is not None)
    finally:
        await one.close()
        await two.close()


async def test_a_topic_recreated_on_another_node_is_followed(
    pool: Pool, gateways: tuple[ClusterStorage, ClusterStorage]
) -> None:
    one, two = gateways
    await one.create_topic(NS, "moving")
    queue = QueueRef(NS, "moving")
    await two.read(queue, 0)  # two caches the route
    before = pool.node_of(two, NS, "moving")
    await one.delete_topic(NS, "moving")
    elsewhere = next(n for n in pool.nodes if n is not before)
    await elsewhere.engine.create_topic(NS, "moving")
    await elsewhere.engine.append([AppendRequest(entry=Message(body=b"here"), queues=(queue,))])
    assert pool.node_of(two, NS, "moving") is before  # stale
    read = await two.read(queue, 0)
    assert [m.message.body for m in read.messages] == [b"here"]
    assert pool.node_of(two, NS, "moving") is elsewhere


def _status(node_id: str, port: int = 1) -> NodeStatus:
    return NodeStatus(node_id=node_id, host="127.0.0.1", port=port)


class _Client:
    def __init__(self, status: NodeStatus) -> None:
        self.status = status


def _cache() -> RouteCache:
    return RouteCache(lambda status: cast(NodeClient, _Client(status)))


def test_a_node_leaving_the_routes_keeps_its_topics_and_homes() -> None:
    cache = _cache()
    cache.apply(
        RouteTable(
            version=1,
            nodes=(_status("n1"), _status("n2")),
            topics={(NS, "a"): "n1", (NS, "b"): "n2"},
            homes={NS: "n2"},
        ),
        0,
    )
    n1, n2 = cache.nodes["n1"], cache.nodes["n2"]
    assert (cache.node(NS, "a"), cache.node(NS, "b"), cache.homes[NS]) == (n1, n2, n2)
    cache.apply(RouteTable(version=2, nodes=(_status("n1"),), topics={(NS, "a"): "n1"}), 0)
    assert not n2.alive and n1.alive
    assert cache.node(NS, "b") is n2 and cache.homes[NS] is n2
    # Deleted while listed: gone.
    cache.apply(RouteTable(version=3, nodes=(_status("n1"),)), 0)
    assert cache.node(NS, "a") is None and cache.node(NS, "b") is n2
    # Back at another address: the same node, a new client.
    old_client = n2.client
    replaced = cache.apply(
        RouteTable(version=4, nodes=(_status("n1"), _status("n2", 2)), topics={(NS, "b"): "n2"}),
        0,
    )
    assert replaced == [old_client]
    assert n2.alive and n2.client is not old_client and cache.node(NS, "b") is n2
    assert cache.version == 4


def test_a_topic_created_here_stays_routed_until_a_table_names_it() -> None:
    cache = _cache()
    table = RouteTable(version=1, nodes=(_status("n1"),))
    cache.apply(table, 0)
    n1 = cache.nodes["n1"]
    cache.add_topic(NS, "new", n1, 0)
    cache.add_home("tenant", n1, 0)
    cache.apply(RouteTable(version=2, nodes=(_status("n1"),)), 10)
    assert cache.node(NS, "new") is n1 and cache.homes["tenant"] is n1
    cache.apply(
        RouteTable(
            version=3, nodes=(_status("n1"),), topics={(NS, "new"): "n1"}, homes={"tenant": "n1"}
        ),
        20,
    )
    cache.remove_topic(NS, "new")
    assert cache.node(NS, "new") is None
    cache.add_topic(NS, "late", n1, 0)
    cache.apply(RouteTable(version=4, nodes=(_status("n1"),)), LOCAL_GRACE_MS + 1)
    assert cache.node(NS, "late") is None  # never reported: given up after the grace
