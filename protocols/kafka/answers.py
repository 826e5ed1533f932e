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

One fsync makes many queued answers due at once (at 1,000 msgs/s most are queued
behind another, dozens after a stall); each ``write`` is a ``send`` syscall, among
the costliest calls per message, so the answers that fall due in one turn of the
event loop go out in one write at its end (:meth:`OrderedAnswers._flush`), still
before the connection writes anything else.
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
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._queued: deque[tuple[bytes | None, list[Wait]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._due: list[bytes] = []  # answers written at the end of this loop turn
        self.failed = False  # a wait failed: the connection closes unanswered

    def busy(self) -> bool:
        """Answers are still queued: a new one goes behind them."""
        return self._task is not None

    def add(self, answer: bytes | None, waits: list[Wait]) -> None:
        """Queue ``answer`` (None: the request has none, e.g. ``acks=0``) to be written
        once ``waits`` are done and every earlier answer is written."""
        self._queued.append((answer, waits))
        if self._task is None:
            self._task = self._loop.create_task(self._write())

    async def room(self) -> None:
        """Wait while more than ``limit`` answers are queued."""
        while len(self._queued) > self._limit and self._task is not None:
            await asyncio.shield(self._task)

    async def drain(self) -> None:
        """Wait until every queued answer is written (or the connection failed)."""
        while self._task is not None:
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        """The connection ends: answers still waiting are not written (those already
        due, in :meth:`_flush`'s hands, still go out at the end of the loop turn)."""
        if self._task is not None:
            self._task.cancel()

    async def _write(self) -> None:
        writer = self._writer
        try:
            while self._queued:
                answer, waits = self._queued[0]
                for wait in waits:
                    await wait()
                if self.failed:  # a write at a turn's end failed meanwhile
                    return
                self._queued.popleft()
                if answer is not None:
                    self._send(answer)
                    await writer.drain()
            # Written before :meth:`busy` turns false: the connection's own writes
            # come after every queued answer.
            self._flush()
        except Exception as e:  # storage failed the fsync, or the peer is gone
            self._flush()  # the answers due before the failure are still owed
            if not self.failed:
                self._fail(e)
        finally:
            self._task = None

    def _send(self, answer: bytes) -> None:
        """Write ``answer`` at the end of this loop turn, with any others due by then."""
        self._due.append(answer)
        if len(self._due) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write the answers due so far, as one ``send``: at the end of the loop turn
        (scheduled by :meth:`_send`) or when the queue empties, whichever is first."""
        due = self._due
        if not due:
            return
        self._due = []
        try:
            self._writer.write(due[0] if len(due) == 1 else b"".join(due))
        except Exception as e:  # the transport refuses: as a failed drain
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        """Drop every answer and close: the peer must not get later answers without
        the one that failed (Kafka matches answers to requests by their order)."""
        level = logging.INFO if isinstance(e, ConnectionError) else logging.WARNING
        log.log(level, "kafka: closing a connection whose answers cannot be written: %r", e)
        self.failed = True
        self._queued.clear()
        self._due.clear()
        self._writer.close()
