"""The cluster client's route cache: which storage node holds each topic and each
namespace's home, and a client per node.

Kept apart from :mod:`storage.cluster` so the rules for folding a nameserver's table
into the cache (what stays, what goes, when a node counts as down) are read in one
place and tested without any node. Lookups on the request path are plain dict hits:
``topics[namespace][topic]`` gives the :class:`Node`, whose ``alive`` flag says
whether to call it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from polymq.storage.api import StorageAPI
from polymq.storage.errors import ShardAway, StorageUnavailable
from polymq.storage.routes import NodeStatus, RouteTable

__all__ = ["Connect", "Node", "NodeClient", "RouteCache", "RouteSource"]

log = logging.getLogger(__name__)

# How long a topic or home this client just created stays routed before any
# nameserver table names it: the node reports it with its next heartbeat, and a
# table fetched in between must not make the new topic look deleted.
LOCAL_GRACE_MS = 30_000


class NodeClient(StorageAPI, Protocol):
    """One storage node as the cluster client sees it (``storage.remote.RemoteStorage``):
    the whole storage API of the node's engine, plus the claim of a namespace's home."""

    async def claim_home(self, namespace: str) -> None:
        """Make this node the keeper of the namespace's namespace-wide data (persisted
        on the node and reported in its heartbeats)."""
        ...


class RouteSource(Protocol):
    """Where routes come from (``nameserver.client.NameserverClient``)."""

    async def routes(self, since_version: int) -> RouteTable | None:
        """The current table, or ``None`` when ``since_version`` is current."""
        ...

    async def place_topic(self, namespace: str, topic: str) -> str:
        """The node id to create a new topic on (its holder if any node has it)."""
        ...

    async def place_home(self, namespace: str) -> str:
        """The node id to keep the namespace's namespace-wide data."""
        ...


Connect = Callable[[NodeStatus], NodeClient]


class Node:
    """A storage node known to this client. ``alive``: listed by the latest routes
    (a node that left them answers every call with :class:`StorageUnavailable` at
    once, without waiting on a connection). ``prefix`` starts every receipt handle the
    node hands out through this client. ``synced_groups``: (namespace -> groups) whose
    config this client has made sure the node has."""

    __slots__ = ("alive", "client", "node_id", "prefix", "status", "synced_groups")

    def __init__(self, status: NodeStatus, client: NodeClient) -> None:
        self.node_id = status.node_id
        self.status = status
        self.client = client
        self.prefix = f"{status.node_id}:"
        self.alive = True
        self.synced_groups: dict[str, set[str]] = {}

    @property
    def where(self) -> str:
        """The address the routes give it, as its client names its target."""
        return f"{self.status.host}:{self.status.port}"

    def down(self) -> StorageUnavailable:
        where = self.where
        if self.status.owner:
            return ShardAway(f"shard {self.node_id} ({where}) is between owners")
        return StorageUnavailable(f"storage node {self.node_id} ({where}) is down")

    def unreachable(self, cause: BaseException) -> StorageUnavailable:
        """The error for a call this node did not answer. A shard of the replicated
        pool (it reports an owner) is taken over by another process: :class:`ShardAway`,
        which tells a waiting consumer to wait on."""
        where = self.where
        if self.status.owner or isinstance(cause, ShardAway):
            return ShardAway(f"shard {self.node_id} ({where}): {cause}")
        return StorageUnavailable(f"storage node {self.node_id} ({where}): {cause}")

    def __repr__(self) -> str:
        return f"Node({self.node_id!r}, alive={self.alive})"


class RouteCache:
    """Nodes, topic routes and homes, as of the last table applied (``version``).

    A node leaving the routes stays known, marked down, with its topics and homes
    still routed to it: its queues answer "unavailable, retry" rather than "no such
    topic" (which would invite a client to create the topic again elsewhere, splitting
    its data), and they come back when the node heartbeats again."""

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self.version = 0
        self.nodes: dict[str, Node] = {}
        self.topics: dict[str, dict[str, Node]] = {}
        self.homes: dict[str, Node] = {}
        # Created by this client, not yet in a table: (namespace, topic|None) -> node, until ms.
        self._local: dict[tuple[str, str | None], tuple[Node, int]] = {}

    def node(self, namespace: str, topic: str) -> Node | None:
        nodes = self.topics.get(namespace)
        return nodes.get(topic) if nodes is not None else None

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def has_live_node(self) -> bool:
        return any(n.alive for n in self.nodes.values())

    # -- changes made by this client -------------------------------------------------

    def add_topic(self, namespace: str, topic: str, node: Node, now_ms: int) -> None:
        self.topics.setdefault(namespace, {})[topic] = node
        self._local[(namespace, topic)] = (node, now_ms + LOCAL_GRACE_MS)

    def remove_topic(self, namespace: str, topic: str) -> None:
        nodes = self.topics.get(namespace)
        if nodes is not None:
            nodes.pop(topic, None)
        self._local.pop((namespace, topic), None)

    def add_home(self, namespace: str, node: Node, now_ms: int) -> None:
        self.homes[namespace] = node
        self._local[(namespace, None)] = (node, now_ms + LOCAL_GRACE_MS)

    def remove_namespace(self, namespace: str) -> None:
        self.topics.pop(namespace, None)
        self.homes.pop(namespace, None)
        for key in [k for k in self._local if k[0] == namespace]:
            del self._local[key]

    # -- a nameserver's table ----------------------------------------------------------

    def apply(self, table: RouteTable, now_ms: int) -> list[NodeClient]:
        """Fold a table in; returns the clients replaced (a node now at another
        address), for the caller to close."""
        replaced: list[NodeClient] = []
        listed: set[str] = set()
        for status in table.nodes:
            if not status.alive:  # dead, still holding routed topics: routed to, down
                node = self.nodes.get(status.node_id)
                if node is None:
                    node = self.nodes[status.node_id] = Node(status, self._connect(status))
                    node.alive = False
                    log.info("storage node %s (down) at %s:%d", *_where(status))
                continue
            listed.add(status.node_id)
            node = self.nodes.get(status.node_id)
            if node is None:
                node = self.nodes[status.node_id] = Node(status, self._connect(status))
                log.info("storage node %s at %s:%d", *_where(status))
            elif (node.status.host, node.status.port) != (status.host, status.port):
                replaced.append(node.client)
                node.client = self._connect(status)
                node.synced_groups.clear()
                log.info("storage node %s moved to %s:%d", *_where(status))
            elif not node.alive:
                node.synced_groups.clear()  # configs set while it was away never reached it
                log.info("storage node %s is back", node.node_id)
            node.status = status
            node.alive = True
        for node in self.nodes.values():
            if node.alive and node.node_id not in listed:
                node.alive = False
                log.warning("storage node %s left the routes", node.node_id)
        topics: dict[str, dict[str, Node]] = {}
        for (namespace, topic), node_id in table.topics.items():
            holder = self.nodes.get(node_id)
            if holder is not None:
                topics.setdefault(namespace, {})[topic] = holder
        homes = {ns: self.nodes[n] for ns, n in table.homes.items() if n in self.nodes}
        # A down node's topics and homes stay routed to it (unless now held elsewhere).
        for namespace, by_topic in self.topics.items():
            for topic, node in by_topic.items():
                if not node.alive:
                    topics.setdefault(namespace, {}).setdefault(topic, node)
        for namespace, node in self.homes.items():
            if not node.alive:
                homes.setdefault(namespace, node)
        for key, (node, until) in list(self._local.items()):
            space, name = key
            named = homes.get(space) if name is None else topics.get(space, {}).get(name)
            if named is not None or until <= now_ms:
                del self._local[key]
            elif name is None:
                homes[space] = node
            else:
                topics.setdefault(space, {})[name] = node
        self.topics = topics
        self.homes = homes
        self.version = table.version
        return replaced


def _where(status: NodeStatus) -> tuple[str, str, int]:
    return status.node_id, status.host, status.port
