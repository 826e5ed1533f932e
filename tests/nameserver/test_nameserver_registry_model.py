"""The registry against a model: random heartbeats, silences and expiries, checking
after every step that the routes say exactly what the live nodes report and that the
version moves exactly when the routes do."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from polymq.nameserver.registry import Registry
from polymq.storage.routes import NodeHeartbeat, RouteTable, TopicKey

EXPIRY = 1000
NODES = ("n1", "n2", "n3")
TOPICS: tuple[TopicKey, ...] = (("ns", "a"), ("ns", "b"), ("other", "a"))
HOMES = ("ns", "other")


def shape(table: RouteTable) -> tuple[object, ...]:
    """What a gateway's routing depends on: not load figures or last-seen times."""
    nodes = tuple((n.node_id, n.host, n.port, n.alive) for n in table.nodes)
    return nodes, sorted(table.topics.items()), sorted(table.homes.items())


class RegistryModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = Registry(node_expiry_ms=EXPIRY, started_ms=1)
        self.now = 1
        self.last_beat: dict[str, NodeHeartbeat] = {}
        self.seen: dict[str, int] = {}
        table = self.registry.routes(0)
        assert table is not None
        self.version, self.shape = table.version, shape(table)

    @rule(
        node=st.sampled_from(NODES),
        topics=st.lists(st.sampled_from(TOPICS), unique=True),
        homes=st.lists(st.sampled_from(HOMES), unique=True),
        port=st.sampled_from((1, 2)),
        load=st.floats(0, 100),
    )
    def heartbeat(
        self, node: str, topics: list[TopicKey], homes: list[str], port: int, load: float
    ) -> None:
        hb = NodeHeartbeat(
            node_id=node, host="h", port=port, topics=tuple(topics), homes=tuple(homes), load=load
        )
        self.registry.heartbeat(hb, self.now)
        self.last_beat[node], self.seen[node] = hb, self.now

    @rule(ms=st.integers(0, 2 * EXPIRY))
    def time_passes(self, ms: int) -> None:
        self.now += ms

    @rule()
    def expire(self) -> None:
        self.registry.expire(self.now)

    @rule(topic=st.sampled_from(TOPICS))
    def place(self, topic: TopicKey) -> None:
        live = [n for n in self.last_beat if self._alive(n)]
        holders = sorted(n for n, hb in self.last_beat.items() if topic in hb.topics)
        try:
            placed = self.registry.place_topic(*topic, self.now)
        except Exception:
            assert not live
            return
        if holders:
            live_holders = [n for n in holders if self._alive(n)]
            assert placed == (live_holders or holders)[0]
        else:
            assert placed in live

    def _alive(self, node: str) -> bool:
        """Alive as of the registry's last expiry pass: routes change only then."""
        status = {n.node_id: n.alive for n in self.registry.status().nodes}
        return status.get(node, False)

    @invariant()
    def routes_are_what_live_nodes_report(self) -> None:
        """Live nodes' reports first (the lowest id wins a key two report), then what
        only dead nodes report, routed to the dead holder, listed as dead."""
        table = self.registry.routes(0)
        assert table is not None
        live = sorted(n for n in self.last_beat if self._alive(n))
        dead = sorted(n for n in self.last_beat if not self._alive(n))
        expected: dict[TopicKey, str] = {}
        homes: dict[str, str] = {}
        for node in [*live, *dead]:
            for topic in self.last_beat[node].topics:
                expected.setdefault(topic, node)
            for home in self.last_beat[node].homes:
                homes.setdefault(home, node)
        assert table.topics == expected
        assert table.homes == homes
        holders = set(expected.values()) | set(homes.values())
        listed = sorted([*live, *(n for n in dead if n in holders)])
        assert [(n.node_id, n.alive) for n in table.nodes] == [(n, n in live) for n in listed]

    @invariant()
    def the_version_moves_exactly_when_the_routes_do(self) -> None:
        table = self.registry.routes(0)
        assert table is not None
        changed = shape(table) != self.shape
        assert (table.version != self.version) == changed
        assert (self.registry.routes(self.version) is None) == (not changed)
        self.version, self.shape = table.version, shape(table)


RegistryModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_registry_model = RegistryModel.TestCase
