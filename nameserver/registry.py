"""What one nameserver knows: the live storage nodes and what each holds, rebuilt from
heartbeats alone (RocketMQ's RouteInfoManager, without the persistence).

Pure: no sockets, no asyncio, no clock. Every call that depends on time takes
``now_ms``, so expiry and pending placements are tested by passing numbers.

Routes come only from live nodes' heartbeats, so they can never disagree for long
with what the nodes hold. Placement is the one thing a nameserver decides: it picks a
node for a topic (or a namespace's home) that no node holds yet, and remembers the
answer for a while (soft), so that two gateways creating the same topic at once are
sent to the same node, and so that a burst of creations spreads over nodes instead
of all landing on the node that looked emptiest at the time.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from polymq.storage.errors import InvalidArgument, StorageUnavailable
from polymq.storage.routes import NodeHeartbeat, NodeStatus, RouteTable, TopicKey

__all__ = ["DEFAULT_PENDING_MS", "Registry"]

log = logging.getLogger(__name__)

# How long an answered placement is kept until the node reports the topic: long
# enough for the gateway to create it and the node's next heartbeat to arrive.
DEFAULT_PENDING_MS = 30_000


@dataclass(slots=True)
class _Node:
    heartbeat: NodeHeartbeat
    last_seen_ms: int
    alive: bool = True

    def same_shape(self, hb: NodeHeartbeat) -> bool:
        """Whether ``hb`` says what the last heartbeat said about where things are
        (load and disk are not part of it). A node repeats itself in the same order
        almost always, so the tuples are compared first and sets only if they differ."""
        old = self.heartbeat
        if (old.host, old.port) != (hb.host, hb.port):
            return False
        topics = old.topics == hb.topics or set(old.topics) == set(hb.topics)
        return topics and (old.homes == hb.homes or set(old.homes) == set(hb.homes))

    def status(self) -> NodeStatus:
        hb = self.heartbeat
        return NodeStatus(
            node_id=hb.node_id,
            host=hb.host,
            port=hb.port,
            load=hb.load,
            disk_free_bytes=hb.disk_free_bytes,
            topic_count=len(hb.topics),
            last_seen_ms=self.last_seen_ms,
            alive=self.alive,
            epoch=hb.epoch,
            owner=hb.owner,
        )


@dataclass(frozen=True, slots=True)
class _Pending:
    node_id: str
    expires_ms: int


def _routing(table: RouteTable) -> tuple[object, ...]:
    """What gateways route by: not load figures or last-seen times."""
    return (
        [(n.node_id, n.host, n.port, n.alive) for n in table.nodes],
        table.topics,
        table.homes,
    )


def _rendezvous(node_id: str, key: str) -> bytes:
    """Ties between equally loaded nodes go the same way on every nameserver."""
    return hashlib.blake2b(f"{node_id}\0{key}".encode(), digest_size=8).digest()


def _check_heartbeat(hb: object, last: NodeHeartbeat | None) -> None:
    """A heartbeat arrives from the network: anything malformed is refused here, with a
    message naming the field, before it can reach the routes. Topics equal to the
    node's last accepted ones were checked then (a tuple equals only a tuple of equal
    items), which saves walking thousands of them at every beat."""
    if not isinstance(hb, NodeHeartbeat):
        raise InvalidArgument(f"a heartbeat must be a NodeHeartbeat, got {type(hb).__name__}")
    if not isinstance(hb.node_id, str) or not hb.node_id:
        raise InvalidArgument("heartbeat without a node_id")
    who = f"heartbeat of node {hb.node_id!r}"
    if not isinstance(hb.host, str) or not hb.host:
        raise InvalidArgument(f"{who}: no host")
    if type(hb.port) is not int or not 0 < hb.port < 65536:
        raise InvalidArgument(f"{who}: port {hb.port!r} is not a TCP port")
    known = last is not None and last.node_id == hb.node_id and last.topics == hb.topics
    if not known and not _topic_pairs(hb.topics):
        raise InvalidArgument(f"{who}: topics must be (namespace, topic) pairs of strings")
    if not isinstance(hb.owner, str):
        raise InvalidArgument(f"{who}: owner must be a string")
    if not isinstance(hb.homes, tuple) or not all(isinstance(h, str) for h in hb.homes):
        raise InvalidArgument(f"{who}: homes must be namespace names")
    for name in ("load", "disk_free_bytes", "started_ms", "epoch"):
        value = getattr(hb, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"{who}: {name} must be a number, got {value!r}")


def _topic_pairs(topics: object) -> bool:
    return isinstance(topics, tuple) and all(
        type(t) is tuple and len(t) == 2 and type(t[0]) is str and type(t[1]) is str for t in topics
    )


class Registry:
    """The nameserver's soft state.

    ``node_expiry_ms``: a node silent this long leaves the routes (it stays in
    :meth:`status`, marked dead). ``pending_ms``: how long a placement answer is kept
    until a heartbeat confirms it. ``started_ms`` seeds the version, so versions keep
    growing across nameserver restarts (a millisecond or more apart).

    ``warmup_ms``: right after a (re)start the registry has heard from only some
    nodes; during this window a caller that already holds routes (from an earlier
    instance or another nameserver) is told "unchanged" rather than handed a partial
    table, so gateways with cached routes keep sending traffic to nodes that have not
    heartbeated yet. One or two heartbeat intervals.
    """

    def __init__(
        self,
        *,
        node_expiry_ms: int = 10_000,
        pending_ms: int = DEFAULT_PENDING_MS,
        started_ms: int = 0,
        warmup_ms: int = 0,
    ) -> None:
        if node_expiry_ms <= 0:
            raise ValueError("node_expiry_ms must be positive")
        self._expiry_ms = node_expiry_ms
        self._pending_ms = pending_ms
        self._nodes: dict[str, _Node] = {}
        self._pending_topics: dict[TopicKey, _Pending] = {}
        self._pending_homes: dict[str, _Pending] = {}
        # Versions are compared for equality only, but they should not repeat: a
        # gateway holding version v from an earlier instance (or another nameserver)
        # must not be told "unchanged" by chance. So each instance starts far above
        # the last (a million versions per millisecond of start time), plus random
        # bits for two started in the same millisecond.
        self._first_version = max(1, (started_ms << 20) | random.getrandbits(19))
        self._version = self._first_version
        self._warm_until_ms = started_ms + warmup_ms if warmup_ms > 0 else None
        self._conflicts: frozenset[tuple[str, ...]] = frozenset()
        self._dead_holders: frozenset[str] = frozenset()  # dead nodes still routed to
        self._table = self._build()

    # -- heartbeats and expiry -------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def heartbeat(self, hb: NodeHeartbeat, now_ms: int) -> int:
        """Record a node's report; the current version (callers compare it with the
        one they hold to know whether to fetch routes)."""
        node = self._nodes.get(hb.node_id) if isinstance(hb, NodeHeartbeat) else None
        _check_heartbeat(hb, node.heartbeat if node is not None else None)
        if node is not None and hb.epoch < node.heartbeat.epoch:
            return self._version  # a deposed owner of the shard, not yet stopped
        self._end_warmup(now_ms)
        if node is None:
            node = self._nodes[hb.node_id] = _Node(hb, now_ms)
            log.info("node %s joined at %s:%d", hb.node_id, hb.host, hb.port)
            changed = True
        else:
            if not node.alive:
                log.info("node %s is back at %s:%d", hb.node_id, hb.host, hb.port)
            changed = not node.alive or not node.same_shape(hb)
            node.heartbeat, node.last_seen_ms, node.alive = hb, now_ms, True
        self._confirm_pending(hb)
        if changed:
            self._rebuild()
        else:
            self._table = self._with_fresh_nodes()
        return self._version

    def expire(self, now_ms: int) -> tuple[str, ...]:
        """Mark nodes silent for longer than the expiry dead; the ids that just died."""
        self._end_warmup(now_ms)
        died = []
        for node in self._nodes.values():
            if node.alive and now_ms - node.last_seen_ms > self._expiry_ms:
                node.alive = False
                died.append(node.heartbeat.node_id)
                log.warning(
                    "node %s expired: silent for %d ms",
                    node.heartbeat.node_id,
                    now_ms - node.last_seen_ms,
                )
        self._pending_topics = {
            k: p for k, p in self._pending_topics.items() if p.expires_ms > now_ms
        }
        self._pending_homes = {
            k: p for k, p in self._pending_homes.items() if p.expires_ms > now_ms
        }
        if died:
            self._rebuild()
        return tuple(died)

    def _end_warmup(self, now_ms: int) -> None:
        if self._warm_until_ms is not None and now_ms >= self._warm_until_ms:
            self._warm_until_ms = None

    @property
    def warming_up(self) -> bool:
        return self._warm_until_ms is not None

    # -- answers ----------------------------------------------------------------------

    def routes(self, since_version: int = 0) -> RouteTable | None:
        """The live nodes and what they hold; ``None`` when the caller's version is
        current. Any other version gets the whole table (a version from another
        nameserver or an earlier instance is not comparable). ``since_version`` <= 0
        means the caller has no routes yet. While warming up, a caller holding routes
        from elsewhere keeps them (``None``) rather than get a partial table."""
        if since_version == self._version:
            return None
        from_elsewhere = not self._first_version <= since_version <= self._version
        if self.warming_up and since_version > 0 and from_elsewhere:
            return None
        return self._table

    def status(self) -> RouteTable:
        """The routes plus the dead nodes (``alive`` False), for ``cluster status``."""
        nodes = tuple(sorted((n.status() for n in self._nodes.values()), key=lambda s: s.node_id))
        return RouteTable(
            version=self._version,
            nodes=nodes,
            topics=dict(self._table.topics),
            homes=dict(self._table.homes),
        )

    # -- placement --------------------------------------------------------------------

    def place_topic(self, namespace: str, topic: str, now_ms: int) -> str:
        """The node that holds, or is to hold, all of the topic's queues.

        A topic some node reports -> that node, even if it is dead now (creating it
        again elsewhere would split its data; the caller gets a retryable error for the
        dead node instead). A recent placement -> the same answer. Else the live node
        with the fewest topics counting pending placements, then the lowest load,
        ties by rendezvous hash."""
        key: TopicKey = (namespace, topic)
        holder = self._topic_holder(key)
        if holder is not None:
            return holder
        pending = self._pending_topics.get(key)
        if pending is not None and pending.expires_ms > now_ms and self._alive(pending.node_id):
            return pending.node_id
        counts = self._pending_counts(self._pending_topics.values(), now_ms)
        node_id = self._pick(
            f"topic\0{namespace}\0{topic}",
            lambda n: (len(n.heartbeat.topics) + counts.get(n.heartbeat.node_id, 0),),
        )
        self._pending_topics[key] = _Pending(node_id, now_ms + self._pending_ms)
        return node_id

    def place_home(self, namespace: str, now_ms: int) -> str:
        """The node that keeps, or is to keep, the namespace-wide data; the same rules
        as :meth:`place_topic`, spreading homes first, then topics."""
        holder = self._home_holder(namespace)
        if holder is not None:
            return holder
        pending = self._pending_homes.get(namespace)
        if pending is not None and pending.expires_ms > now_ms and self._alive(pending.node_id):
            return pending.node_id
        homes = self._pending_counts(self._pending_homes.values(), now_ms)
        topics = self._pending_counts(self._pending_topics.values(), now_ms)
        node_id = self._pick(
            f"home\0{namespace}",
            lambda n: (
                len(n.heartbeat.homes) + homes.get(n.heartbeat.node_id, 0),
                len(n.heartbeat.topics) + topics.get(n.heartbeat.node_id, 0),
            ),
        )
        self._pending_homes[namespace] = _Pending(node_id, now_ms + self._pending_ms)
        return node_id

    def _topic_holder(self, key: TopicKey) -> str | None:
        """The node reporting the topic: the live one routes name, else a dead one."""
        live = self._table.topics.get(key)
        if live is not None:
            return live
        dead = (n for n in self._nodes.values() if not n.alive and key in n.heartbeat.topics)
        return min((n.heartbeat.node_id for n in dead), default=None)

    def _home_holder(self, namespace: str) -> str | None:
        live = self._table.homes.get(namespace)
        if live is not None:
            return live
        dead = (n for n in self._nodes.values() if not n.alive and namespace in n.heartbeat.homes)
        return min((n.heartbeat.node_id for n in dead), default=None)

    def _alive(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.alive

    @staticmethod
    def _pending_counts(pending: Iterable[_Pending], now_ms: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        for p in pending:
            if p.expires_ms > now_ms:
                counts[p.node_id] = counts.get(p.node_id, 0) + 1
        return counts

    def _pick(self, key: str, score: Callable[[_Node], tuple[int, ...]]) -> str:
        live = [n for n in self._nodes.values() if n.alive]
        if not live:
            raise StorageUnavailable("no live storage node to place on")
        best = min(
            live,
            key=lambda n: (
                *score(n),
                n.heartbeat.load,
                _rendezvous(n.heartbeat.node_id, key),
            ),
        )
        return best.heartbeat.node_id

    def _confirm_pending(self, hb: NodeHeartbeat) -> None:
        if self._pending_topics:
            for key in hb.topics:
                self._pending_topics.pop(key, None)
        if self._pending_homes:
            for namespace in hb.homes:
                self._pending_homes.pop(namespace, None)

    # -- the table --------------------------------------------------------------------

    def _rebuild(self) -> None:
        """After a node's report changed or a node died: the version moves only if the
        routes did (a node adding a topic that a lower node already serves changes
        nothing a gateway routes by)."""
        table = self._build()
        if _routing(table) != _routing(self._table):
            self._version += 1
            table = replace(table, version=self._version)
        self._table = table

    def _with_fresh_nodes(self) -> RouteTable:
        """The same routes and version with the nodes' latest load figures (a caller
        fetching routes for another reason gets them; no version bump)."""
        table = self._table
        return RouteTable(
            version=table.version,
            nodes=self._routed_nodes(),
            topics=table.topics,
            homes=table.homes,
        )

    def _routed_nodes(self) -> tuple[NodeStatus, ...]:
        """The live nodes, and the dead ones still holding a routed topic or home
        (``alive`` False)."""
        routed = (
            n.status()
            for n in self._nodes.values()
            if n.alive or n.heartbeat.node_id in self._dead_holders
        )
        return tuple(sorted(routed, key=lambda s: s.node_id))

    def _build(self) -> RouteTable:
        topics: dict[TopicKey, str] = {}
        homes: dict[str, str] = {}
        conflicts: set[tuple[str, ...]] = set()
        # Lowest node id first, so a key two nodes report goes to the lowest.
        for node in sorted(self._nodes.values(), key=lambda n: n.heartbeat.node_id):
            if not node.alive:
                continue
            node_id = node.heartbeat.node_id
            for key in node.heartbeat.topics:
                owner = topics.setdefault(key, node_id)
                if owner != node_id:
                    conflicts.add(("topic", *key, owner, node_id))
            for namespace in node.heartbeat.homes:
                owner = homes.setdefault(namespace, node_id)
                if owner != node_id:
                    conflicts.add(("home", namespace, owner, node_id))
        # A dead node's topics and homes stay routed to it, listed as dead, unless a
        # live node reports them: a gateway (even one started since) answers
        # "unavailable, retry" for them, never "no such topic", which is a wrong
        # answer while a shard is between owners and would invite creating the topic
        # again (placement sends it to the dead holder anyway).
        dead_holders: set[str] = set()
        for node in sorted(self._nodes.values(), key=lambda n: n.heartbeat.node_id):
            if node.alive:
                continue
            node_id = node.heartbeat.node_id
            for key in node.heartbeat.topics:
                if topics.setdefault(key, node_id) == node_id:
                    dead_holders.add(node_id)
            for namespace in node.heartbeat.homes:
                if homes.setdefault(namespace, node_id) == node_id:
                    dead_holders.add(node_id)
        new = frozenset(conflicts) - self._conflicts
        for conflict in sorted(new):
            log.warning(
                "%s reported by two nodes, routed to %s: %s", conflict[0], conflict[-2], conflict
            )
        self._conflicts = frozenset(conflicts)
        self._dead_holders = frozenset(dead_holders)
        return RouteTable(
            version=self._version, nodes=self._routed_nodes(), topics=topics, homes=homes
        )
