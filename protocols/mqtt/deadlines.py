"""Coarse deadlines for many connections at once: the keep-alive of every MQTT
connection and the handshake deadline of every new TCP one.

One loop timer for all of them, not one per connection: a loop timer (a TimerHandle,
and under uvloop a libuv timer too) weighed about 500 bytes, and ``asyncio.timeout``
around each connection's read, rescheduled after every packet, as much again with its
context manager. Here a connection is one entry in the set of the tick its deadline
falls in; moving its deadline later (every packet) writes one float on the connection
and touches no set: when the tick comes, the connection says whether it is really due
(:meth:`Watched.due`) or when to look again, and is filed there.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

__all__ = ["Deadlines", "Watched"]

log = logging.getLogger(__name__)

TICK_S = 0.25  # how late a deadline may fire


class Watched(Protocol):
    # The tick it is filed under, kept by :class:`Deadlines` (so that a connection
    # that ends can be taken out without a map from connections to ticks).
    deadline_tick: int

    def due(self, now: float) -> float | None:
        """At ``now`` (loop time): act on the deadline and return ``None``, or
        return when to be asked again (a later deadline)."""
        ...


class _Bucket(set["Watched"]):
    """The items filed under one tick, and that tick: each item's ``deadline_tick`` is
    this one int, not an int of its own per connection (32 bytes each)."""

    __slots__ = ("tick",)

    def __init__(self, tick: int) -> None:
        super().__init__()
        self.tick = tick


class Deadlines:
    """Deadlines on loop time, to within :data:`TICK_S`."""

    __slots__ = ("_buckets", "_loop", "_next", "_timer")

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._next: int | None = None  # the tick the timer is set for

    def add(self, item: Watched, when: float) -> None:
        """Ask ``item`` at ``when`` (loop time) or up to a tick later; an item is
        filed once (add it again only once it was asked, or after :meth:`discard`)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a listener started again on another loop
            self._buckets.clear()
            self._timer = self._next = None
            self._loop = loop
        tick = math.ceil(when / TICK_S)
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = _Bucket(tick)
        item.deadline_tick = bucket.tick
        bucket.add(item)
        if self._next is None or tick < self._next:
            self._arm(tick)

    def discard(self, item: Watched) -> None:
        """Forget ``item`` (a connection that ended), if it is filed."""
        tick = item.deadline_tick
        bucket = self._buckets.get(tick)
        if bucket is not None:
            bucket.discard(item)
            if not bucket:
                del self._buckets[tick]

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    def _arm(self, tick: int) -> None:
        loop = self._loop
        assert loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._next = tick
        self._timer = loop.call_at(tick * TICK_S, self._fire)

    def _fire(self) -> None:
        assert self._loop is not None
        self._timer = self._next = None
        now = self._loop.time()
        current = math.floor((now + 0.005) / TICK_S)  # a timer may fire a hair early
        for tick in sorted(t for t in self._buckets if t <= current):
            for item in self._buckets.pop(tick):
                try:
                    again = item.due(now)
                except Exception:
                    log.exception("mqtt: a deadline failed")
                    continue
                if again is not None:
                    self.add(item, max(again, now + TICK_S))
        if self._buckets and self._next is None:
            self._arm(min(self._buckets))
