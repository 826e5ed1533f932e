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
        self._gone = False
        # The connection's task while it runs a handler under ``unless_gone``: the
        # peer's leaving cancels it there, and only there.
        self._waiting: asyncio.Task[Any] | None = None
        self._cancelled = False  # we cancelled ``_waiting``: not somebody else's cancel
        if reader.at_eof() or reader.exception() is not None:
            self._gone = True
        feed_eof, set_exception = reader.feed_eof, reader.set_exception

        def on_eof() -> None:
            feed_eof()
            self._left()

        def on_error(exc: Exception) -> None:
            set_exception(exc)
            self._left()

        reader.feed_eof = on_eof  # type: ignore[method-assign]
        reader.set_exception = on_error  # type: ignore[method-assign]

    def _left(self) -> None:
        self._gone = True
        if self._waiting is not None and not self._cancelled:
            self._cancelled = True
            self._waiting.cancel()

    @property
    def gone(self) -> bool:
        return self._gone

    async def unless_gone(self, handling: Coroutine[Any, Any, _T]) -> tuple[bool, _T | None]:
        """Run ``handling`` until it finishes or the peer leaves, whichever comes first
        (then ``handling`` is cancelled): whether the peer left, and the result.

        The handler runs in the connection's own task, which the leaving cancels: no
        task of its own (every fetch comes here, so at an everyday rate a task per
        fetch, and the wait on it, were a tenth of a record's loop work). A cancel of
        ours is told from anybody else's (a kick, the listener stopping) by
        ``Task.uncancel``: only ours is swallowed."""
        if self._gone:
            handling.close()
            return True, None
        task = asyncio.current_task()
        assert task is not None
        self._waiting = task
        try:
            result = await handling
        except asyncio.CancelledError:
            if self._cancelled and task.uncancel() == 0:
                return True, None
            raise  # not ours, or somebody else cancelled too
        finally:
            self._waiting = None
        if self._cancelled:  # the handler finished despite our cancel
            task.uncancel()
            return True, None
        return False, result
