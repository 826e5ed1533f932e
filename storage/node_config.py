"""``[node]``: a storage node's own settings, handed over by the composition root (the
node never reads the gateway's configuration)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """``polymq storage``: a storage node serving the embedded engine to gateways."""

    port: int = 10911
    node_id: str = ""  # empty: the engine's own id, kept in its data directory
    # Its own Prometheus /metrics (docs/metrics.md): unset, none; 0, any free port.
    metrics_port: int | None = None
