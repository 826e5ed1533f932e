"""What the commit log measures of its own work, for ``/metrics`` (docs/metrics.md):
how long each fsync took, how long a group commit made its appends wait, and how many
fsyncs, records and bytes it wrote.

Kept as plain counts with no Prometheus types, since the engine sits below every
exposition (the gateway's ``/metrics`` in the merged form, a storage process's own
endpoint in the separated form: ``storage/node_metrics.py``). Observing is one bisect
and two additions. The commit log observes once per group commit or per fsync, never
per append, so measuring adds no lock and no allocation to an append.

A :class:`Histogram` is written by one thread at a time (the fsync thread, or the
loop) and read by the loop: its bucket list never changes size, so a read racing a
write can only see a count one behind, never a broken structure.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = [
    "COMMIT_BUCKETS_S",
    "FSYNC_BUCKETS_S",
    "Histogram",
    "HistogramSnapshot",
    "Histograms",
    "LogStats",
]

# Upper bounds in seconds: an fsync is ~0.1-1 ms on a good disk and tens of ms on a
# busy or network disk; a group commit adds the wait for the fsync before it.
FSYNC_BUCKETS_S: tuple[float, ...] = (
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
COMMIT_BUCKETS_S = FSYNC_BUCKETS_S


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last one is +Inf), and the sum."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    total: float


class Histogram:
    """One series over fixed bucket bounds."""

    __slots__ = ("bounds", "per_bucket", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.per_bucket = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.per_bucket[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> HistogramSnapshot:
        cumulative = 0
        buckets = []
        for bound, n in zip((*self.bounds, float("inf")), list(self.per_bucket), strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        return HistogramSnapshot(tuple(buckets), cumulative, self.total)


@dataclass(slots=True)
class Histograms:
    """One histogram per label value (a protocol, a shard) over the same bounds.
    Observed on the event loop only (a new label grows the dict)."""

    bounds: tuple[float, ...]
    _by_label: dict[str, Histogram] = field(default_factory=dict)

    def observe(self, label: str, seconds: float) -> None:
        histogram = self._by_label.get(label)
        if histogram is None:
            histogram = self._by_label[label] = Histogram(self.bounds)
        histogram.observe(seconds)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {label: h.snapshot() for label, h in list(self._by_label.items())}


class LogStats:
    """One commit log's figures since it was opened.

    - ``fsync``: each ``fdatasync`` of a segment, timed in the fsync thread (its count
      is the number of fsyncs);
    - ``commit``: each group commit that asked for durability, from the moment its
      first record was queued to the moment the group was durable (with a replicated
      log, JetStream's acknowledgement included): the longest wait of any append in
      that group, counted once per group;
    - ``records`` and ``bytes``: records written and their framed bytes.
    """

    __slots__ = ("bytes", "commit", "fsync", "records")

    def __init__(self) -> None:
        self.fsync = Histogram(FSYNC_BUCKETS_S)
        self.commit = Histogram(COMMIT_BUCKETS_S)
        self.records = 0
        self.bytes = 0
