"""Per-tenant usage counters, per protocol.

Updated on every produce and consume, so they are plain ints in a dict: no locks (one
event loop), no labels objects, nothing allocated on the hot path once a
(namespace, protocol) pair has been seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Metering", "Usage", "render_prometheus"]


@dataclass(slots=True)
class _Counters:
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    connections: int = 0
    connections_total: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """One (namespace, protocol) pair's counters at snapshot time. ``connections`` is
    current; everything else only grows while the process lives."""

    namespace: str
    protocol: str
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    connections: int = 0
    connections_total: int = 0


# Called with (protocol, messages in, bytes in, messages out, bytes out) on every
# count: the connection registry's per-connection counts
# (ConnectionRegistry.count_traffic).
TrafficHook = Callable[[str, int, int, int, int], None]


class Metering:
    def __init__(self) -> None:
        self._counters: dict[tuple[str, str], _Counters] = {}
        self.per_connection: TrafficHook | None = None

    def _get(self, namespace: str, protocol: str) -> _Counters:
        key = (namespace, protocol)
        counters = self._counters.get(key)
        if counters is None:
            counters = self._counters[key] = _Counters()
        return counters

    def record_in(self, namespace: str, protocol: str, *, messages: int, nbytes: int) -> None:
        c = self._get(namespace, protocol)
        c.messages_in += messages
        c.bytes_in += nbytes
        if self.per_connection is not None:
            self.per_connection(protocol, messages, nbytes, 0, 0)

    def record_out(self, namespace: str, protocol: str, *, messages: int, nbytes: int) -> None:
        c = self._get(namespace, protocol)
        c.messages_out += messages
        c.bytes_out += nbytes
        if self.per_connection is not None:
            self.per_connection(protocol, 0, 0, messages, nbytes)

    def connection_opened(self, namespace: str, protocol: str) -> None:
        c = self._get(namespace, protocol)
        c.connections += 1
        c.connections_total += 1

    def connection_closed(self, namespace: str, protocol: str) -> None:
        self._get(namespace, protocol).connections -= 1

    def snapshot(self) -> list[Usage]:
        """Plain data, sorted by namespace then protocol, safe to keep or serialize."""
        return [
            Usage(
                namespace=ns,
                protocol=protocol,
                messages_in=c.messages_in,
                messages_out=c.messages_out,
                bytes_in=c.bytes_in,
                bytes_out=c.bytes_out,
                connections=c.connections,
                connections_total=c.connections_total,
            )
            for (ns, protocol), c in sorted(self._counters.items())
        ]


# name, type, help, Usage attribute
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("polymq_messages_in_total", "counter", "Messages accepted from producers.", "messages_in"),
    ("polymq_messages_out_total", "counter", "Messages delivered to consumers.", "messages_out"),
    ("polymq_bytes_in_total", "counter", "Message bytes accepted from producers.", "bytes_in"),
    ("polymq_bytes_out_total", "counter", "Message bytes delivered to consumers.", "bytes_out"),
    ("polymq_connections", "gauge", "Open client connections.", "connections"),
    (
        "polymq_connections_opened_total",
        "counter",
        "Client connections opened.",
        "connections_total",
    ),
)


def render_prometheus(usage: Iterable[Usage]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of a snapshot.

    Every metric family gets its HELP and TYPE lines even with no samples, so a
    scraper sees the same families from an idle server as from a busy one.
    """
    rows = list(usage)
    lines: list[str] = []
    for name, kind, help_text, attr in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for u in rows:
            labels = f'namespace="{_escape(u.namespace)}",protocol="{_escape(u.protocol)}"'
            lines.append(f"{name}{{{labels}}} {getattr(u, attr)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    # Label values escape backslash, double quote and line feed
    # (https://prometheus.io/docs/instrumenting/exposition_formats/#text-format-details).
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
