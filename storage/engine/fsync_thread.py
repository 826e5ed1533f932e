"""The commit log's fsync thread: one long-lived thread that fsyncs what the event
loop asks for and tells the loop once per completed fsync.

Why not ``loop.run_in_executor`` per fsync: each call paid a future, a work item, a
queue put and get, a wake-up of the worker and one of the loop, even when the
previous fsync was still running (measured: ``ThreadPoolExecutor.submit`` alone was a
fifth of the loop's samples at 1,000 msgs/s, docs/performance.md). Here the loop only
puts a request on a queue; every request made while an fsync runs
is coalesced into the next one, which the thread starts as soon as the previous ends,
without going back to the loop in between; and the loop is woken once per completed
fsync (``call_soon_threadsafe``), whatever the number of requests it covered.
"""

from __future__ import annotations

import asyncio
import queue
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
    every request made before it. After an error the thread stops; the owner fails.

    The hand-over is a ``queue.SimpleQueue`` (a C lock and deque: one futex wake when
    the thread sleeps, none when it is busy); with ``threading.Condition`` the storage
    timeline bench made 10-25 % more futex calls (strace -c, two paired runs)."""

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
        self._requests: queue.SimpleQueue[tuple[list[T], bool, int, int] | None] = (
            queue.SimpleQueue()
        )
        self._generation = 0  # of the newest request
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, items: list[T], directory: bool, end: int) -> int:
        """Ask for ``items`` (and the directory) to be synced and ``end`` reported;
        returns the request's generation, reported once it is synced."""
        self._generation += 1
        self._requests.put((items, directory, end, self._generation))
        return self._generation

    def stop(self) -> None:
        """Let the thread finish what was asked (if anything) and end; waits for it."""
        self._requests.put(None)
        self._thread.join()

    def _run(self) -> None:
        requests = self._requests
        stopping = False
        while not stopping:
            first = requests.get()
            if first is None:
                return
            # Everything asked while the previous sync ran (or while we woke): one sync.
            batch = [first]
            while True:
                try:
                    more = requests.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                batch.append(more)
            items: dict[int, T] = {}
            directory = False
            for asked, asked_directory, _, _ in batch:
                for item in asked:
                    items[id(item)] = item
                directory = directory or asked_directory
            generation = batch[-1][3]
            end = max(asked_end for _, _, asked_end, _ in batch)
            error: BaseException | None = None
            try:
                self._sync(list(items.values()), directory)
            except BaseException as exc:  # reported to the loop, which fails the log
                error = exc
            try:
                self._loop.call_soon_threadsafe(self._done, generation, end, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            if error is not None:
                return
