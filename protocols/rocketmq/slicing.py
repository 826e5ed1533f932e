"""Slices of a request's items with the event loop handed back *between* them.

``gateway.fairness.slices`` hands the loop back after every slice, the last one too:
for a one-message send or a one-receipt ack (nearly every call the official clients
make) that is one more loop step per call, after the work is done and before the
answer goes out. Here the pause comes only before a further slice, so a one-slice
request answers without it and a big batch still shares the loop slice by slice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from polymq.gateway.fairness import SLICE, pause

__all__ = ["slices_between"]


async def slices_between(count: int, size: int = SLICE) -> AsyncIterator[slice]:
    """``slice`` objects covering ``range(count)`` ``size`` at a time, returning to the
    event loop before each slice after the first."""
    for start in range(0, count, size):
        if start:
            await pause()
        yield slice(start, start + size)
