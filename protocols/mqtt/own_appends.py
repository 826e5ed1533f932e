"""Where this gateway's own MQTT publishes landed, so its tails need not read them.

A tail (topic_tail.py) follows a storage topic for what *other* protocols store there;
MQTT's own publishes were routed when they arrived and the tail drops them. Reading
them back only to drop them cost a decode and a ``StoredMessage`` per publish (about a
sixth of the server's CPU in a publish flood, see docs/mqtt.md, "CPU per message").
The router records the offsets its appends got in the storage topic's queue here, and
the tail jumps over them.

Nothing depends on it for correctness: an offset recorded here is one the tail would
have read and dropped (an MQTT publish of this gateway, stored with no copies owed),
and one not recorded (an append still in flight, a range dropped at the cap) is read
and dropped as before. Every storage topic's queue is recorded, followed or not (a
tail of a topic created after its filter starts late, from the topic's start): a run
of publishes is one range, and at most ``MAX_RANGES`` ranges per queue are kept. A
queue whose offsets may start again (its topic deleted, an offset out of range) is
forgotten.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterable

from polymq.storage.model import QueueRef

__all__ = ["MAX_RANGES", "OwnAppends"]

MAX_RANGES = 1024


class _Ranges:
    """Sorted, disjoint ``[start, end)`` offset ranges of one queue."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, offset: int) -> None:
        starts, ends = self.starts, self.ends
        if ends and ends[-1] == offset:  # the usual case: right after the last one
            ends[-1] = offset + 1
            return
        if not ends or offset >= ends[-1]:
            starts.append(offset)
            ends.append(offset + 1)
        else:  # appends answered out of order: keep them sorted and merged
            i = bisect.bisect_right(starts, offset)
            if i and ends[i - 1] > offset:
                return  # known already
            if i and ends[i - 1] == offset:
                ends[i - 1] = offset + 1
                if i < len(starts) and starts[i] == offset + 1:
                    ends[i - 1] = ends.pop(i)
                    starts.pop(i)
            elif i < len(starts) and starts[i] == offset + 1:
                starts[i] = offset
            else:
                starts.insert(i, offset)
                ends.insert(i, offset + 1)
        if len(starts) > MAX_RANGES:  # a tail that stopped pruning: forget the oldest
            del starts[0], ends[0]

    def skip(self, offset: int) -> tuple[int, int | None]:
        """``offset`` moved past the range holding it, ranges below dropped; and the
        start of the next range above (None: none known)."""
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(ends, offset)
        if i:
            del starts[:i], ends[:i]
        if starts and starts[0] <= offset:
            offset = ends[0]
            del starts[0], ends[0]
        return offset, (starts[0] if starts else None)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class OwnAppends:
    """Offsets of the router's own appends per followed queue, and which appends are
    still in flight (their offsets not known yet)."""

    def __init__(self) -> None:
        self._ranges: dict[QueueRef, _Ranges] = {}
        self._issued = 0
        self._pending: dict[int, None] = {}  # tickets in flight, oldest first
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    # -- the tails' side -----------------------------------------------------------

    def forget(self, queue: QueueRef) -> None:
        """The queue's offsets may have started again (the topic recreated)."""
        self._ranges.pop(queue, None)

    def skip(self, queue: QueueRef, offset: int) -> tuple[int, int | None]:
        """Where a tail at ``offset`` continues (past the own range holding it), and
        the first own offset after that (None: none known)."""
        ranges = self._ranges.get(queue)
        if ranges is None:
            return offset, None
        return ranges.skip(offset)

    @property
    def issued(self) -> int:
        """The last ticket handed out: :meth:`settled` of it waits for every append
        begun so far."""
        return self._issued

    async def settled(self, upto: int, timeout_s: float) -> None:
        """Until every append begun at or before ticket ``upto`` has recorded its
        offsets, or ``timeout_s`` passed (a slow append only costs the tail reading
        its messages)."""
        if not self._pending or next(iter(self._pending)) > upto:
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiters.append((upto, future))
        timer = loop.call_later(timeout_s, _settle, future)  # no task, as wait_for made
        try:
            await future
        finally:
            timer.cancel()
            if not future.done():
                future.cancel()

    # -- the router's side ---------------------------------------------------------

    def begin(self) -> int:
        """A ticket for an append about to start."""
        self._issued += 1
        self._pending[self._issued] = None
        return self._issued

    def end(self, ticket: int, placements: Iterable[tuple[QueueRef, int]] = ()) -> None:
        """The append of ``ticket`` answered (or failed: no placements): record where
        its publishes landed."""
        for queue, offset in placements:
            ranges = self._ranges.get(queue)
            if ranges is None:
                ranges = self._ranges[queue] = _Ranges()
            ranges.add(offset)
        self._pending.pop(ticket, None)
        if self._waiters:
            oldest = next(iter(self._pending)) if self._pending else None
            still = []
            for upto, future in self._waiters:
                if oldest is None or oldest > upto:
                    _settle(future)
                elif not future.done():  # a timed-out one is dropped here
                    still.append((upto, future))
            self._waiters = still
