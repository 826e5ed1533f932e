"""Noticing that a Kafka peer left while its connection reads nothing.

A connection answers one request at a time and reads nothing meanwhile, so a request
that waits on others (a Fetch long poll, a JoinGroup or SyncGroup held for the rest
of the group) would keep a connection whose peer has closed or reset it: still listed,
holding its slot, for as long as the peer asked to wait (a rebalance timeout is the
client's to choose, up to 24 days). Kafka's network layer closes such a connection
and its pending request goes nowhere; this does the same for the requests that are
pure waits, with nothing to undo when cancelled.

Reading to find out would eat the next request, and a client that pipelines has sent
some of it already, so the end of the stream is seen where asyncio learns of it: the
stream protocol calls the reader's ``feed_eof`` (the peer shut its side) or
``set_exception`` (a reset), whatever is still buffered. The watch wraps those two.
asyncio stops reading a socket whose reader holds 128 KiB unread, so a peer that
pipelined that much before leaving is noticed only when its wait ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["WAITS", "PeerWatch"]

_T = TypeVar("_T")

# API keys whose handler may wait long for data or other members and holds nothing
# that a cancellation leaves half done: Fetch, JoinGroup, SyncGroup (the member stays
# in its group until its session times out, as in Kafka) and ShareFetch (records it
# popped but never delivered come back when their lock expires).
WAITS: frozenset[int] = frozenset({1, 11, 14, 78})


class PeerWatch:
    """Whether the peer of ``reader``'s connection has shut its side or reset it.
    Made before the connection's first read, so no end of stream goes unseen."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._gone = asyncio.Event()
        if reader.at_eof() or reader.exception() is not None:
            self._gone.set()
        feed_eof, set_exception = reader.feed_eof, reader.set_exception

        def on_eof() -> None:
            feed_eof()
            self._gone.set()

        def on_error(exc: Exception) -> None:
            set_exception(exc)
            self._gone.set()

        reader.feed_eof = on_eof  # type: ignore[method-assign]
        reader.set_exception = on_error  # type: ignore[method-assign]

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    async def unless_gone(self, handling: Coroutine[Any, Any, _T]) -> tuple[bool, _T | None]:
        """Run ``handling`` until it finishes or the peer leaves, whichever comes first
        (then ``handling`` is cancelled): whether the peer left, and the result."""
        if self.gone:
            handling.close()
            return True, None
        task = asyncio.ensure_future(handling)
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our own cancellation (a kick, the listener stopping)
            task.cancel()
            gone.cancel()
            await asyncio.wait((task, gone))
            raise
        gone.cancel()
        if task.done():
            return False, task.result()
        task.cancel()
        await asyncio.wait((task,))
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            raise failure  # a handler's own bug, not the peer's leaving
        return True, None
