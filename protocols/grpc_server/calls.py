"""What a gRPC method is to this server, and what a handler sees of its call.

A handler gets the same three questions answered that it asked grpcio's
``ServicerContext`` (who calls, with which metadata, how long is left), so a service
serves on either server unchanged."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from polymq.protocols.grpc_server.wire import Metadata

__all__ = ["Call", "Inbox", "Method"]


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: ``handler(request, call)`` is a coroutine for a unary answer, an async
    iterator of answers if ``server_streaming``; with ``client_streaming`` its first
    argument is an async iterator of the requests."""

    handler: Callable[[Any, Call], Any]
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    client_streaming: bool = False
    server_streaming: bool = False


class Call:
    """A call as its handler sees it (grpc's ``ServicerContext``, the part used)."""

    __slots__ = ("_deadline", "_loop", "_metadata", "_peer")

    def __init__(
        self, peer: str, metadata: Metadata, deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._peer = peer
        self._metadata = metadata
        self._deadline = deadline
        self._loop = loop

    def peer(self) -> str:
        """``ipv4:host:port`` or ``ipv6:[host]:port``, as grpc names a peer."""
        return self._peer

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds to the client's deadline (``grpc-timeout``), None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._loop.time())


class Inbox:
    """The requests of a client-streaming call, in order, as its handler's async
    iterator. ``taken(size)`` is told of each request its handler reads, so the
    connection can open the stream's window again: a handler that stops reading stops
    its peer rather than growing this queue."""

    __slots__ = ("_ended", "_items", "_taken", "_waiter", "held")

    def __init__(self, taken: Callable[[int], None]) -> None:
        self._items: deque[tuple[Any, int]] = deque()
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._taken = taken
        self.held = 0  # the bytes of the requests queued

    def put(self, request: Any, size: int) -> None:
        self._items.append((request, size))
        self.held += size
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def discard(self) -> int:
        """End the inbox, its requests unread; how many bytes they held."""
        held, self.held = self.held, 0
        self._items.clear()
        self.end()
        return held

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        request, size = self._items.popleft()
        self.held -= size
        self._taken(size)
        return request
