"""Appends to one storage node made in one event-loop iteration, sent as one call.

Why: over the storage RPC each call costs both processes a frame to encode and
decode, a future, a task on the node and an engine call of its own (a group-commit
wait): about as much CPU as the engine's own work on the message (docs/workers.md).
The node's ``append`` takes a list and stores it under one group commit, so a
gateway gains by handing it lists.

How: the first append of a loop iteration goes at once, alone, as it always did (an
append alone costs nothing more: a flag and a callback per iteration). The others
made in the same iteration (other connections woken by the same read of the sockets)
queue up and go at the start of the next, as few calls as the limits allow, in the
order made (one connection, frames in order: the node starts them in that order).
Nothing waits for a round trip. Under load more connections wake per iteration, so
the calls grow by themselves. (Holding appends until an earlier one returned,
group-commit style, and sending even the first of an iteration with the others were
measured and not kept: the first added a round trip's wait, the second a task and a
future to every lone append, and both cost more than they saved.)

Every caller still gets its own answer. A merged call that fails as a whole for one
request's sake (a topic deleted meanwhile, a message too large) is sent again request
by request, so only that caller gets the error: the engine validates every request of
a call before it stores any (``storage.engine.appends``), so nothing was stored by the
failed call. Any other failure (the node unreachable, its disk failing) is every
caller's, as it would have been call by call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from polymq.storage.errors import (
    InvalidArgument,
    InvalidName,
    MessageTooLarge,
    NamespaceNotFound,
    QueueNotFound,
    StorageError,
    TopicNotFound,
)
from polymq.storage.model import AppendRequest, AppendResult, Message

__all__ = ["AppendBatcher"]

Send = Callable[[list[AppendRequest]], Awaitable[list[AppendResult]]]

# Errors of one request that the engine raises while validating the whole call, before
# it stores anything: the call is retried request by request.
_ONE_REQUESTS_FAULT = (
    InvalidArgument,
    InvalidName,
    MessageTooLarge,
    NamespaceNotFound,
    QueueNotFound,
    TopicNotFound,
)
MAX_BATCH_REQUESTS = 512
MAX_BATCH_BYTES = 1 << 20  # bodies per merged call: well under the RPC's frame limit


def _size(request: AppendRequest) -> int:
    entry = request.entry
    return len(entry.body) if isinstance(entry, Message) else len(entry.raw)


class _Waiting:
    """One caller's requests, queued until the next flight takes them."""

    __slots__ = ("future", "requests", "size")

    def __init__(self, requests: list[AppendRequest], future: asyncio.Future[list[AppendResult]]):
        self.requests = requests
        self.future = future
        self.size = sum(_size(r) for r in requests)


class AppendBatcher:
    """Sends appends through ``send`` (one call to the node), merging those made in one
    loop iteration. Not thread-safe: one event loop, as the RPC client."""

    def __init__(
        self,
        send: Send,
        *,
        max_requests: int = MAX_BATCH_REQUESTS,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self._send = send
        self._max_requests = max_requests
        self._max_bytes = max_bytes
        self._queue: list[_Waiting] = []
        # An append went alone in this loop iteration: the next ones queue.
        self._sent_alone = False
        # The flight to start at the next loop iteration, and those out (held: the
        # loop keeps only weak references to tasks).
        self._flight: asyncio.Task[None] | None = None
        self._flights: set[asyncio.Task[None]] = set()
        self.calls = 0  # calls sent to the node, for tests and figures
        self.merged = 0  # appends that went in a call with others

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        loop = asyncio.get_running_loop()
        if not self._sent_alone:
            self._sent_alone = True
            loop.call_soon(self._next_iteration)
            self.calls += 1
            return await self._send(list(requests))
        waiting = _Waiting(list(requests), loop.create_future())
        self._queue.append(waiting)
        if self._flight is None:
            # The second append of this loop iteration: the flight starts at the
            # next, with every append made meanwhile (no round trip waited for).
            self._flight = loop.create_task(self._fly())
            self._flights.add(self._flight)
            self._flight.add_done_callback(self._flights.discard)
        try:
            return await waiting.future
        except asyncio.CancelledError:
            # Still queued: never sent. Already taken: it is stored all the same, as a
            # cancelled call's append may be; nobody reads the answer.
            with contextlib.suppress(ValueError):
                self._queue.remove(waiting)
            raise

    def _next_iteration(self) -> None:
        self._sent_alone = False

    async def _fly(self) -> None:
        taken, self._queue = self._queue, []
        self._flight = None  # appends made from now on start the next flight
        await asyncio.gather(*(self._call(chunk) for chunk in self._chunks(taken)))

    def _chunks(self, taken: list[_Waiting]) -> list[list[_Waiting]]:
        """Consecutive runs of one durability (a transient message must not wait for
        a durable one's fsync), each within the size limits (one caller's list is
        never split)."""
        chunks: list[list[_Waiting]] = []
        current: list[_Waiting] = []
        count = size = 0
        durable: bool | None = None
        for waiting in taken:
            if waiting.future.done():  # cancelled while queued, just now
                continue
            kind = any(r.durable for r in waiting.requests)
            if current and (
                kind != durable
                or count + len(waiting.requests) > self._max_requests
                or size + waiting.size > self._max_bytes
            ):
                chunks.append(current)
                current, count, size = [], 0, 0
            current.append(waiting)
            durable = kind
            count += len(waiting.requests)
            size += waiting.size
        if current:
            chunks.append(current)
        return chunks

    async def _call(self, chunk: list[_Waiting]) -> None:
        if len(chunk) == 1:
            await self._alone(chunk[0])
            return
        merged = [request for waiting in chunk for request in waiting.requests]
        self.calls += 1
        self.merged += len(chunk)
        try:
            results = await self._send(merged)
        except _ONE_REQUESTS_FAULT:
            # Nothing of the call was stored: each caller's requests alone, at once
            # (in order, in one write), so only the faulty one gets the error.
            await asyncio.gather(*(self._alone(waiting) for waiting in chunk))
            return
        except (StorageError, OSError) as exc:
            for waiting in chunk:
                _fail(waiting.future, exc)
            return
        except BaseException as exc:  # cancelled (the client closing), or our bug
            for waiting in chunk:
                _fail(waiting.future, exc)
            raise
        start = 0
        for waiting in chunk:
            end = start + len(waiting.requests)
            if not waiting.future.done():
                waiting.future.set_result(results[start:end])
            start = end

    async def _alone(self, waiting: _Waiting) -> None:
        self.calls += 1
        try:
            result = await self._send(waiting.requests)
        except BaseException as exc:
            _fail(waiting.future, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not waiting.future.done():
            waiting.future.set_result(result)


def _fail(future: asyncio.Future[list[AppendResult]], exc: BaseException) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)
