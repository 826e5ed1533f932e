"""The nameserver's soft state, driven with plain numbers for time."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.nameserver.registry import Registry
from polymq.storage.errors import InvalidArgument, StorageUnavailable
from polymq.storage.routes import NodeHeartbeat, TopicKey

EXPIRY = 10_000
T0 = 1_700_000_000_000


def beat(
    node_id: str,
    *,
    topics: tuple[TopicKey, ...] = (),
    homes: tuple[str, ...] = (),
    load: float = 0.0,
    port: int = 10911,
) -> NodeHeartbeat:
    return NodeHeartbeat(
        node_id=node_id, host="127.0.0.1", port=port, topics=topics, homes=homes, load=load
    )


def registry_with(*node_ids: str, now: int = T0) -> Registry:
    registry = Registry(node_expiry_ms=EXPIRY, started_ms=now)
    for node_id in node_ids:
        registry.heartbeat(beat(node_id), now)
    return registry


def test_routes_list_live_nodes_and_their_topics_and_homes() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", topics=(("ns", "t1"),), homes=("ns",)), T0)
    registry.heartbeat(beat("b", topics=(("ns", "t2"), ("other", "t1")), port=10912), T0)
    table = registry.routes(0)
    assert table is not None
    assert [n.node_id for n in table.nodes] == ["a", "b"]
    assert table.topics == {("ns", "t1"): "a", ("ns", "t2"): "b", ("other", "t1"): "b"}
    assert table.homes == {"ns": "a"}
    assert table.nodes[1].port == 10912
    assert table.nodes[1].topic_count == 2


def test_routes_is_none_only_for_the_current_version() -> None:
    registry = registry_with("a")
    table = registry.routes(0)
    assert table is not None
    assert registry.routes(table.version) is None
    # A version from elsewhere (another nameserver, an earlier instance) is not
    # comparable: older or newer, the caller gets the whole table.
    assert registry.routes(table.version - 1) == table
    assert registry.routes(table.version + 100) == table


def test_version_bumps_only_on_real_change() -> None:
    registry = registry_with("a")
    v0 = registry.version
    # Same shape, different load and disk: no bump.
    assert registry.heartbeat(beat("a", load=5.0), T0 + 100) == v0
    assert registry.routes(v0) is None
    # A topic appears: bump.
    v1 = registry.heartbeat(beat("a", topics=(("ns", "t"),), load=5.0), T0 + 200)
    assert v1 > v0
    # Same topics in another order: no bump.
    registry.heartbeat(beat("a", topics=(("ns", "u"), ("ns", "t"))), T0 + 300)
    v2 = registry.version
    assert registry.heartbeat(beat("a", topics=(("ns", "t"), ("ns", "u"))), T0 + 400) == v2
    # A home claimed, an address changed, a node joining: each bumps.
    v3 = registry.heartbeat(beat("a", topics=(("ns", "t"), ("ns", "u")), homes=("ns",)), T0)
    assert v3 > v2
    v4 = registry.heartbeat(
        beat("a", topics=(("ns", "t"), ("ns", "u")), homes=("ns",), port=2000), T0
    )
    assert v4 > v3
    assert registry.heartbeat(beat("b"), T0) > v4
    # Expiry with nobody silent: no bump.
    v5 = registry.version
    assert registry.expire(T0 + 1000) == ()
    assert registry.version == v5


def test_load_figures_refresh_without_a_version_bump() -> None:
    registry = registry_with("a")
    registry.heartbeat(beat("a", load=7.5), T0 + 10)
    table = registry.routes(0)
    assert table is not None
    assert table.nodes[0].load == 7.5
    assert table.nodes[0].last_seen_ms == T0 + 10


def test_a_silent_node_stays_routed_as_dead_and_comes_back() -> None:
    """A dead node's topics and home stay routed to it, the node listed as dead: a
    gateway started since answers "unavailable" for them, not "no such topic" (a wrong
    answer while a shard of the replicated pool is between owners)."""
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", topics=(("ns", "t1"),), homes=("ns",)), T0)
    registry.heartbeat(beat("b", topics=(("ns", "t2"),)), T0)
    registry.heartbeat(beat("b", topics=(("ns", "t2"),)), T0 + EXPIRY)
    before = registry.version
    assert registry.expire(T0 + EXPIRY) == ()  # exactly the expiry: not yet
    assert registry.expire(T0 + EXPIRY + 1) == ("a",)
    assert registry.version > before
    table = registry.routes(0)
    assert table is not None
    assert [(n.node_id, n.alive) for n in table.nodes] == [("a", False), ("b", True)]
    assert table.topics == {("ns", "t1"): "a", ("ns", "t2"): "b"}
    assert table.homes == {"ns": "a"}
    status = registry.status()
    assert {(n.node_id, n.alive) for n in status.nodes} == {("a", False), ("b", True)}
    # Expiring again changes nothing.
    dead_version = registry.version
    assert registry.expire(T0 + EXPIRY + 2) == ()
    assert registry.version == dead_version
    # It heartbeats again: back in the routes, alive.
    registry.heartbeat(beat("a", topics=(("ns", "t1"),), homes=("ns",)), T0 + EXPIRY + 3)
    table = registry.routes(dead_version)
    assert table is not None
    assert [(n.node_id, n.alive) for n in table.nodes] == [("a", True), ("b", True)]
    assert table.topics == {("ns", "t1"): "a", ("ns", "t2"): "b"}
    assert table.homes == {"ns": "a"}


def test_a_topic_reported_by_two_nodes_goes_to_the_lowest_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    with caplog.at_level(logging.WARNING, logger="polymq.nameserver.registry"):
        registry.heartbeat(beat("node-b", topics=(("ns", "t"),), homes=("ns",)), T0)
        registry.heartbeat(beat("node-a", topics=(("ns", "t"),), homes=("ns",)), T0)
        registry.heartbeat(beat("node-c", topics=(("ns", "t"),)), T0)
    table = registry.routes(0)
    assert table is not None
    assert table.topics[("ns", "t")] == "node-a"
    assert table.homes["ns"] == "node-a"
    assert registry.place_topic("ns", "t", T0) == "node-a"
    conflicts = [r for r in caplog.records if "two nodes" in r.getMessage()]
    assert conflicts
    # Logged when the conflict appears, not again at every heartbeat.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polymq.nameserver.registry"):
        registry.heartbeat(beat("node-a", topics=(("ns", "t"),), homes=("ns",)), T0 + 1)
        registry.heartbeat(beat("node-a", topics=(("ns", "t"), ("ns", "u")), homes=("ns",)), T0)
    assert not [r for r in caplog.records if "two nodes" in r.getMessage()]
    # The lowest leaves: the next lowest takes over.
    registry.heartbeat(beat("node-b", topics=(("ns", "t"),)), T0 + EXPIRY)
    registry.heartbeat(beat("node-c", topics=(("ns", "t"),)), T0 + EXPIRY)
    registry.expire(T0 + EXPIRY + 2)
    table = registry.routes(0)
    assert table is not None
    assert table.topics[("ns", "t")] == "node-b"


def test_a_restarted_registry_rebuilds_from_heartbeats() -> None:
    beats = [
        beat("a", topics=(("ns", "t1"), ("ns", "t3")), homes=("ns",)),
        beat("b", topics=(("ns", "t2"),), homes=("other",), port=2),
    ]
    first = Registry(node_expiry_ms=EXPIRY, started_ms=T0)
    for hb in beats:
        first.heartbeat(hb, T0 + 5)
    before = first.routes(0)
    assert before is not None
    second = Registry(node_expiry_ms=EXPIRY, started_ms=T0 + 60_000)
    for hb in beats:
        second.heartbeat(hb, T0 + 60_005)
    after = second.routes(before.version)
    assert after is not None
    assert after.topics == before.topics
    assert after.homes == before.homes
    assert [(n.node_id, n.host, n.port) for n in after.nodes] == [
        (n.node_id, n.host, n.port) for n in before.nodes
    ]
    # Versions keep growing across restarts (seeded with the start time).
    assert after.version > before.version


def test_while_warming_up_callers_with_routes_keep_them() -> None:
    old = registry_with("a", "b")
    held = old.routes(0)
    assert held is not None
    restarted = Registry(node_expiry_ms=EXPIRY, started_ms=T0 + 60_000, warmup_ms=3000)
    restarted.heartbeat(beat("a"), T0 + 60_100)  # b has not reported yet
    assert restarted.warming_up
    assert restarted.routes(held.version) is None  # keep your full table
    partial = restarted.routes(0)  # nothing held: something beats nothing
    assert partial is not None
    assert [n.node_id for n in partial.nodes] == ["a"]
    restarted.heartbeat(beat("b"), T0 + 60_200)
    # A caller holding this instance's table still follows it.
    newer = restarted.routes(partial.version)
    assert newer is not None
    assert [n.node_id for n in newer.nodes] == ["a", "b"]
    restarted.expire(T0 + 63_000)
    assert not restarted.warming_up
    assert restarted.routes(held.version) == newer


def test_heartbeat_rejects_bad_input() -> None:
    registry = Registry()
    with pytest.raises(InvalidArgument):
        registry.heartbeat(NodeHeartbeat(node_id="", host="h", port=1), T0)
    with pytest.raises(InvalidArgument):
        registry.heartbeat(NodeHeartbeat(node_id="a", host="h", port=0), T0)
    with pytest.raises(InvalidArgument):
        registry.heartbeat(NodeHeartbeat(node_id="a", host="", port=1), T0)
    assert registry.routes(0) is not None
    assert registry.status().nodes == ()


# -- placement ------------------------------------------------------------------------


def test_placement_with_no_live_node_is_unavailable() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    with pytest.raises(StorageUnavailable):
        registry.place_topic("ns", "t", T0)
    registry.heartbeat(beat("a"), T0)
    registry.expire(T0 + EXPIRY + 1)
    with pytest.raises(StorageUnavailable):
        registry.place_home("ns", T0 + EXPIRY + 1)


def test_placement_spreads_a_burst_of_topics_evenly() -> None:
    registry = registry_with("a", "b", "c")
    placed = [registry.place_topic("ns", f"t{i}", T0) for i in range(30)]
    assert {node: placed.count(node) for node in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_placement_prefers_the_node_with_fewest_topics() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", topics=tuple(("ns", f"x{i}") for i in range(5))), T0)
    registry.heartbeat(beat("b", topics=(("ns", "y"),)), T0)
    placed = [registry.place_topic("ns", f"t{i}", T0) for i in range(4)]
    assert placed == ["b"] * 4  # b reaches 5 topics; then ties spread
    assert {registry.place_topic("ns", f"u{i}", T0) for i in range(4)} == {"a", "b"}


def test_equal_counts_go_to_the_lower_load() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", load=9.0), T0)
    registry.heartbeat(beat("b", load=1.0), T0)
    assert registry.place_topic("ns", "t", T0) == "b"


def test_a_pending_placement_gets_the_same_answer() -> None:
    registry = registry_with("a", "b")
    first = registry.place_topic("ns", "t", T0)
    assert all(registry.place_topic("ns", "t", T0 + i) == first for i in range(10))
    home = registry.place_home("ns", T0)
    assert registry.place_home("ns", T0 + 5) == home
    # The answer is not a route: nobody holds the topic yet.
    table = registry.routes(0)
    assert table is not None
    assert ("ns", "t") not in table.topics


def test_pending_placements_are_soft() -> None:
    registry = Registry(node_expiry_ms=EXPIRY * 10, pending_ms=1000)
    registry.heartbeat(beat("a"), T0)
    registry.heartbeat(beat("b"), T0)
    chosen = registry.place_topic("ns", "t", T0)
    other = "b" if chosen == "a" else "a"
    # The chosen node fills up meanwhile; after the pending time the topic is placed
    # afresh, on the emptier node.
    registry.heartbeat(beat(chosen, topics=(("ns", "x"), ("ns", "y"))), T0 + 500)
    assert registry.place_topic("ns", "t", T0 + 999) == chosen
    registry.expire(T0 + 1000)
    assert registry.place_topic("ns", "t", T0 + 1000) == other


def test_a_pending_placement_on_a_dead_node_is_placed_again() -> None:
    registry = registry_with("a", "b")
    chosen = registry.place_topic("ns", "t", T0)
    survivor = "b" if chosen == "a" else "a"
    registry.heartbeat(beat(survivor), T0 + EXPIRY)
    registry.expire(T0 + EXPIRY + 1)
    assert registry.place_topic("ns", "t", T0 + EXPIRY + 1) == survivor


def test_a_reported_topic_is_placed_where_it_is() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a"), T0)
    registry.heartbeat(beat("b", topics=tuple(("ns", f"t{i}") for i in range(9))), T0)
    assert registry.place_topic("ns", "t3", T0) == "b"
    registry.heartbeat(beat("b", homes=("ns",), topics=(("ns", "t3"),)), T0)
    assert registry.place_home("ns", T0) == "b"


def test_a_dead_nodes_topics_are_not_placed_elsewhere() -> None:
    """Creating the topic again on another node would split its data: the caller is
    sent to the dead node and gets a retryable error there."""
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", topics=(("ns", "t"),), homes=("ns",)), T0)
    registry.heartbeat(beat("b"), T0)
    registry.heartbeat(beat("b"), T0 + EXPIRY)
    registry.expire(T0 + EXPIRY + 1)
    assert registry.place_topic("ns", "t", T0 + EXPIRY + 1) == "a"
    assert registry.place_home("ns", T0 + EXPIRY + 1) == "a"
    assert registry.place_topic("ns", "new", T0 + EXPIRY + 1) == "b"


def test_a_confirmed_placement_stops_counting_as_pending() -> None:
    registry = registry_with("a", "b")
    chosen = registry.place_topic("ns", "t", T0)
    registry.heartbeat(beat(chosen, topics=(("ns", "t"),)), T0 + 1)
    # Counted once (as a topic), not twice: the next one goes to the other node, and
    # the one after that is a tie again rather than another for the other node.
    other = "b" if chosen == "a" else "a"
    assert registry.place_topic("ns", "u", T0 + 2) == other
    registry.heartbeat(beat(other, topics=(("ns", "u"),)), T0 + 3)
    assert {registry.place_topic("ns", f"v{i}", T0 + 4) for i in range(2)} == {"a", "b"}


def test_homes_spread_over_nodes() -> None:
    registry = registry_with("a", "b", "c")
    homes = [registry.place_home(f"ns{i}", T0) for i in range(9)]
    assert sorted(homes) == sorted(["a", "b", "c"] * 3)


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True),
    existing=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20)),
    burst=st.integers(1, 60),
)
def test_placement_keeps_topic_counts_within_one(
    nodes: list[str], existing: dict[str, int], burst: int
) -> None:
    """Whatever the nodes start with, a burst fills the emptiest first and never lets
    the placed-on nodes drift more than one topic apart."""
    registry = Registry(node_expiry_ms=EXPIRY)
    counts = {}
    for node in nodes:
        held = existing.get(node, 0)
        registry.heartbeat(beat(node, topics=tuple(("pre", f"{node}{i}") for i in range(held))), T0)
        counts[node] = held
    for i in range(burst):
        counts[registry.place_topic("ns", f"t{i}", T0)] += 1
    floor = min(counts.values())
    placed_on = [n for n in nodes if counts[n] > existing.get(n, 0)]
    assert all(counts[n] <= floor + 1 for n in placed_on)


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(["a", "b", "c", "d"]),
    shared=st.lists(st.sampled_from(["t1", "t2", "t3"]), min_size=1, unique=True),
)
def test_routes_do_not_depend_on_heartbeat_order(order: list[str], shared: list[str]) -> None:
    def build(sequence: list[str]) -> dict[TopicKey, str]:
        registry = Registry(node_expiry_ms=EXPIRY)
        for node in sequence:
            registry.heartbeat(beat(node, topics=tuple(("ns", t) for t in shared)), T0)
        table = registry.routes(0)
        assert table is not None
        return table.topics

    assert build(order) == build(sorted(order)) == {("ns", t): "a" for t in shared}


@pytest.mark.parametrize(
    "fields",
    [
        {"port": "10911"},
        {"port": True},
        {"topics": [("ns", "t")]},
        {"topics": (("ns",),)},
        {"topics": (("ns", 1),)},
        {"homes": ("ns", 3)},
        {"load": "high"},
        {"node_id": 7},
    ],
)
def test_malformed_heartbeats_from_the_network_are_refused(fields: dict[str, object]) -> None:
    """Dataclasses decoded from the wire are not type-checked: the registry is."""
    hb = NodeHeartbeat(node_id="a", host="h", port=1)
    for name, value in fields.items():
        object.__setattr__(hb, name, value)
    registry = Registry()
    with pytest.raises(InvalidArgument):
        registry.heartbeat(hb, T0)
    assert registry.status().nodes == ()


def test_a_shard_moved_to_a_new_owner_ignores_the_deposed_owners_beats() -> None:
    """Replicated pool: the shard's node id reappears at its new owner with a higher
    lease epoch; beats of the old owner, not yet stopped, must not take the route back."""
    registry = Registry(node_expiry_ms=EXPIRY, started_ms=T0)
    old = NodeHeartbeat(node_id="shard-1", host="127.0.0.1", port=10911, epoch=5)
    new = NodeHeartbeat(node_id="shard-1", host="127.0.0.1", port=10921, epoch=9)
    registry.heartbeat(old, T0)
    registry.heartbeat(new, T0 + 1)
    registry.heartbeat(old, T0 + 2)
    table = registry.routes(0)
    assert table is not None
    assert [(n.node_id, n.port) for n in table.nodes] == [("shard-1", 10921)]


def test_a_dead_node_without_routed_topics_is_not_listed() -> None:
    registry = Registry(node_expiry_ms=EXPIRY)
    registry.heartbeat(beat("a", topics=(("ns", "t"),)), T0)
    registry.heartbeat(beat("b", topics=(("ns", "t"),)), T0 + EXPIRY)  # t goes to a
    assert registry.expire(T0 + EXPIRY + 1) == ("a",)
    table = registry.routes(0)
    assert table is not None
    # b reports t now that a is dead: routed to b, and a holds nothing routed.
    assert [(n.node_id, n.alive) for n in table.nodes] == [("b", True)]
    assert table.topics == {("ns", "t"): "b"}
