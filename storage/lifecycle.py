"""One shape for everything that starts, runs background tasks and stops.

The engine, the cluster client, storage nodes, nameservers, navigation, listeners and
protocol adapters all start work that outlives a call (flushers, heartbeats, timers,
tails). A task nobody awaits can outlive its owner, log "Task was destroyed but it is
pending", or keep a closed socket's buffers alive; so every such task belongs to one
:class:`TaskSet`, which its owner's close cancels and awaits. :class:`Service` adds the
async context manager every component is composed with (RocketMQ's
``appendStartAndShutdown``: started in order, stopped in reverse).

It sits at the bottom of the layers (beside the storage model) so that every layer may
use it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar

__all__ = ["Service", "TaskSet", "end_if_cancelled", "stop_task"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long a cancelled task may run on before it is cancelled again (see stop_task).
_CANCEL_AGAIN_S = 0.25


async def stop_task(task: asyncio.Task[Any], *, again_after: float = _CANCEL_AGAIN_S) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again each
    ``again_after`` seconds it runs on.

    One ``cancel()`` does not always stop a loop on Python 3.11: ``asyncio.wait_for``,
    with which nats-py awaits every request, returns the answer instead of raising
    when the cancellation arrives together with it (python/cpython#86296, fixed in
    3.12). A lease keeper cancelled that way renewed its lease for ever, and the
    shard it was handing back stayed with nobody serving it. ``await task`` would wait
    for such a task for ever; ``asyncio.wait`` does not pass the caller's own
    cancellation on to it either. Only for tasks whose cancellation needs no awaited
    clean-up: a second cancel interrupts one that is still running."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=again_after)
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s failed while stopping", task.get_name(), exc_info=task.exception())


def end_if_cancelled() -> None:
    """Raise ``CancelledError`` in a task that was asked to stop but runs on, its
    cancellation dropped on the way (see :func:`stop_task`). For the loops that own
    no clean-up and await NATS in their body, at the top of each round: a request to
    stop stays counted (``Task.cancelling()``) until someone withdraws it, which
    ``asyncio.timeout`` does only for its own."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class TaskSet:
    """Background tasks of one owner. A task that fails is logged with its name (it
    was nobody's to await); :meth:`close` cancels what is still running and waits for
    all of it, so after it returns nothing of the owner runs any more."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, _T], *, name: str | None = None) -> asyncio.Task[_T]:
        """Run ``coro`` in the background until it ends or the set closes."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner} is closed: no new background work")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("%s: background task %s failed", self._owner, task.get_name(), exc_info=error)

    async def close(self) -> None:
        """Cancel every task still running and wait for all of them; new spawns fail."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Service:
    """A component with ``start`` and ``close`` and the background tasks it spawned.

    Subclasses override :meth:`start` and :meth:`close` (calling ``super().close()``
    last, so their tasks stop after they stopped taking work); ``async with`` starts
    and closes them, closing again if the start failed halfway."""

    def __init__(self) -> None:
        self.tasks = TaskSet(type(self).__name__)

    async def start(self) -> None:
        """Nothing to start by default."""

    async def close(self) -> None:
        await self.tasks.close()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
