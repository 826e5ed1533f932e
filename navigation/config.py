"""``[navigation]``: the navigation service's own settings, handed over by the
composition root (the service never reads the gateway's configuration)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NavigationConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NavigationConfig:
    port: int = 8090
    # A gateway silent this long is no longer offered to clients.
    gateway_expiry_ms: int = 10_000
