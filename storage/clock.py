"""Injected time, so visibility timeouts, delays and TTLs are testable without sleeping.

Deadlines that outlive a restart (invisibility, delivery time) are wall-clock epoch
milliseconds; both clocks below speak only that.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now_ms(self) -> int: ...

    async def sleep_until(self, deadline_ms: int) -> None:
        """Return once ``now_ms() >= deadline_ms`` (cancellable)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep_until(self, deadline_ms: int) -> None:
        delay = deadline_ms - self.now_ms()
        if delay > 0:
            await asyncio.sleep(delay / 1000)


class ManualClock:
    """A clock that moves only when a test calls :meth:`advance`; sleepers wake then."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._changed = asyncio.Event()

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self._now += ms
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def sleep_until(self, deadline_ms: int) -> None:
        while self._now < deadline_ms:
            await self._changed.wait()
