"""Both clocks' alarms: a long poll's one future is resolved at its deadline, not
before, and an alarm stopped in time never resolves it."""

from __future__ import annotations

import asyncio

from polymq.storage.clock import ManualClock, SystemClock


async def test_a_manual_alarm_rings_when_the_clock_reaches_it() -> None:
    clock = ManualClock()
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    clock.wake_at(clock.now_ms() + 1_000, future)
    clock.advance(999)
    assert not future.done()
    clock.advance(1)
    assert future.done()


async def test_a_stopped_manual_alarm_never_rings() -> None:
    clock = ManualClock()
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop = clock.wake_at(clock.now_ms() + 1_000, future)
    stop()
    clock.advance(5_000)
    assert not future.done()


async def test_a_manual_alarm_already_due_rings_at_once() -> None:
    clock = ManualClock()
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    clock.wake_at(clock.now_ms(), future)
    assert future.done()


async def test_a_system_alarm_rings_and_a_stopped_one_does_not() -> None:
    """Timers fire in deadline order, so once the later alarm rang, the stopped earlier
    one would have rung too: no sleeping and hoping."""
    clock, loop = SystemClock(), asyncio.get_running_loop()
    stopped: asyncio.Future[None] = loop.create_future()
    ringing: asyncio.Future[None] = loop.create_future()
    clock.wake_at(clock.now_ms() + 10, stopped)()
    clock.wake_at(clock.now_ms() + 30, ringing)
    await asyncio.wait_for(ringing, 10)
    assert not stopped.done()


async def test_an_alarm_leaves_a_future_resolved_elsewhere_alone() -> None:
    clock, loop = SystemClock(), asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        woken: asyncio.Future[None] = loop.create_future()
        later: asyncio.Future[None] = loop.create_future()
        clock.wake_at(clock.now_ms(), woken)
        woken.cancel()  # the long poll ended another way first
        clock.wake_at(clock.now_ms() + 20, later)
        await asyncio.wait_for(later, 10)  # by now the first alarm has run
    finally:
        loop.set_exception_handler(None)
    assert woken.cancelled()
    assert errors == []
