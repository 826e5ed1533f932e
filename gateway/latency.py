"""Latency histograms the processor keeps per protocol, for ``/metrics``: how long an
append took to be acknowledged by storage (publish to acknowledge, fsync included
with ``sync`` durability), and how long a message had been stored when it was
delivered (the queueing part of end-to-end latency).

Kept here as plain bucket counts, with no Prometheus types, because the processor
sits below the HTTP layer that renders them; observing is one bisect and two
additions, cheap enough for every append.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["APPEND_BUCKETS_S", "DELIVERY_BUCKETS_S", "HistogramSnapshot", "Histograms"]

# Upper bounds in seconds: an fsync is ~0.1-1 ms on a good disk, a cluster hop adds ~1 ms.
APPEND_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
)
# A message may wait for a consumer for hours.
DELIVERY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
    30.0,
    60.0,
    300.0,
    3600.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last one is +Inf), and the sum."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    total: float


@dataclass(slots=True)
class _Counts:
    per_bucket: list[int]
    total: float = 0.0


@dataclass(slots=True)
class Histograms:
    """One histogram per label (a protocol) over the same bucket bounds."""

    bounds: tuple[float, ...]
    _by_label: dict[str, _Counts] = field(default_factory=dict)

    def observe(self, label: str, seconds: float) -> None:
        counts = self._by_label.get(label)
        if counts is None:
            counts = self._by_label[label] = _Counts([0] * (len(self.bounds) + 1))
        counts.per_bucket[bisect.bisect_left(self.bounds, seconds)] += 1
        counts.total += seconds

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        result = {}
        for label, counts in self._by_label.items():
            cumulative = 0
            buckets = []
            for bound, n in zip((*self.bounds, float("inf")), counts.per_bucket, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            result[label] = HistogramSnapshot(tuple(buckets), cumulative, counts.total)
        return result
