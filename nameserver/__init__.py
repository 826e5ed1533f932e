"""The nameserver (``polymq nameserver``): which storage node serves what, kept as soft
state from the nodes' heartbeats (RocketMQ's NameServer). See docs/cluster.md.

:mod:`storage.routes` is the data on the wire, :mod:`nameserver.registry` the pure
state, :mod:`nameserver.server` the process (``Nameserver``, ``serve_nameserver``) and
:mod:`nameserver.client` how nodes and gateways reach it (``NameserverClient``).

Only the pure modules are imported here: the storage RPC codec imports
:mod:`storage.routes` to register its types, and the client and server import the
RPC, so importing them from this package would make a cycle.
"""

from polymq.nameserver.registry import Registry
from polymq.storage.routes import NodeHeartbeat, NodeStatus, RouteTable, TopicKey

__all__ = ["NodeHeartbeat", "NodeStatus", "Registry", "RouteTable", "TopicKey"]
