"""A storage node down: its topics, receipts and homes answer StorageUnavailable
(naming it), every other node keeps serving, and all is back when it returns."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from polymq.storage.cluster import ClusterStorage
from polymq.storage.errors import StorageUnavailable
from polymq.storage.model import AppendRequest, Message, QueueRef
from polymq.storage.routes import RouteTable
from tests.storage.test_cluster_harness import (  # noqa: F401
    EngineNode,
    Pool,
    cluster_fixture,
    eventually,
    pool_fixture,
)

NS = "default"


async def _spread(pool: Pool, cluster: ClusterStorage) -> dict[str, QueueRef]:
    """A topic per node; node id -> its topic's queue, each with one message."""
    queues: dict[str, QueueRef] = {}
    for name in ("a", "b", "c"):
        await cluster.create_topic(NS, name)
        queue = QueueRef(NS, name)
        await cluster.append([AppendRequest(entry=Message(body=name.encode()), queues=(queue,))])
        queues[pool.node_of(cluster, NS, name).node_id] = queue
    assert sorted(queues) == ["n1", "n2", "n3"]
    return queues


async def _bodies(cluster: ClusterStorage, queue: QueueRef) -> list[bytes]:
    return [m.message.body for m in (await cluster.read(queue, 0)).messages]


@pytest.mark.parametrize("routes_noticed", [False, True])
async def test_a_down_nodes_topics_are_unavailable_and_others_keep_working(
    pool: Pool, cluster: ClusterStorage, routes_noticed: bool
) -> None:
    queues = await _spread(pool, cluster)
    pool.by_id["n2"].down = True
    if routes_noticed:
        await cluster.refresh()
        node = cluster.routes.nodes["n2"]
        assert not node.alive
        assert cluster.routes.node(NS, queues["n2"].topic) is node  # still routed there
    down = queues["n2"]
    for call in (
        cluster.read(down, 0),
        cluster.queue_offsets(down),
        cluster.describe_topic(NS, down.topic),
        cluster.pop(NS, "g", [down]),
        cluster.commit_offset(NS, "g", down, 0),
        cluster.append([AppendRequest(entry=Message(), queues=(down,))]),
    ):
        with pytest.raises(StorageUnavailable, match="n2"):
            await call
    for node_id in ("n1", "n3"):
        await cluster.append(
            [AppendRequest(entry=Message(body=b"more"), queues=(queues[node_id],))]
        )
        assert (await _bodies(cluster, queues[node_id]))[-1] == b"more"
    assert {t.name for t in await cluster.list_topics(NS)} == {
        queues["n1"].topic,
        queues["n3"].topic,
    }
    # Back: the routes list it again and everything it held is there.
    pool.by_id["n2"].down = False
    await cluster.refresh()
    assert cluster.routes.nodes["n2"].alive
    assert await _bodies(cluster, down) == [down.topic.encode()]
    assert len(await cluster.list_topics(NS)) == 3


async def test_pops_and_acks_with_a_node_down(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _spread(pool, cluster)
    all_queues = list(queues.values())
    popped = await cluster.pop(NS, "g", all_queues, max_messages=3)
    receipts = {cast(str, m.receipt).split(":")[0]: cast(str, m.receipt) for m in popped}
    assert sorted(receipts) == ["n1", "n2", "n3"]
    pool.by_id["n3"].down = True
    outcomes = await cluster.ack_many(NS, "g", [receipts["n1"], receipts["n3"], receipts["n2"]])
    assert outcomes == [None, "storage_unavailable", None]
    with pytest.raises(StorageUnavailable, match="n3"):
        await cluster.ack(NS, "g", receipts["n3"])
    # A pop over all queues serves from the nodes that are up.
    for node_id in ("n1", "n2"):
        await cluster.append([AppendRequest(entry=Message(body=b"x"), queues=(queues[node_id],))])
    got = await cluster.pop(NS, "g", all_queues, max_messages=5)
    assert sorted(m.queue.topic for m in got) == sorted([queues["n1"].topic, queues["n2"].topic])
    await cluster.refresh()  # n3 leaves the routes: receipts fail at once, naming it
    with pytest.raises(StorageUnavailable, match="n3"):
        await cluster.nack(NS, "g", receipts["n3"])
    assert await cluster.pop(NS, "g", all_queues, max_messages=5, wait_ms=50) == []
    with pytest.raises(StorageUnavailable, match="n3"):
        await cluster.pop(NS, "g", [queues["n3"]], wait_ms=50)
    pool.by_id["n3"].down = False
    await cluster.refresh()
    await cluster.ack(NS, "g", receipts["n3"])


async def test_every_node_down_fails_a_spread_pop(pool: Pool, cluster: ClusterStorage) -> None:
    queues = await _spread(pool, cluster)
    for node in pool.nodes:
        node.down = True
    with pytest.raises(StorageUnavailable):
        await cluster.pop(NS, "g", list(queues.values()), wait_ms=100)
    with pytest.raises(StorageUnavailable):
        await cluster.list_topics(NS)


async def test_a_spread_append_over_a_down_node_stores_nothing(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _spread(pool, cluster)
    pool.by_id["n1"].down = True
    await cluster.refresh()
    request = AppendRequest(entry=Message(body=b"all"), queues=tuple(queues.values()))
    with pytest.raises(StorageUnavailable, match="n1"):
        await cluster.append([request])
    for node_id in ("n2", "n3"):
        assert (await cluster.queue_offsets(queues[node_id])).latest == 1


async def test_the_home_node_down_makes_namespace_data_unavailable(
    pool: Pool, cluster: ClusterStorage
) -> None:
    await cluster.meta_put(NS, "exchange", "x", 1)
    home = pool.by_id[cluster.routes.homes[NS].node_id]
    home.down = True
    with pytest.raises(StorageUnavailable, match=home.node_id):
        await cluster.meta_get(NS, "exchange", "x")
    await cluster.refresh()
    # Still its home (no new home claimed elsewhere, which would split the data).
    assert cluster.routes.homes[NS].node_id == home.node_id
    with pytest.raises(StorageUnavailable, match=home.node_id):
        await cluster.meta_put(NS, "exchange", "y", 2)
    home.down = False
    await cluster.refresh()
    assert await cluster.meta_get(NS, "exchange", "x") == 1


class _Unreachable:
    """A route source whose nameservers are all down."""

    async def routes(self, since_version: int) -> RouteTable | None:
        raise StorageUnavailable("no nameserver answered")

    async def place_topic(self, namespace: str, topic: str) -> str:
        raise StorageUnavailable("no nameserver answered")

    async def place_home(self, namespace: str) -> str:
        raise StorageUnavailable("no nameserver answered")


async def test_start_without_any_node_serves_once_one_comes(
    pool: Pool, cluster: ClusterStorage
) -> None:
    """No node at the start is not fatal (a gateway serves what it can): calls answer
    "unavailable" (never "not found") until the refresher sees a node."""
    unreachable = ClusterStorage(_Unreachable(), pool.connect, start_timeout_s=0.2)
    await unreachable.start()
    with pytest.raises(StorageUnavailable):
        await unreachable.create_namespace("later")
    await unreachable.close()
    await cluster.create_topic(NS, "kept")  # before the pool goes down
    for node in pool.nodes:
        node.down = True
    starting = pool.cluster(start_timeout_s=0.2, refresh_ms=50)
    await starting.start()
    try:
        for call in (
            starting.create_namespace("later"),
            starting.list_topics(NS),
            starting.queue_offsets(QueueRef(NS, "kept")),
        ):
            with pytest.raises(StorageUnavailable, match="no live storage node"):
                await call
        for node in pool.nodes:
            node.down = False
        await eventually(lambda: starting.routes.has_live_node())
        assert (await starting.queue_offsets(QueueRef(NS, "kept"))).latest == 0
    finally:
        await starting.close()


async def test_cached_routes_keep_serving_while_nameservers_are_down(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _spread(pool, cluster)
    source = pool.source
    real_routes = source.routes
    calls = 0

    async def failing(since_version: int) -> RouteTable | None:
        nonlocal calls
        calls += 1
        raise StorageUnavailable("no nameserver answered")

    source.routes = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(StorageUnavailable):
            await cluster.refresh()
        for queue in queues.values():
            assert await _bodies(cluster, queue) == [queue.topic.encode()]
        assert calls >= 1
    finally:
        source.routes = real_routes  # type: ignore[method-assign]


async def test_background_refresh_notices_a_node_leaving(pool: Pool) -> None:
    cluster = pool.cluster(refresh_ms=20)
    await cluster.start()
    try:
        node: EngineNode = pool.by_id["n1"]
        node.down = True
        await eventually(lambda: not cluster.routes.nodes["n1"].alive)
        node.down = False
        await eventually(lambda: cluster.routes.nodes["n1"].alive)
    finally:
        await cluster.close()


async def test_not_found_becomes_unavailable_while_a_node_that_may_hold_it_is_down(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _spread(pool, cluster)
    half = await cluster.append_half(
        AppendRequest(entry=Message(body=b"tx"), queues=(queues["n2"],))
    )
    delayed = Message(body=b"later", delivery_time_ms=2**42)
    [held] = await cluster.append([AppendRequest(entry=delayed, queues=(queues["n2"],))])
    pool.by_id["n2"].down = True
    await cluster.refresh()
    with pytest.raises(StorageUnavailable, match="n2"):
        await cluster.end_transaction(NS, half.transaction_id, commit=True)
    with pytest.raises(StorageUnavailable, match="n2"):
        await cluster.cancel_delayed(NS, held.message_id)
    pool.by_id["n2"].down = False
    await cluster.refresh()
    assert await cluster.cancel_delayed(NS, held.message_id)
    result = await cluster.end_transaction(NS, half.transaction_id, commit=True)
    assert result is not None and [p.queue for p in result.placements] == [queues["n2"]]


async def test_a_client_started_while_a_node_is_down_finds_its_topics_unavailable(
    pool: Pool, cluster: ClusterStorage
) -> None:
    """A gateway started since the node died never routed to its topics: they are
    "unavailable, retry" there too, never "no such topic" (a wrong answer while a shard
    of the replicated pool is between owners, and an invitation to create it again)."""
    queues = await _spread(pool, cluster)
    down = queues["n2"]
    await cluster.refresh()  # n2 heartbeats with its topic
    pool.by_id["n2"].down = True
    await cluster.refresh()
    fresh = pool.cluster()
    await fresh.start()
    try:
        for call in (
            fresh.describe_topic(NS, down.topic),
            fresh.read(down, 0),
            fresh.pop(NS, "g", [down]),
        ):
            with pytest.raises(StorageUnavailable, match="n2"):
                await call
        assert await _bodies(fresh, queues["n1"]) == [queues["n1"].topic.encode()]
        pool.by_id["n2"].down = False
        await fresh.refresh()
        assert await _bodies(fresh, down) == [down.topic.encode()]
    finally:
        await fresh.close()


async def test_concurrent_misses_share_one_route_fetch(pool: Pool, cluster: ClusterStorage) -> None:
    other = pool.cluster(refresh_ms=60_000)
    await other.start()
    try:
        await cluster.create_topic(NS, "shared")
        queue = QueueRef(NS, "shared")
        fetches = pool.source.fetches
        reads = [other.read(queue, 0) for _ in range(20)]
        results = await asyncio.gather(*reads)
        assert all(r.next_offset == 0 for r in results)
        assert pool.source.fetches - fetches <= 2
    finally:
        await other.close()


async def test_namespace_wide_changes_wait_for_a_down_node_holding_its_topics(
    pool: Pool, cluster: ClusterStorage
) -> None:
    queues = await _spread(pool, cluster)
    for queue in queues.values():
        await cluster.commit_offset(NS, "readers", queue, 1)
    pool.by_id["n2"].down = True
    await cluster.refresh()
    with pytest.raises(StorageUnavailable, match="n2"):
        await cluster.delete_group_offsets(NS, "readers")
    with pytest.raises(StorageUnavailable, match="n2"):
        await cluster.delete_namespace(NS)
    assert len(await cluster.list_group_offsets(NS, "readers")) == 2  # what is reachable
    pool.by_id["n2"].down = False
    await cluster.refresh()
    await cluster.delete_group_offsets(NS, "readers")
    assert await cluster.list_group_offsets(NS, "readers") == {}
