"""A connection's deadline under way, kept by one loop timer that is moved lazily.

A connection's reads (Kafka) or requests (HTTP) each run under a deadline that almost
never passes, set and cleared several times a request. A loop timer armed and
cancelled for each (``asyncio.timeout``, or ``call_at`` and ``cancel``) cost about
8 µs a time on uvloop (three ``getpid`` calls among them: Python 3.11's
``get_running_loop`` checks the pid), some 5 % of a message's CPU at 1,000 msgs/s.
Here a deadline is a float written when it starts and cleared when it is met; the one
timer looks at it when it fires, and either finds it passed or moves on towards it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

__all__ = ["LazyDeadline"]


def _gone() -> None:
    """The callback of a closed deadline."""


class LazyDeadline:
    """At most one deadline at a time (loop time), and the one timer that keeps it.

    The timer fires no later than the deadline and at most ``period`` s after it was
    armed. With ``period`` the shortest timeout its owner starts, a new deadline is
    never earlier than the timer: :meth:`start` writes a float and moves nothing, even
    for a short deadline after a long one (a frame's after an idle wait), and the timer
    fires about once a period while deadlines keep being met. A deadline earlier than
    the timer still moves it, so none is ever kept late.

    ``on_expiry`` is called from the timer once the deadline under way has passed, the
    deadline already cleared (it may start the next one). ``loop`` is the loop whose
    ``time()`` deadlines are given in (public: the owner's hot path reads it here)."""

    __slots__ = ("_at", "_on_expiry", "_period", "_timer", "_when", "loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None], period: float
    ) -> None:
        if not period > 0:
            raise ValueError(f"period must be positive, got {period}")  # else it spins
        self.loop = loop
        self._on_expiry = on_expiry
        self._period = period
        self._at: float | None = None  # the deadline under way; None: nothing is due
        self._timer: asyncio.TimerHandle | None = None
        self._when = math.inf  # when the timer fires (inf: not armed)

    def start(self, at: float) -> None:
        """From now, ``at`` (loop time) is due, in place of any deadline under way."""
        self._at = at
        if at < self._when:
            self._arm(min(at, self.loop.time() + self._period))

    def stop(self) -> None:
        """Nothing is due (the timer, if it fires, finds nothing and is not re-armed)."""
        self._at = None

    def close(self) -> None:
        """The owner ends: nothing must be called back after it, and the callback (its
        own method, as a rule) is let go so that no cycle outlives it."""
        self._at = None
        self._on_expiry = _gone
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._when = math.inf

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._when = when
        self._timer = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, when, self._when = None, self._when, math.inf
        at = self._at
        if at is None:
            return  # nothing due: the next start arms the timer again
        if at <= when:  # armed for this very deadline (not loop.time(): it may fire early)
            self._at = None
            self._on_expiry()
        else:
            self._arm(min(at, self.loop.time() + self._period))
