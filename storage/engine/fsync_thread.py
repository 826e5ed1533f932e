"""The commit log's fsync thread: one long-lived thread that fsyncs what the event
loop asks for and tells the loop once per completed fsync.

Why not ``loop.run_in_executor`` per fsync: each call paid a future, a work item, a
queue put and get, a wake-up of the worker and one of the loop, even when the
previous fsync was still running (measured: ``ThreadPoolExecutor.submit`` alone was a
fifth of the loop's samples at 1,000 msgs/s, docs/performance.md). Here the loop only
adds to a request under a lock and notifies; every request made while an fsync runs
is coalesced into the next one, which the thread starts as soon as the previous ends,
without going back to the loop in between; and the loop is woken once per completed
fsync (``call_soon_threadsafe``), whatever the number of requests it covered.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["FsyncThread"]

T = TypeVar("T")

# (generation, end, error): the last request covered, the log position it asked to
# make durable, and the exception that stopped the thread (None if it succeeded).
Done = Callable[[int, int, BaseException | None], None]


class FsyncThread(Generic[T]):
    """Runs ``sync(items, directory)`` in one thread for every coalesced request.

    ``request`` is called on the loop; ``done`` runs on the loop after each sync with
    the newest request's generation and end. Requests are served in order: a sync
    starts only after the previous one returned, so a completed generation covers
    every request made before it. After an error the thread stops; the owner fails."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sync: Callable[[list[T], bool], None],
        done: Done,
        name: str = "polymq-fsync",
    ) -> None:
        self._loop = loop
        self._sync = sync
        self._done = done
        self._cond = threading.Condition(threading.Lock())
        self._items: dict[int, T] = {}  # by id(): each item synced once per round
        self._directory = False
        self._end = 0
        self._generation = 0  # of the newest request
        self._served = 0  # generation the thread took last
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, items: list[T], directory: bool, end: int) -> int:
        """Ask for ``items`` (and the directory) to be synced and ``end`` reported;
        returns the request's generation, reported once it is synced."""
        with self._cond:
            for item in items:
                self._items[id(item)] = item
            self._directory = self._directory or directory
            self._end = max(self._end, end)
            self._generation += 1
            generation = self._generation
            self._cond.notify()
        return generation

    def stop(self) -> None:
        """Let the thread finish the sync it runs (if any) and end; waits for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while self._served == self._generation and not self._stopping:
                    cond.wait()
                if self._served == self._generation:  # stopping, nothing asked
                    return
                items = list(self._items.values())
                self._items.clear()
                directory, self._directory = self._directory, False
                generation, end = self._generation, self._end
                self._served = generation
            error: BaseException | None = None
            try:
                self._sync(items, directory)
            except BaseException as exc:  # reported to the loop, which fails the log
                error = exc
            try:
                self._loop.call_soon_threadsafe(self._done, generation, end, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            if error is not None:
                return
