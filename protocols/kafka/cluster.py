"""Which gateway plays which Kafka broker role, from the gateway directory.

Clients only ever see gateways (docs/architecture.md). Storage is shared, so any gateway
serves Produce and Fetch for any partition; but group membership, transactions and
idempotent-producer state live in one gateway's memory, so every member of a group
(every producer of a transactional id) must reach the same one. Each gateway computes
the same owner from the same directory list by rendezvous hashing
(:func:`gateway.directory.owner_of`), so FindCoordinator answers agree everywhere, and
a request that reaches a gateway which is not the key's owner gets NOT_COORDINATOR:
the client looks its coordinator up again (after the directory changed, say).

Partition leaders are spread the same way (``"<topic>/<partition>"``), so a client's
produce and fetch load spreads over the gateways; any gateway would serve them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polymq.navigation.endpoints import GatewayDirectory, GatewayEndpoint, owner_of

__all__ = ["ClusterView", "Node", "cluster_view"]

PROTOCOL = "kafka"


@dataclass(frozen=True, slots=True)
class Node:
    """One gateway as Kafka names it: a node id and where clients reach it."""

    node_id: int
    host: str
    port: int
    gateway_id: str


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The live gateways for one client (hosts resolved for its connection) and this
    gateway's place among them."""

    all: Sequence[Node]
    me: Node
    endpoints: Sequence[GatewayEndpoint]

    def owner(self, key: str) -> Node:
        """The gateway responsible for ``key`` (a group, a transactional id, a
        partition's leadership); this gateway when the directory lists no other."""
        endpoint = owner_of(key, self.endpoints)
        if endpoint is None:
            return self.me
        return next((b for b in self.all if b.gateway_id == endpoint.gateway_id), self.me)

    def owns(self, key: str) -> bool:
        return self.owner(key).gateway_id == self.me.gateway_id

    @property
    def controller(self) -> Node:
        return self.owner("controller")

    def leader(self, topic: str, partition: int) -> Node:
        return self.owner(f"{topic}/{partition}")


def cluster_view(directory: GatewayDirectory, advertised: tuple[str, int]) -> ClusterView:
    """Kafka's view of ``directory``. An endpoint with an empty host is reached at the
    host this client reached us on (the merged form does not know its public name).
    This gateway is always listed: at the address the client used if the directory
    does not list it for Kafka (yet)."""
    host, port = advertised
    endpoints = list(directory.endpoints(PROTOCOL))
    me_listed = any(e.gateway_id == directory.self_id for e in endpoints)
    if not me_listed:
        endpoints.append(GatewayEndpoint(gateway_id=directory.self_id, host=host, port=port))
    brokers = [
        Node(node_id=e.broker_id, host=e.host or host, port=e.port, gateway_id=e.gateway_id)
        for e in endpoints
    ]
    me = next(b for b in brokers if b.gateway_id == directory.self_id)
    return ClusterView(all=brokers, me=me, endpoints=endpoints)
