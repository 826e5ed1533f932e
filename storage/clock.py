"""Injected time, so visibility timeouts, delays and TTLs are testable without sleeping.

Deadlines that outlive a restart (invisibility, delivery time) are wall-clock epoch
milliseconds; both clocks below speak only that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now_ms(self) -> int: ...

    async def sleep_until(self, deadline_ms: int) -> None:
        """Return once ``now_ms() >= deadline_ms`` (cancellable)."""
        ...

    def wake_at(self, deadline_ms: int, future: asyncio.Future[None]) -> Callable[[], None]:
        """Resolve ``future`` once ``now_ms() >= deadline_ms`` unless it is done by then;
        returns what stops that. A long poll waits on one future this way, where a
        sleeping task beside it would cost a task and an ``asyncio.wait`` per wake-up."""
        ...


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep_until(self, deadline_ms: int) -> None:
        delay = deadline_ms - self.now_ms()
        if delay > 0:
            await asyncio.sleep(delay / 1000)

    def wake_at(self, deadline_ms: int, future: asyncio.Future[None]) -> Callable[[], None]:
        delay = max(0, deadline_ms - self.now_ms())
        return future.get_loop().call_later(delay / 1000, _resolve, future).cancel


class ManualClock:
    """A clock that moves only when a test calls :meth:`advance`; sleepers wake then."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._changed = asyncio.Event()
        self._alarms: list[tuple[int, asyncio.Future[None]]] = []

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self._now += ms
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        due = [alarm for alarm in self._alarms if alarm[0] <= self._now]
        self._alarms = [alarm for alarm in self._alarms if alarm[0] > self._now]
        for _, future in due:
            _resolve(future)

    async def sleep_until(self, deadline_ms: int) -> None:
        while self._now < deadline_ms:
            await self._changed.wait()

    def wake_at(self, deadline_ms: int, future: asyncio.Future[None]) -> Callable[[], None]:
        if deadline_ms <= self._now:
            _resolve(future)
            return lambda: None
        alarm = (deadline_ms, future)
        self._alarms.append(alarm)

        def stop() -> None:
            if alarm in self._alarms:
                self._alarms.remove(alarm)

        return stop
