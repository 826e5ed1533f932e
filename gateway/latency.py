"""Latency histograms the processor keeps per protocol, for ``/metrics``: how long an
append took to be acknowledged by storage (publish to acknowledge, fsync included
with ``sync`` durability), and how long a message had been stored when it was
delivered (the queueing part of end-to-end latency).

Kept as plain bucket counts, with no Prometheus types, because the processor sits
below the HTTP layer that renders them; observing is one bisect and two additions,
cheap enough for every append. The counting itself is the storage engine's
(``storage/engine/stats.py``), shared with the commit log's fsync figures.
"""

from __future__ import annotations

from polymq.storage.engine.stats import FSYNC_BUCKETS_S, Histograms, HistogramSnapshot

__all__ = ["APPEND_BUCKETS_S", "DELIVERY_BUCKETS_S", "HistogramSnapshot", "Histograms"]

# Upper bounds in seconds: an fsync is ~0.1-1 ms on a good disk, a cluster hop adds ~1 ms.
# The storage engine's fsync and group-commit bounds, so the three compare bucket by bucket.
APPEND_BUCKETS_S: tuple[float, ...] = FSYNC_BUCKETS_S
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
