"""Which gateways are alive and where they listen: the navigation service's soft state.

Pure: no sockets, no clock; every call that depends on time takes ``now_ms``. Health is
decided when asked (heard from within the expiry), so nothing has to sweep: a gateway
that stops heartbeating drops out of the answers by itself, and its record is
forgotten a while later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polymq.navigation.endpoints import GatewayEndpoint

__all__ = ["GatewayRecord", "GatewayRegistry", "Listener"]

# A record silent this many expiries is forgotten (it stays listed as unhealthy until
# then, so an operator sees that a gateway went away).
_FORGET_AFTER_EXPIRIES = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class Listener:
    """One of a gateway's protocol listeners, as clients should dial it."""

    protocol: str
    host: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayRecord:
    gateway_id: str
    zone: str
    load: float
    listeners: tuple[Listener, ...]
    last_seen_ms: int

    def healthy(self, now_ms: int, expiry_ms: int) -> bool:
        return now_ms - self.last_seen_ms <= expiry_ms


class GatewayRegistry:
    """The gateways by id. A heartbeat replaces everything known about its gateway
    (a listener it no longer reports is gone at once)."""

    def __init__(self, *, gateway_expiry_ms: int = 10_000) -> None:
        if gateway_expiry_ms <= 0:
            raise ValueError("gateway_expiry_ms must be positive")
        self.expiry_ms = gateway_expiry_ms
        self._gateways: dict[str, GatewayRecord] = {}

    def heartbeat(
        self,
        *,
        gateway_id: str,
        zone: str,
        load: float,
        listeners: Sequence[Listener],
        now_ms: int,
    ) -> None:
        self._gateways[gateway_id] = GatewayRecord(
            gateway_id=gateway_id,
            zone=zone,
            load=load,
            listeners=tuple(listeners),
            last_seen_ms=now_ms,
        )
        self._forget(now_ms)

    def remove(self, gateway_id: str) -> bool:
        """A gateway stopping cleanly; whether it was known."""
        return self._gateways.pop(gateway_id, None) is not None

    def endpoints(self, protocol: str, now_ms: int, *, zone: str = "") -> list[GatewayEndpoint]:
        """Healthy gateways serving ``protocol``: those in ``zone`` first (clients stay
        in their network when they can), then least loaded first, then by id so every
        caller sees the same order."""
        found = [
            GatewayEndpoint(
                gateway_id=record.gateway_id,
                host=listener.host,
                port=listener.port,
                zone=record.zone,
                load=record.load,
            )
            for record in self._gateways.values()
            if record.healthy(now_ms, self.expiry_ms)
            for listener in record.listeners
            if listener.protocol == protocol
        ]
        found.sort(key=lambda e: (bool(zone) and e.zone != zone, e.load, e.gateway_id, e.port))
        return found

    def gateways(self, now_ms: int) -> list[GatewayRecord]:
        """Every gateway still remembered, healthy or not, by id."""
        self._forget(now_ms)
        return sorted(self._gateways.values(), key=lambda r: r.gateway_id)

    def _forget(self, now_ms: int) -> None:
        horizon = self.expiry_ms * _FORGET_AFTER_EXPIRIES
        stale = [g for g, r in self._gateways.items() if now_ms - r.last_seen_ms > horizon]
        for gateway_id in stale:
            del self._gateways[gateway_id]
