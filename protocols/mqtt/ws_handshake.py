"""The WebSocket opening handshake of the ``mqtt_ws`` listener, for hostile peers
(issue 14): whatever a peer sends before its upgrade is answered costs it its own
connection and one INFO line, never a traceback.

websockets (15.0.1) logs every failed handshake as an ERROR with a traceback, most of
them for nothing worse than a malformed request or a peer that hung up, and fails on
some inputs itself: ``UnicodeEncodeError`` quoting a non-ASCII header value in its own
400 body, ``AssertionError`` sending a second EOF when a rejected request is followed
by bytes that are not frames, ``RuntimeError`` writing its 101 after that same EOF.
:class:`GuardedConnection` keeps every record the library makes (at DEBUG, traceback
included) and says once, at INFO, why the peer was closed; :func:`check_request`
answers the non-ASCII case with a 400 before the library fails on it; and the upgrade
gets a deadline counted from the TCP accept (:attr:`GuardedConnection.deadline`),
which the CONNECT after it shares. The socket is admitted to the connection registry on
the TCP accept too, as TCP listeners do: sockets that never upgrade count against the
per-address, per-protocol and global limits like any other.
"""

from __future__ import annotations

import asyncio
import http
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, ClassVar

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import Protocol
from websockets.server import ServerProtocol

from polymq.gateway.connections import ConnectionRegistry, TooManyConnections

__all__ = ["GuardedConnection", "UpgradeTimeout", "check_request", "describe_failure"]

log = logging.getLogger(__name__)

# Headers whose values websockets parses during the handshake and quotes in its errors.
_CHECKED_HEADERS = frozenset(("connection", "upgrade", "origin"))
_CHECKED_PREFIX = "sec-websocket-"
_MAX_REASON_CHARS = 300
# What the library's close exceptions chain to when it half-closed early: symptoms.
_SYMPTOMS = (ConnectionClosed, RuntimeError, AssertionError, OSError)


class UpgradeTimeout(Exception):
    """The peer did not complete the HTTP upgrade within the handshake deadline."""


class GuardedConnection(ServerConnection):
    """A server connection whose handshake failure is logged once, at INFO.

    The listener subclasses it with ``listener``, ``handshake_timeout_s`` and
    ``registry`` set and passes the subclass as ``serve(create_connection=...)`` with
    ``open_timeout=None``: :meth:`handshake` keeps the deadline itself, so that a peer
    that never upgrades is logged too (websockets' ``open_timeout`` closes it without a
    word). With a registry, the socket is registered when accepted (``connection_id``;
    refused, it is aborted at once) and unregistered when it is gone; the handler sets
    ``kick`` to how an upgraded connection is closed (before that a kick aborts)."""

    listener = "mqtt_ws"
    handshake_timeout_s = 10.0
    registry: ClassVar[ConnectionRegistry | None] = None
    registered_as = "mqtt"  # the protocol the registry counts it under

    def __init__(self, protocol: ServerProtocol, *args: Any, **kwargs: Any) -> None:
        super().__init__(protocol, *args, **kwargs)
        # Created on the TCP accept: the upgrade and the CONNECT after it share this.
        self.deadline = self.loop.time() + self.handshake_timeout_s
        base = protocol.logger
        while isinstance(base, logging.LoggerAdapter):
            base = base.logger
        # websockets logs through both attributes; both get the same filter.
        self._failure_log = _FailureLog(base, self)
        self.logger = self._failure_log
        protocol.logger = self._failure_log
        _send_eof_once(protocol)
        self.connection_id: int | None = None
        self.kick: Callable[[], Awaitable[None]] | None = None

    @property
    def peer(self) -> str:
        transport = getattr(self, "transport", None)  # set by connection_made
        address = transport.get_extra_info("peername") if transport is not None else None
        if isinstance(address, tuple) and len(address) >= 2:
            return f"{address[0]}:{address[1]}"
        return "?"

    def refused(self, reason: str) -> None:
        """Log why the peer is closed, unless that was said already: one line each."""
        self._failure_log.tell(reason)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        registry = self.registry
        if registry is None:
            return
        try:
            self.connection_id = registry.register(
                protocol=self.registered_as, peer=self.peer, close=self._kicked
            ).id
        except TooManyConnections as e:
            self._failure_log.tell(f"refused: {e}", logging.WARNING)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.registry is not None and self.connection_id is not None:
            self.registry.unregister(self.connection_id)

    async def _kicked(self) -> None:
        if self.kick is not None:
            await self.kick()
        else:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        protocol = self.protocol
        if protocol.parser_exc is not None or (
            self.request is None and protocol.handshake_exc is not None
        ):
            # websockets failed the connection (a request or a frame it could not
            # parse): it sent its close frame, half-closed, and would wait for the peer
            # to hang up before saying why, for as long as the peer likes. Hang up
            # (after the close frame).
            self.transport.close()

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        try:
            async with asyncio.timeout_at(self.deadline):
                await super().handshake(*args, **kwargs)
        except TimeoutError:
            raise UpgradeTimeout(
                f"no WebSocket upgrade within {self.handshake_timeout_s:g} s"
            ) from None


def _send_eof_once(protocol: Protocol) -> None:
    """websockets half-closes as soon as the bytes after a request fail to parse, before
    the handshake has answered it; answering with a rejection then sends a second EOF
    and trips ``assert not self.eof_sent`` (15.0.1 to 17.4). Make the second a no-op:
    the send that follows fails as any send to a closed peer, and is logged as one."""
    send_eof = protocol.send_eof

    def once() -> None:
        if not protocol.eof_sent:
            send_eof()

    protocol.send_eof = once  # type: ignore[method-assign]


def check_request(connection: ServerConnection, request: Request) -> Response | None:
    """``process_request``: 400 for a non-ASCII value in a header websockets parses. It
    would quote the value, undecodable bytes and all, in its own 400 body, and fail
    encoding that."""
    for name, value in request.headers.raw_items():
        lower = name.lower()
        if value.isascii() or not (lower in _CHECKED_HEADERS or lower.startswith(_CHECKED_PREFIX)):
            continue
        if isinstance(connection, GuardedConnection):
            connection.refused(f"bad WebSocket upgrade: {name} is not ASCII")
        return connection.respond(
            http.HTTPStatus.BAD_REQUEST,
            f"Failed to open a WebSocket connection: {name} is not ASCII.\n",
        )
    return None


def describe_failure(exc: BaseException | None, protocol: Protocol | None = None) -> str:
    """Why a handshake failed, in one line of ASCII: the exception's chain of causes,
    or, when those are only the symptoms of an early half-close, what the bytes after
    the request broke on."""
    if isinstance(exc, UpgradeTimeout):
        return str(exc)
    chain = list(_chain(exc))
    parser_exc = protocol.parser_exc if protocol is not None else None
    symptoms_only = all(isinstance(e, _SYMPTOMS) for e in chain)
    if isinstance(parser_exc, EOFError) and symptoms_only:
        reason = "the peer closed before it was answered"
    elif parser_exc is not None and symptoms_only:
        reason = f"the bytes after the request are not frames: {_text(parser_exc)}"
    else:
        parts = [_text(e) for e in chain if not isinstance(e, ConnectionClosed)]
        reason = "; ".join(parts) or "connection lost"
    text = f"bad WebSocket upgrade: {reason}"
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return text


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class _FailureLog(logging.LoggerAdapter[logging.Logger]):
    """What websockets logs for one connection, weighed.

    Its failures (WARNING and up, with tracebacks) are what the peer's bytes caused:
    the first becomes the connection's one INFO line. Its routine INFO records
    (``connection open``, ``connection rejected (...)``) are one per connection, noise:
    DEBUG. Every record keeps its text and traceback at DEBUG. Only ``connection
    handler failed`` passes as it is: that one is our handler's bug, not the peer's."""

    def __init__(self, logger: logging.Logger, connection: GuardedConnection) -> None:
        super().__init__(logger, {"websocket": connection})
        self._connection = connection
        self._told = False

    def tell(self, reason: str, level: int = logging.INFO) -> None:
        if not self._told:
            self._told = True
            log.log(
                level,
                "%s: closing %s: %s",
                self._connection.listener,
                self._connection.peer,
                reason,
            )

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if msg == "connection handler failed":
            self.logger.log(level, msg, *args, **kwargs)
            return
        if level >= logging.WARNING:
            self.tell(
                describe_failure(_exception(kwargs.get("exc_info")), self._connection.protocol)
            )
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(msg, *args, **kwargs)


def _exception(exc_info: object) -> BaseException | None:
    """The exception a logging call's ``exc_info`` argument stands for."""
    if exc_info is True:
        return sys.exc_info()[1]
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        exc_info = exc_info[1]
    return exc_info if isinstance(exc_info, BaseException) else None
