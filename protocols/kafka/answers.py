"""A Kafka connection's answers, written in request order while later requests are
already being handled.

An ``acks=all`` produce is answered once its batches are fsynced, but the connection
need not wait for that before it reads and stores the next request: the batches are
readable (written) when the handler returns, and Kafka only asks that a connection's
answers come in the order of its requests. So the handler leaves what its answer
waits for (``Session.answer_after``) and the connection queues the answer here; one
task writes the queued answers in order, each once its waits are done. A producer
sending one record per request (``linger.ms=0``) then has its next requests stored
while an earlier one's fsync runs, all of them fsynced together, instead of one
request per fsync; and a slow fsync (this disk stalls 15-100 ms now and then) holds
only answers, not the records a consumer is waiting for.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

__all__ = ["OrderedAnswers"]

log = logging.getLogger(__name__)

Wait = Callable[[], Awaitable[None]]


class OrderedAnswers:
    """Answers to write in order, each after its waits; at most ``limit`` queued
    before the connection stops reading (:meth:`room`)."""

    def __init__(self, writer: asyncio.StreamWriter, *, limit: int) -> None:
        self._writer = writer
        self._limit = limit
        self._queued: deque[tuple[bytes | None, list[Wait]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self.failed = False  # a wait failed: the connection closes unanswered

    def busy(self) -> bool:
        """Answers are still queued: a new one goes behind them."""
        return self._task is not None

    def add(self, answer: bytes | None, waits: list[Wait]) -> None:
        """Queue ``answer`` (None: the request has none, e.g. ``acks=0``) to be written
        once ``waits`` are done and every earlier answer is written."""
        self._queued.append((answer, waits))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write())

    async def room(self) -> None:
        """Wait while more than ``limit`` answers are queued."""
        while len(self._queued) > self._limit and self._task is not None:
            await asyncio.shield(self._task)

    async def drain(self) -> None:
        """Wait until every queued answer is written (or the connection failed)."""
        while self._task is not None:
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        """The connection ends: answers still waiting are not written."""
        if self._task is not None:
            self._task.cancel()

    async def _write(self) -> None:
        writer = self._writer
        try:
            while self._queued:
                answer, waits = self._queued[0]
                for wait in waits:
                    await wait()
                self._queued.popleft()
                if answer is not None:
                    writer.write(answer)
                    await writer.drain()
        except Exception as e:  # storage failed the fsync, or the peer is gone
            level = logging.INFO if isinstance(e, ConnectionError) else logging.WARNING
            log.log(level, "kafka: closing a connection whose answers cannot be written: %r", e)
            self.failed = True
            self._queued.clear()
            writer.close()
        finally:
            self._task = None
