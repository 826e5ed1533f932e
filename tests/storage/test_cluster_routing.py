"""ClusterStorage sends every storage call to the node that owns what it names."""

from __future__ import annotations

import pytest

from polymq.storage.api import StorageAPI
from polymq.storage.cluster import ClusterStorage
from polymq.storage.errors import (
    InvalidArgument,
    NamespaceAlreadyExists,
    NamespaceNotFound,
    TopicNotFound,
    TransactionNotFound,
)
from polymq.storage.model import AppendRequest, GroupConfig, Message, QueueRef, TopicConfig
from tests.storage.test_cluster_harness import Pool, cluster_fixture, pool_fixture  # noqa: F401

NS = "default"


async def _topics_on_distinct_nodes(
    pool: Pool, cluster: ClusterStorage, count: int, queues: int = 1
) -> list[str]:
    names = [f"t{i}" for i in range(count)]
    for name in names:
        await cluster.create_topic(NS, name, TopicConfig(queue_count=queues))
    holders = {pool.node_of(cluster, NS, name).node_id for name in names}
    assert len(holders) == min(count, len(pool.nodes)), holders
    return names


async def test_topics_spread_over_nodes_and_live_whole_on_one(
    pool: Pool, cluster: ClusterStorage
) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 6, queues=3)
    for name in names:
        owner = pool.node_of(cluster, NS, name)
        for node in pool.nodes:
            if node is owner:
                info = await node.engine.describe_topic(NS, name)
                assert len(info.queues) == 3
            else:
                with pytest.raises(TopicNotFound):
                    await node.engine.describe_topic(NS, name)
    assert [t.name for t in await cluster.list_topics(NS)] == sorted(names)


async def test_append_and_read_go_to_the_topics_node(pool: Pool, cluster: ClusterStorage) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3)
    for name in names:
        queue = QueueRef(NS, name)
        [result] = await cluster.append(
            [AppendRequest(entry=Message(body=name.encode()), queues=(queue,))]
        )
        assert [p.queue for p in result.placements] == [queue]
        owner = pool.node_of(cluster, NS, name)
        stored = await owner.engine.read(queue, 0)
        assert [m.message.body for m in stored.messages] == [name.encode()]
        read = await cluster.read(queue, 0)
        assert [m.message.body for m in read.messages] == [name.encode()]
        batches = await cluster.read_batches(queue, 0)
        assert batches[0].messages[0].message.body == name.encode()
    for node in pool.nodes:
        # Each node got exactly the one append and reads of its own topic.
        assert node.calls["append"] == 1
        assert node.calls["read"] == 1


async def test_queue_calls_reach_only_the_owner(pool: Pool, cluster: ClusterStorage) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3, queues=2)
    name = names[1]
    owner = pool.node_of(cluster, NS, name)
    queue = QueueRef(NS, name, 1)
    for node in pool.nodes:
        node.calls.clear()
    await cluster.append(
        [AppendRequest(entry=Message(body=str(i).encode()), queues=(queue,)) for i in range(4)]
    )
    assert await cluster.queue_offsets(queue) == (await owner.engine.queue_offsets(queue))
    assert (await cluster.offset_for_timestamp(queue, 0)) == 0
    await cluster.commit_offset(NS, "g", queue, 3, "meta")
    committed = await cluster.fetch_offset(NS, "g", queue)
    assert committed is not None and (committed.offset, committed.metadata) == (3, "meta")
    assert (await cluster.delete_records(queue, 1)).earliest == 1
    assert await cluster.pending_count(NS, "g", queue) == 3
    assert await cluster.inflight_count(NS, "g", queue) == 0
    assert await cluster.consumed_below(NS, "g", queue) == 1
    assert await cluster.delayed_count(NS, queue) == 0
    info = await cluster.alter_topic(NS, name, TopicConfig(queue_count=4))
    assert len(info.queues) == 4
    assert len((await cluster.describe_topic(NS, name)).queues) == 4
    for node in pool.nodes:
        if node is not owner:
            assert sum(node.calls.values()) == 0, (node.node_id, node.calls)
    assert owner.calls["commit_offset"] == 1 and owner.calls["alter_topic"] == 1


async def test_one_append_indexes_queues_on_several_nodes(
    pool: Pool, cluster: ClusterStorage
) -> None:
    a, b, c = await _topics_on_distinct_nodes(pool, cluster, 3, queues=2)
    queues = (QueueRef(NS, b, 1), QueueRef(NS, a, 0), QueueRef(NS, c, 0), QueueRef(NS, b, 0))
    request = AppendRequest(entry=Message(body=b"fan"), queues=queues, dedup_key="once")
    [result] = await cluster.append([request])
    assert [p.queue for p in result.placements] == list(queues)
    assert not result.duplicate
    owner_b = pool.node_of(cluster, NS, b)
    first = (await owner_b.engine.read(queues[0], 0)).messages[0]
    assert result.message_id == first.message_id  # the first queue's node's id
    for queue in queues:
        owner = pool.node_of(cluster, NS, queue.topic)
        assert [m.message.body for m in (await owner.engine.read(queue, 0)).messages] == [b"fan"]
    for node in pool.nodes:
        assert node.calls["append"] == 1  # one call per node, the entry stored once there
    # A retry with the dedup key stores nothing anywhere.
    [again] = await cluster.append([request])
    assert again.duplicate
    assert [p.offset for p in again.placements] == [0, 0, 0, 0]
    for queue in queues:
        assert (await cluster.queue_offsets(queue)).latest == 1


async def test_many_requests_over_several_nodes_in_one_call(
    pool: Pool, cluster: ClusterStorage
) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3)
    requests = [
        AppendRequest(entry=Message(body=f"{n}-{i}".encode()), queues=(QueueRef(NS, n),))
        for i in range(3)
        for n in names
    ]
    results = await cluster.append(requests)
    for request, result in zip(requests, results, strict=True):
        assert [p.queue for p in result.placements] == list(request.queues)
    for name in names:
        read = await cluster.read(QueueRef(NS, name), 0)
        assert [m.message.body for m in read.messages] == [f"{name}-{i}".encode() for i in range(3)]


async def test_namespace_wide_data_lives_on_the_home_node(
    pool: Pool, cluster: ClusterStorage
) -> None:
    await cluster.create_namespace("tenant")
    await cluster.meta_put("tenant", "exchange", "x", {"type": "fanout"})
    await cluster.put_latest("tenant", "retained/a", b"k", Message(body=b"v"))
    home = cluster.routes.homes["tenant"]
    holders = [n for n in pool.nodes if await n.engine.meta_get("tenant", "exchange", "x")]
    assert [n.node_id for n in holders] == [home.node_id]
    assert await cluster.meta_get("tenant", "exchange", "x") == {"type": "fanout"}
    assert await cluster.meta_list("tenant", "exchange") == {"x": {"type": "fanout"}}
    latest = await cluster.get_latest("tenant", "retained/a", b"k")
    assert latest is not None and latest.body == b"v"
    assert [k for k, _ in await cluster.list_latest("tenant", "retained/a")] == [b"k"]
    # Another gateway finds the same home through the routes.
    other = pool.cluster()
    await other.start()
    try:
        assert await other.meta_get("tenant", "exchange", "x") == {"type": "fanout"}
        assert await other.meta_delete("tenant", "exchange", "x")
    finally:
        await other.close()
    assert await cluster.meta_get("tenant", "exchange", "x") is None
    assert not await cluster.meta_delete("tenant", "exchange", "x")


async def test_reads_of_a_namespace_that_does_not_exist_create_nothing(
    pool: Pool, cluster: ClusterStorage
) -> None:
    assert await cluster.meta_get("nowhere", "k", "n") is None
    assert await cluster.meta_list("nowhere", "k") == {}
    assert await cluster.get_latest("nowhere", "t", b"k") is None
    assert await cluster.get_group_config("nowhere", "g") == GroupConfig()
    assert "nowhere" not in await cluster.list_namespaces()
    with pytest.raises(NamespaceNotFound):
        await cluster.meta_put("nowhere", "k", "n", 1)
    with pytest.raises(NamespaceNotFound):
        await cluster.create_topic("nowhere", "t")


async def test_group_config_reaches_every_node(pool: Pool, cluster: ClusterStorage) -> None:
    config = GroupConfig(fifo=True, max_delivery_attempts=3)
    await cluster.set_group_config(NS, "g", config)
    for node in pool.nodes:
        assert await node.engine.get_group_config(NS, "g") == config
    assert await cluster.get_group_config(NS, "g") == config
    assert "g" in await cluster.list_groups(NS)


async def test_namespaces_over_the_pool(pool: Pool, cluster: ClusterStorage) -> None:
    await cluster.create_namespace("tenant")
    for node in pool.nodes:
        assert "tenant" in await node.engine.list_namespaces()
    with pytest.raises(NamespaceAlreadyExists):
        await cluster.create_namespace("tenant")
    assert await cluster.list_namespaces() == ["default", "tenant"]
    await cluster.create_topic("tenant", "t")
    with pytest.raises(InvalidArgument):
        await cluster.delete_namespace("tenant")
    await cluster.delete_topic("tenant", "t")
    await cluster.delete_namespace("tenant")
    assert await cluster.list_namespaces() == ["default"]
    with pytest.raises(NamespaceNotFound):
        await cluster.delete_namespace("tenant")


async def test_lists_merge_every_node(pool: Pool, cluster: ClusterStorage) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3)
    await cluster.create_topic(NS, "session", TopicConfig(internal=True))
    assert [t.name for t in await cluster.list_topics(NS)] == names
    listed = await cluster.list_topics(NS, include_internal=True)
    assert [t.name for t in listed] == sorted([*names, "session"])
    for i, name in enumerate(names):
        await cluster.append([AppendRequest(entry=Message(), queues=(QueueRef(NS, name),))])
        await cluster.commit_offset(NS, "readers", QueueRef(NS, name), 1, str(i))
    offsets = await cluster.list_group_offsets(NS, "readers")
    assert {q.topic: c.metadata for q, c in offsets.items()} == {
        n: str(i) for i, n in enumerate(names)
    }
    assert await cluster.list_groups(NS) == ["readers"]
    await cluster.delete_group_offsets(NS, "readers", [QueueRef(NS, names[0])])
    assert len(await cluster.list_group_offsets(NS, "readers")) == 2
    await cluster.delete_group_offsets(NS, "readers")
    assert await cluster.list_group_offsets(NS, "readers") == {}


async def test_transactions_and_delayed_messages_on_their_node(
    pool: Pool, cluster: ClusterStorage
) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3)
    queue = QueueRef(NS, names[2])
    half = await cluster.append_half(
        AppendRequest(entry=Message(body=b"tx"), queues=(queue,)), producer_group="p"
    )
    [undecided] = await cluster.list_undecided(NS)
    assert undecided.transaction_id == half.transaction_id
    result = await cluster.end_transaction(NS, half.transaction_id, commit=True)
    assert result is not None and [p.queue for p in result.placements] == [queue]
    assert [m.message.body for m in (await cluster.read(queue, 0)).messages] == [b"tx"]
    with pytest.raises(TransactionNotFound):
        await cluster.end_transaction(NS, half.transaction_id, commit=False)
    with pytest.raises(InvalidArgument):
        await cluster.append_half(
            AppendRequest(entry=Message(), queues=(queue, QueueRef(NS, names[0])))
        )
    delayed = Message(body=b"later", delivery_time_ms=2**42)
    [held] = await cluster.append([AppendRequest(entry=delayed, queues=(queue,))])
    assert await cluster.delayed_count(NS, queue) == 1
    assert await cluster.cancel_delayed(NS, held.message_id)
    assert not await cluster.cancel_delayed(NS, held.message_id)


async def test_a_node_that_joined_later_gets_the_namespace_when_used(
    pool: Pool, cluster: ClusterStorage
) -> None:
    late = pool.nodes[2]
    late.down = True
    await cluster.refresh()
    await cluster.create_namespace("tenant")
    assert "tenant" not in await late.engine.list_namespaces()
    late.down = False
    await cluster.refresh()
    for i in range(6):  # the emptiest node gets topics: the late one among them
        await cluster.create_topic("tenant", f"t{i}")
    assert "tenant" in await late.engine.list_namespaces()
    assert any(pool.node_of(cluster, "tenant", f"t{i}") is late for i in range(6))
    await cluster.set_group_config("tenant", "g", GroupConfig(fifo=True))
    assert (await late.engine.get_group_config("tenant", "g")).fifo


async def test_compaction_runs_on_the_topics_node(pool: Pool, cluster: ClusterStorage) -> None:
    names = await _topics_on_distinct_nodes(pool, cluster, 3)
    queue = QueueRef(NS, names[1])
    owner = pool.node_of(cluster, NS, names[1])
    await cluster.append(
        [AppendRequest(entry=Message(body=str(i).encode()), queues=(queue,)) for i in range(3)]
    )
    assert await cluster.compact(queue, drop=[1]) == 1
    assert [m.offset for m in (await cluster.read(queue, 0)).messages] == [0, 2]
    assert owner.calls["compact"] == 1


def test_it_is_a_storage_api() -> None:
    """Every method of the storage API, so the gateway takes it for the engine."""
    missing = [
        name
        for name in vars(StorageAPI)
        if not name.startswith("_") and not callable(getattr(ClusterStorage, name, None))
    ]
    assert missing == []
