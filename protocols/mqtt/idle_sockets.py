"""Sockets of long-idle MQTT connections, held in one epoll of our own instead of in
the loop's transports.

Why: a loop transport is the largest thing an idle connection holds. Under uvloop
the transport, its libuv handle and their weak reference are about 1.2 KiB of the
3.7 KiB a parked connection cost (docs/mqtt.md, "Memory per connection"), and a
broker holds tens of thousands of connections that send a PINGREQ a minute. Held
here, a socket costs a file descriptor in the kernel's epoll and an entry in a dict;
its connection's state stays where it was. When the peer sends a byte (or leaves),
the epoll says so and the owner gets a loop transport again
(``loop.connect_accepted_socket``), as the owner does when it has bytes to write.

Only where the platform has epoll (Linux); elsewhere :func:`idle_sockets` returns
None and idle connections keep their transports."""

from __future__ import annotations

import asyncio
import contextlib
import select
from typing import Protocol

__all__ = ["IdleSocketOwner", "IdleSockets", "idle_sockets"]

# Readable, or the peer hung up or reset: in every case the owner needs its transport.
_EVENTS = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0)
_MAX_EVENTS = 256  # per wake; the rest stay ready for the next


class IdleSocketOwner(Protocol):
    def readable(self) -> None:
        """The held socket has bytes, or its peer's end, to read."""
        ...


class IdleSockets:
    """File descriptors held for their owners until readable (one-shot: a socket
    woken is no longer held)."""

    __slots__ = ("_epoll", "_held", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._epoll = select.epoll()
        self._held: dict[int, IdleSocketOwner] = {}
        loop.add_reader(self._epoll.fileno(), self._ready)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, fd: int, owner: IdleSocketOwner) -> None:
        """Watch ``fd`` (now the caller's only descriptor of its socket) for ``owner``."""
        self._epoll.register(fd, _EVENTS)
        self._held[fd] = owner

    def release(self, fd: int) -> None:
        """Stop watching ``fd`` (its owner takes it back, or closes it)."""
        if self._held.pop(fd, None) is not None:
            # Closed behind our back (or closed and its number reused), the kernel has
            # dropped it from the epoll already; raising here would leave the owner
            # detached for good, and in _ready the other sockets woken with it.
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    def _ready(self) -> None:
        for fd, _ in self._epoll.poll(0, _MAX_EVENTS):
            owner = self._held.get(fd)
            if owner is not None:
                self.release(fd)
                owner.readable()

    def close(self) -> None:
        """Stop watching (the owners close their sockets: none is closed here)."""
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._held.clear()


def idle_sockets(loop: asyncio.AbstractEventLoop) -> IdleSockets | None:
    """A holder over ``loop``, or None where there is no epoll."""
    if not hasattr(select, "epoll"):
        return None
    return IdleSockets(loop)
