"""The one task set and service shape every component uses."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from polymq.storage.lifecycle import Service, TaskSet, end_if_cancelled, stop_task


async def test_close_cancels_and_awaits_every_task() -> None:
    tasks = TaskSet("owner")
    stopped: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(name)

    spawned = [tasks.spawn(forever(name)) for name in ("a", "b")]
    await asyncio.sleep(0)
    assert len(tasks) == 2
    await tasks.close()
    assert sorted(stopped) == ["a", "b"]
    assert all(t.done() for t in spawned)
    assert len(tasks) == 0


async def test_finished_tasks_leave_the_set() -> None:
    tasks = TaskSet("owner")
    task = tasks.spawn(asyncio.sleep(0, result=7))
    assert await task == 7
    await asyncio.sleep(0)
    assert len(tasks) == 0


async def test_a_failed_task_is_logged_with_its_owner(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet("the-owner")

    async def boom() -> None:
        raise ValueError("bad")

    with caplog.at_level(logging.ERROR, logger="polymq.storage.lifecycle"):
        task = tasks.spawn(boom(), name="boom-task")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    [record] = [r for r in caplog.records if "boom-task" in r.getMessage()]
    assert "the-owner" in record.getMessage()
    assert record.exc_info is not None


async def test_no_spawn_after_close() -> None:
    tasks = TaskSet("owner")
    await tasks.close()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closed"):
        tasks.spawn(coro)


class _Flaky(Service):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.closed = False

    async def start(self) -> None:
        self.tasks.spawn(asyncio.Event().wait())
        if self.fail:
            raise OSError("cannot bind")

    async def close(self) -> None:
        self.closed = True
        await super().close()


async def test_service_closes_when_its_start_fails() -> None:
    service = _Flaky(fail=True)
    with pytest.raises(OSError):
        async with service:
            pass
    assert service.closed and len(service.tasks) == 0


async def test_service_context_closes_its_tasks() -> None:
    async with _Flaky(fail=False) as service:
        assert len(service.tasks) == 1
    assert service.closed and len(service.tasks) == 0


# -- stopping a task that lost its cancellation ------------------------------------


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps cancellations since 3.12")
async def test_wait_for_drops_a_cancellation_that_arrives_with_the_answer() -> None:
    """Why ``stop_task`` exists (python/cpython#86296): one cancel, and the loop goes on."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[int] = loop.create_future()
    rounds = 0

    async def renewing() -> None:
        nonlocal rounds
        await asyncio.wait_for(answer, 10)
        rounds += 1
        await asyncio.Event().wait()  # "the next renewal": only a second cancel ends it

    task = loop.create_task(renewing())
    await asyncio.sleep(0)  # the task waits in wait_for
    answer.set_result(1)
    task.cancel()  # in the same step as the answer
    for _ in range(5):
        await asyncio.sleep(0)
    assert rounds == 1 and not task.done()
    task.cancel()
    await asyncio.wait((task,))


async def test_stop_task_stops_a_task_that_swallowed_its_first_cancel() -> None:
    loop = asyncio.get_running_loop()
    answers: list[asyncio.Future[int]] = []
    rounds = 0

    async def renewing() -> None:
        nonlocal rounds
        while True:
            answers.append(loop.create_future())
            await asyncio.wait_for(answers[-1], 10)
            rounds += 1
            await asyncio.sleep(0.01)

    task = loop.create_task(renewing())
    await asyncio.sleep(0)
    answers[-1].set_result(1)
    task.cancel()  # the cancellation arrives with the answer: on 3.11, lost
    async with asyncio.timeout(10) as guard:  # the old ``await task`` hangs here
        await stop_task(task, again_after=0.05)
    assert not guard.expired() and task.cancelled()


async def test_stop_task_logs_a_task_that_failed_as_it_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("broke while stopping") from None

    task = asyncio.get_running_loop().create_task(failing_on_cancel(), name="the-task")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="polymq.storage.lifecycle"):
        await stop_task(task)
    [record] = [r for r in caplog.records if "the-task" in r.getMessage()]
    assert record.exc_info is not None and "broke while stopping" in str(record.exc_info[1])


async def test_a_loop_that_checks_ends_although_its_cancel_was_dropped() -> None:
    loop = asyncio.get_running_loop()
    tasks = TaskSet("owner")
    answers: list[asyncio.Future[int]] = []

    async def checkpointing() -> None:
        while True:
            end_if_cancelled()
            await asyncio.sleep(0.01)
            answers.append(loop.create_future())
            await asyncio.wait_for(answers[-1], 10)

    task = tasks.spawn(checkpointing())
    async with asyncio.timeout(10):
        while not answers:
            await asyncio.sleep(0.001)
    answers[-1].set_result(1)
    async with asyncio.timeout(10) as guard:  # without the check: the sleep is never cut
        await tasks.close()  # cancels in the same step as the answer
    assert not guard.expired() and task.cancelled()
