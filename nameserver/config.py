"""``[nameserver]``: the nameserver's own settings. The composition root reads them
from the one configuration file and hands them over; the nameserver itself never
reads the gateway's configuration."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NameserverConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NameserverConfig:
    port: int = 9876
    # A node silent this long is dropped from routes (RocketMQ: 120 s at 30 s beats).
    node_expiry_ms: int = 10_000
