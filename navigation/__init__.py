"""The navigation service (``polymq navigation``): where the gateways are, per protocol
and zone, least loaded first (docs/architecture.md, docs/cluster.md).

:mod:`navigation.registry` is the pure state, :mod:`navigation.app` the HTTP API,
:mod:`navigation.server` the process and :mod:`navigation.directory` a gateway's
cached view of it (``NavigationDirectory``).
"""

from polymq.navigation.registry import GatewayRecord, GatewayRegistry, Listener

__all__ = ["GatewayRecord", "GatewayRegistry", "Listener"]
