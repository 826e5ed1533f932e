"""The pool's routes: what storage nodes tell nameservers and what nameservers answer,
plain data that crosses the network in the storage RPC encoding (:mod:`storage.rpc`).
It sits with the storage model, below the nameserver that keeps it and the cluster
client that reads it.

All of it is soft state, as in RocketMQ's nameserver: a nameserver keeps only what the
latest heartbeats told it, so a restarted one is whole again after one heartbeat
interval, and several run side by side without talking to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeHeartbeat", "NodeStatus", "RouteTable", "TopicKey"]

TopicKey = tuple[str, str]  # (namespace, topic)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeHeartbeat:
    """A storage node's periodic report to every nameserver.

    ``topics``: every topic the node holds (internal ones included), so routes are
    rebuilt from heartbeats alone. ``homes``: namespaces whose namespace-wide data
    (protocol metadata, keyed latest values, group configs) the node keeps.
    ``load``: a unitless figure, higher is busier (placement picks the lowest).
    ``epoch``: in the replicated pool, the lease epoch of the shard's owner (the node
    id is the shard's): a heartbeat of a lower epoch than one already heard comes
    from a deposed owner and is ignored. 0 for an unreplicated node."""

    node_id: str
    host: str
    port: int
    topics: tuple[TopicKey, ...] = ()
    homes: tuple[str, ...] = ()
    load: float = 0.0
    disk_free_bytes: int = 0
    started_ms: int = 0
    epoch: int = 0
    owner: str = ""  # replicated pool: the storage process serving the shard


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatus:
    """A node as a nameserver last heard of it."""

    node_id: str
    host: str
    port: int
    load: float = 0.0
    disk_free_bytes: int = 0
    topic_count: int = 0
    last_seen_ms: int = 0
    alive: bool = True
    epoch: int = 0  # replicated pool: the owner's lease epoch, and the owner
    owner: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteTable:
    """Which node serves what. ``version`` grows with every change a gateway must
    see (a node joining, leaving or gaining a topic), so a gateway polls cheaply with
    the version it has. ``topics`` maps (namespace, topic) to the node holding all of
    the topic's queues; ``homes`` maps a namespace to the node keeping its
    namespace-wide data."""

    version: int
    nodes: tuple[NodeStatus, ...] = ()
    topics: dict[TopicKey, str] = field(default_factory=dict)
    homes: dict[str, str] = field(default_factory=dict)
