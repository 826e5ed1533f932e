"""Latency percentiles, computed one way for every benchmark so their p50/p99 columns
compare."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["p50_p99_ms", "percentile"]


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0.0 if empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def p50_p99_ms(latencies_s: Iterable[float]) -> tuple[float, float]:
    """The median and 99th percentile, in milliseconds, of latencies in seconds."""
    ordered = sorted(latencies_s)
    return percentile(ordered, 0.50) * 1000, percentile(ordered, 0.99) * 1000
