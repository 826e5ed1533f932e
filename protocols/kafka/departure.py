"""Noticing that a Kafka peer left while its connection reads nothing.

A connection answers one request at a time and reads nothing meanwhile, so a request
that waits on others (a Fetch long poll, a JoinGroup or SyncGroup held for the rest
of the group) would keep a connection whose peer has closed or reset it: still listed,
holding its slot, for as long as the peer asked to wait (a rebalance timeout is the
client's to choose, up to 24 days). Kafka's network layer closes such a connection
and its pending request goes nowhere; this does the same for the requests that are
pure waits, with nothing to undo when cancelled.

Watching must not eat the next request: the watch reads at most one byte, which it
hands back to the connection. Once a byte arrived (the client pipelines), only the
transport's own close is watched (a reset, or both directions shut).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["WAITS", "Outcome", "unless_peer_leaves"]

_T = TypeVar("_T")

# API keys whose handler may wait long for data or other members and holds nothing
# that a cancellation leaves half done: Fetch, JoinGroup, SyncGroup (the member stays
# in its group until its session times out, as in Kafka) and ShareFetch (records it
# popped but never delivered come back when their lock expires).
WAITS: frozenset[int] = frozenset({1, 11, 14, 78})


class Outcome(Generic[_T]):
    """What :func:`unless_peer_leaves` saw: the handler's result, or that the peer
    left first; and the first byte of the next request, if the watch read one."""

    __slots__ = ("carried", "left", "result")

    def __init__(self, result: _T | None, left: bool, carried: bytes) -> None:
        self.result = result
        self.left = left
        self.carried = carried


class _Watch:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.carried = b""
        self._reader = reader
        self._writer = writer
        self.task = asyncio.ensure_future(self._gone())

    async def _gone(self) -> None:
        """Return once the peer is gone."""
        try:
            self.carried = await self._reader.read(1)
        except OSError:
            return
        if not self.carried:
            return  # end of stream: the peer closed its side
        with contextlib.suppress(OSError):  # a reset: the transport closed with it
            await self._writer.wait_closed()


async def unless_peer_leaves(
    handling: Coroutine[Any, Any, _T],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> Outcome[_T]:
    """Run ``handling`` until it finishes or the peer leaves, whichever comes first; in
    the latter case ``handling`` is cancelled."""
    task = asyncio.ensure_future(handling)
    watch = _Watch(reader, writer)
    try:
        await asyncio.wait((task, watch.task), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # our own cancellation (a kick, the listener stopping)
        task.cancel()
        watch.task.cancel()
        await asyncio.wait((task, watch.task))
        raise
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            raise failure  # a handler's own bug, not the peer's leaving
        return Outcome(None, True, b"")
    watch.task.cancel()
    await asyncio.wait((watch.task,))
    return Outcome(task.result(), False, watch.carried)
