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

A gateway that leaves the directory (it died, or stopped) stays in the brokers list
of Metadata for a few seconds more, leading nothing (:class:`DepartedBrokers`): the
client then moves its partitions to their new leaders while it still knows the old
broker. Dropping the broker in the same answer that moves its partitions makes
librdkafka decommission it, and the decommissioning undoes the move it raced with:
the partitions wait for the client's next re-query, a second later (measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polymq.navigation.endpoints import GatewayDirectory, GatewayEndpoint, owner_of

__all__ = ["ClusterView", "DepartedBrokers", "Node", "cluster_view"]

PROTOCOL = "kafka"
# Long enough for a producing client to re-query (librdkafka asks within 100 ms of a
# lost connection, and every second while a partition has no leader), short enough
# that clients do not try a dead address for long.
DEPARTED_LINGER_S = 5.0


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
    # Gateways that left the directory moments ago: listed as brokers, owning nothing.
    departed: Sequence[Node] = ()

    @property
    def listed(self) -> Sequence[Node]:
        """The brokers a Metadata answer names: the live ones, then the departed."""
        return (*self.all, *self.departed)

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


@dataclass
class DepartedBrokers:
    """The gateways that left the directory since the last view, each listed for
    ``linger_s`` from the view that first missed it (one per Kafka listener)."""

    linger_s: float = DEPARTED_LINGER_S
    clock: Callable[[], float] = time.monotonic
    _live: dict[str, GatewayEndpoint] = field(default_factory=dict)
    _gone: dict[str, tuple[GatewayEndpoint, float]] = field(default_factory=dict)

    def note(self, live: Sequence[GatewayEndpoint]) -> list[GatewayEndpoint]:
        """Take ``live`` as the gateways now; those departed within ``linger_s``."""
        now = self.clock()
        current = {e.gateway_id: e for e in live}
        for gateway_id, endpoint in self._live.items():
            if gateway_id not in current:
                self._gone.setdefault(gateway_id, (endpoint, now))
        self._live = current
        for gateway_id, (_, since) in list(self._gone.items()):
            if gateway_id in current or now - since > self.linger_s:
                del self._gone[gateway_id]
        return [endpoint for _, (endpoint, _) in sorted(self._gone.items())]


def cluster_view(
    directory: GatewayDirectory,
    advertised: tuple[str, int],
    departed: DepartedBrokers | None = None,
    *,
    listener: str = PROTOCOL,
) -> ClusterView:
    """Kafka's view of ``directory``. An endpoint with an empty host is reached at the
    host this client reached us on (the merged form does not know its public name).
    This gateway is always listed: at the address the client used if the directory
    does not list it for Kafka (yet). ``listener`` names whose endpoints: a client of
    the TLS listener (``kafka_tls``) is told the gateways' TLS ports."""
    host, port = advertised
    endpoints = list(directory.endpoints(listener))
    me_listed = any(e.gateway_id == directory.self_id for e in endpoints)
    if not me_listed:
        endpoints.append(GatewayEndpoint(gateway_id=directory.self_id, host=host, port=port))

    def node(e: GatewayEndpoint) -> Node:
        return Node(node_id=e.broker_id, host=e.host or host, port=e.port, gateway_id=e.gateway_id)

    brokers = [node(e) for e in endpoints]
    me = next(b for b in brokers if b.gateway_id == directory.self_id)
    gone = departed.note(endpoints) if departed is not None else ()
    return ClusterView(all=brokers, me=me, endpoints=endpoints, departed=[node(e) for e in gone])
