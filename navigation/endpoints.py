"""Where the gateways are: what Kafka Metadata/FindCoordinator and RocketMQ QueryRoute
answer, so clients only ever see gateways, never storage nodes (docs/architecture.md).

The merged form has one gateway, itself. The separated form asks the navigation
service (:mod:`navigation`), refreshed in the background, so handlers read it without
awaiting anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "CheckedDirectory",
    "GatewayDirectory",
    "GatewayEndpoint",
    "RegisteredDirectory",
    "SingleGateway",
    "owner_of",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayEndpoint:
    """One gateway's listener for one protocol. ``host`` empty: the address the client
    reached us on (the merged form does not know its public name)."""

    gateway_id: str
    host: str
    port: int
    zone: str = ""
    load: float = 0.0

    @property
    def broker_id(self) -> int:
        """A stable non-negative 31-bit number for protocols that name brokers by
        integer (Kafka node ids): the same gateway gets the same number everywhere."""
        digest = hashlib.blake2b(self.gateway_id.encode(), digest_size=4).digest()
        return int.from_bytes(digest) & 0x7FFFFFFF


@runtime_checkable
class GatewayDirectory(Protocol):
    """The live gateways per protocol. ``endpoints`` is synchronous (a cache), healthy
    gateways least loaded first, always including this gateway itself while it
    serves the protocol."""

    @property
    def self_id(self) -> str: ...

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]: ...


@runtime_checkable
class RegisteredDirectory(GatewayDirectory, Protocol):
    """A directory this gateway registers itself with: started once the listeners
    are bound, closed (deregistered) before they stop."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class CheckedDirectory(GatewayDirectory, Protocol):
    """A directory that can look at its peers now rather than at its next refresh
    (:meth:`navigation.directory.NavigationDirectory.check_peers`)."""

    async def check_peers(self, *, max_age_s: float, timeout_s: float) -> None: ...


class SingleGateway:
    """The merged form's directory: this gateway and no other."""

    def __init__(self, gateway_id: str, ports: dict[str, int], host: str = "") -> None:
        self._id = gateway_id
        self._ports = ports
        self._host = host

    @property
    def self_id(self) -> str:
        return self._id

    def set_port(self, protocol: str, port: int) -> None:
        """Record a listener's bound port (known only once it listens on port 0)."""
        self._ports[protocol] = port

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]:
        port = self._ports.get(protocol)
        if port is None:
            return ()
        return (GatewayEndpoint(gateway_id=self._id, host=self._host, port=port),)


def owner_of(key: str, endpoints: Sequence[GatewayEndpoint]) -> GatewayEndpoint | None:
    """The gateway responsible for ``key`` (a Kafka group or transactional id, a
    partition's leadership) by rendezvous hashing: every gateway computes the same
    answer from the same list, and when a gateway leaves, only its keys move."""
    best: GatewayEndpoint | None = None
    best_score = b""
    for endpoint in endpoints:
        score = hashlib.blake2b(f"{endpoint.gateway_id}\0{key}".encode(), digest_size=8).digest()
        if best is None or score > best_score:
            best, best_score = endpoint, score
    return best
