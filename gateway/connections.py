"""The registry of open client connections, across all protocols.

One place to enforce the connection limit, to list who is connected (admin API,
dashboard), to count connections per tenant for metering, and to close everything
on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace

from gateway.accounts import Principal
from gateway.metering import Metering
from storage.clock import Clock

__all__ = [
    "CloseCallback",
    "Connection",
    "ConnectionRegistry",
    "TooManyConnections",
    "current_connection_id",
    "serving_connection",
]

log = logging.getLogger(__name__)

CloseCallback = Callable[[], Awaitable[None]]

# Set by the transport for the task that serves one connection, so a protocol
# handler finds its registry entry without changing the handler's signature.
_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "polymq_connection_id", default=None
)


def current_connection_id() -> int | None:
    """The registry id of the connection the running task serves, if any."""
    return _current.get()


class TooManyConnections(Exception):
    code = "too_many_connections"


@dataclass(frozen=True, slots=True, kw_only=True)
class Connection:
    """A connection as listed. ``principal`` and ``namespace`` are ``None`` until the
    protocol has authenticated the peer (:meth:`ConnectionRegistry.identify`)."""

    id: int
    protocol: str
    peer: str
    opened_ms: int
    principal: Principal | None = None
    namespace: str | None = None
    client_id: str | None = None


class ConnectionRegistry:
    def __init__(self, *, max_connections: int, metering: Metering, clock: Clock) -> None:
        self._max = max_connections
        self._metering = metering
        self._clock = clock
        self._ids = itertools.count(1)
        self._open: dict[int, Connection] = {}
        self._close: dict[int, CloseCallback] = {}

    def __len__(self) -> int:
        return len(self._open)

    def register(
        self,
        *,
        protocol: str,
        peer: str,
        close: CloseCallback,
        principal: Principal | None = None,
        namespace: str | None = None,
        client_id: str | None = None,
    ) -> Connection:
        """Admit a connection, or raise :class:`TooManyConnections` at the limit (the
        caller then closes the socket: refusing early costs less than serving)."""
        if len(self._open) >= self._max:
            raise TooManyConnections(f"connection limit of {self._max} reached")
        conn = Connection(
            id=next(self._ids),
            protocol=protocol,
            peer=peer,
            opened_ms=self._clock.now_ms(),
            principal=principal,
            namespace=namespace,
            client_id=client_id,
        )
        self._open[conn.id] = conn
        self._close[conn.id] = close
        if namespace is not None:
            self._metering.connection_opened(namespace, protocol)
        return conn

    def identify(
        self,
        connection_id: int,
        *,
        principal: Principal,
        namespace: str,
        client_id: str | None = None,
    ) -> Connection:
        """Record who a connection turned out to be, once the protocol knows."""
        old = self._open[connection_id]
        new = replace(
            old, principal=principal, namespace=namespace, client_id=client_id or old.client_id
        )
        self._open[connection_id] = new
        if old.namespace != namespace:
            if old.namespace is not None:
                self._metering.connection_closed(old.namespace, old.protocol)
            self._metering.connection_opened(namespace, old.protocol)
        return new

    def unregister(self, connection_id: int) -> None:
        """Forget a connection; a second call is harmless (close paths race)."""
        conn = self._open.pop(connection_id, None)
        self._close.pop(connection_id, None)
        if conn is not None and conn.namespace is not None:
            self._metering.connection_closed(conn.namespace, conn.protocol)

    def get(self, connection_id: int) -> Connection | None:
        return self._open.get(connection_id)

    def list(
        self, *, protocol: str | None = None, namespace: str | None = None
    ) -> list[Connection]:
        return [
            c
            for c in self._open.values()
            if (protocol is None or c.protocol == protocol)
            and (namespace is None or c.namespace == namespace)
        ]

    def count(self, *, protocol: str | None = None, namespace: str | None = None) -> int:
        return len(self.list(protocol=protocol, namespace=namespace))

    async def close(self, connection_id: int) -> None:
        """Close one connection through its transport (an admin's kick)."""
        callback = self._close.get(connection_id)
        self.unregister(connection_id)
        if callback is not None:
            await callback()

    async def close_all(self) -> None:
        """Close every connection concurrently. A failing close is logged, not raised:
        shutdown must go on to close storage."""
        ids = list(self._open)
        callbacks = [self._close[i] for i in ids]
        for i in ids:
            self.unregister(i)
        results = await asyncio.gather(*(cb() for cb in callbacks), return_exceptions=True)
        for conn_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("closing connection %d failed", conn_id, exc_info=result)


@contextlib.contextmanager
def serving_connection(connection_id: int) -> Iterator[None]:
    """Make :func:`current_connection_id` answer ``connection_id`` within the block
    (the transport wraps each connection's handler in it)."""
    token = _current.set(connection_id)
    try:
        yield
    finally:
        _current.reset(token)
