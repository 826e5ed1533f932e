"""``gateway.lazy_deadline``: the one timer per connection that Kafka's read deadlines
and the HTTP guard's head and body deadlines are kept by. On asyncio's loop and on
uvloop (which ``polymq run`` serves on, and whose timers count whole milliseconds).

What it must not get wrong: a deadline is never cut short (not at the timer's period,
not when a later one replaced it), never lost (a shorter one after a long one, one
started from the expiry callback), nothing fires once stopped or closed, and a
deadline no earlier than the timer arms no timer (the hot path's whole point). The
tests wait on an expiry or on the loop reaching a time they set, never sleep and hope."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
import uvloop

from polymq.gateway.lazy_deadline import LazyDeadline

TIMEOUT = 10.0  # far beyond every deadline here: reaching it means nothing fired
# How early a timer may run by the loop's clock: uvloop rounds delays to milliseconds.
EARLY = 0.005


class _Counting:
    """The loop, counting the timers armed through it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.armed = 0

    def time(self) -> float:
        return self.loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.armed += 1
        return self.loop.call_at(when, callback)


class _Watch:
    """A deadline over a counting loop, and the loop times its expiries came at."""

    def __init__(self, period: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.counting = _Counting(self.loop)
        self.expiries: list[float] = []
        self.expired = asyncio.Event()
        loop = cast(asyncio.AbstractEventLoop, self.counting)
        self.deadline = LazyDeadline(loop, self._on_expiry, period)

    def _on_expiry(self) -> None:
        self.expiries.append(self.loop.time())
        self.expired.set()

    def at(self, seconds: float) -> float:
        return self.loop.time() + seconds

    async def expiry(self) -> float:
        await asyncio.wait_for(self.expired.wait(), TIMEOUT)
        self.expired.clear()
        return self.expiries[-1]

    async def until(self, when: float) -> None:
        """Until the loop has run every timer due by ``when`` (loop time)."""
        reached = asyncio.Event()
        self.loop.call_at(when, reached.set)
        await asyncio.wait_for(reached.wait(), TIMEOUT)


LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _on_each_loop(
    scenario: Callable[[], Coroutine[Any, Any, None]],
) -> Callable[[LoopFactory], None]:
    """The test ``scenario``, run once on asyncio's loop and once on uvloop's."""

    @pytest.mark.parametrize(
        "loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
    )
    def test(loop_factory: LoopFactory) -> None:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(scenario())

    test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
    return test


@_on_each_loop
async def test_a_deadline_longer_than_the_period_is_kept_to_the_end() -> None:
    watch = _Watch(period=0.02)
    due = watch.at(0.15)
    watch.deadline.start(due)
    assert await watch.expiry() >= due - EARLY
    assert watch.counting.armed >= 3  # moved on at each period, never cut short


@_on_each_loop
async def test_a_later_deadline_replacing_one_is_not_cut_short() -> None:
    """A request met its deadline and the next one began: the timer, armed for the
    first, finds the second not yet due and waits on for it."""
    watch = _Watch(period=0.05)
    watch.deadline.start(watch.at(0.05))
    due = watch.at(0.2)
    watch.deadline.start(due)
    assert await watch.expiry() >= due - EARLY
    assert len(watch.expiries) == 1


@_on_each_loop
async def test_a_short_deadline_after_a_long_one_moves_no_timer() -> None:
    """Kafka's frame deadline after an idle wait: the timer, capped at the period (the
    shortest timeout), already fires first, and the short deadline is still kept."""
    watch = _Watch(period=0.05)
    long_due = watch.at(TIMEOUT * 10)
    watch.deadline.start(long_due)
    assert watch.counting.armed == 1
    due = watch.at(0.05)
    watch.deadline.start(due)
    assert watch.counting.armed == 1
    assert due - EARLY <= await watch.expiry() < long_due


@_on_each_loop
async def test_an_earlier_deadline_than_the_timer_moves_it() -> None:
    """A timeout shorter than the period (an HTTP head timeout longer than the body's,
    were the period the longer) moves the timer at once: it is not kept late."""
    watch = _Watch(period=TIMEOUT * 10)
    long_due = watch.at(TIMEOUT * 5)
    watch.deadline.start(long_due)
    due = watch.at(0.05)
    watch.deadline.start(due)
    assert watch.counting.armed == 2
    fired = await watch.expiry()
    assert due - EARLY <= fired < long_due


@_on_each_loop
async def test_steady_deadlines_arm_one_timer_a_period() -> None:
    """Requests met within their deadline, several to a period: the timer is armed
    about once a period (each timer runs a period at least), not once a request."""
    period = 0.05
    watch = _Watch(period)
    began = watch.loop.time()
    for _ in range(40):
        watch.deadline.start(watch.at(period))
        await asyncio.sleep(0.005)  # the request under way
        watch.deadline.stop()
    periods = (watch.loop.time() - began) / (period - EARLY)
    assert not watch.expiries
    assert watch.counting.armed <= periods + 2, (watch.counting.armed, periods)


@_on_each_loop
async def test_nothing_fires_once_stopped_or_closed() -> None:
    stopped, closed = _Watch(period=0.05), _Watch(period=0.05)
    due = stopped.at(0.05)
    stopped.deadline.start(due)
    closed.deadline.start(due)
    stopped.deadline.stop()
    closed.deadline.close()
    closed.deadline.start(due)  # a closed deadline's timer calls nobody back
    await stopped.until(due + 0.1)
    assert not stopped.expiries and not closed.expiries
    assert stopped.counting.armed == 1  # found nothing due: not armed again
    closed.deadline.close()


@_on_each_loop
async def test_the_expiry_may_start_the_next_deadline() -> None:
    loop = asyncio.get_running_loop()
    dues: list[float] = []
    fired: list[float] = []
    done = asyncio.Event()

    def on_expiry() -> None:
        fired.append(loop.time())
        if len(fired) < 3:
            dues.append(loop.time() + 0.03)
            deadline.start(dues[-1])
        else:
            done.set()

    deadline = LazyDeadline(loop, on_expiry, 0.02)
    dues.append(loop.time() + 0.03)
    deadline.start(dues[0])
    await asyncio.wait_for(done.wait(), TIMEOUT)
    assert len(fired) == 3
    assert all(f >= due - EARLY for f, due in zip(fired, dues, strict=True))
    deadline.close()


def test_a_period_that_would_spin_the_loop_is_refused() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for period in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError):
                LazyDeadline(loop, lambda: None, period)

    asyncio.run(scenario())
