"""Where the gateways are, as the gateway's protocols see it: the model lives with the
navigation service that answers it (:mod:`navigation.endpoints`); re-exported here for
the protocols, which reach it through their listener context."""

from __future__ import annotations

from polymq.navigation.endpoints import (
    GatewayDirectory,
    GatewayEndpoint,
    RegisteredDirectory,
    SingleGateway,
    owner_of,
)

__all__ = [
    "GatewayDirectory",
    "GatewayEndpoint",
    "RegisteredDirectory",
    "SingleGateway",
    "owner_of",
]
