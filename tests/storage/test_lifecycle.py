"""The one task set and service shape every component uses."""

from __future__ import annotations

import asyncio
import logging

import pytest

from polymq.storage.lifecycle import Service, TaskSet


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
