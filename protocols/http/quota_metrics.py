"""The per-account part of ``/metrics``: what each account produced, consumed and
asked, per protocol, how often and how long it was throttled, how many of its
connections were refused at its limit (gateway.quotas), and its open connections.

Counted for every account, with or without a quota, in this gateway process only
(quotas are per gateway, docs/quotas.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.quotas import Quotas

__all__ = ["QuotaCollector"]

_LABELS = ["account", "protocol"]
# name, help, QuotaUsage attribute, scale
_COUNTERS: tuple[tuple[str, str, str, float], ...] = (
    (
        "polymq_account_produce_bytes",
        "Bytes an account produced (request or body sizes).",
        "produce_bytes",
        1,
    ),
    (
        "polymq_account_consume_bytes",
        "Bytes handed to an account's consumers.",
        "consume_bytes",
        1,
    ),
    ("polymq_account_requests", "Requests (operations) of an account.", "requests", 1),
    (
        "polymq_account_throttled",
        "Requests that left an account over its quota (throttled or refused with 429/42900).",
        "throttled",
        1,
    ),
    (
        "polymq_account_throttle_seconds",
        "Throttle time asked of an account's clients, in all.",
        "throttle_ms",
        0.001,
    ),
    (
        "polymq_account_connections_refused",
        "Connections refused at the account's connection limit.",
        "refused",
        1,
    ),
)


class QuotaCollector(Collector):
    def __init__(self, quotas: Quotas, connections: ConnectionRegistry) -> None:
        self._quotas = quotas
        self._connections = connections

    def collect(self) -> Iterable[Metric]:
        usage = self._quotas.snapshot()
        for name, help_text, attr, scale in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=_LABELS)
            for u in usage:
                counter.add_metric([u.account, u.protocol], getattr(u, attr) * scale)
            yield counter
        open_per_account: Counter[tuple[str, str]] = Counter(
            (conn.principal.name, conn.protocol)
            for conn in self._connections.list()
            if conn.principal is not None
        )
        gauge = GaugeMetricFamily(
            "polymq_account_connections",
            "Open connections of an account (the ones its connection limit counts).",
            labels=_LABELS,
        )
        for (account, protocol), count in sorted(open_per_account.items()):
            gauge.add_metric([account, protocol], count)
        yield gauge
