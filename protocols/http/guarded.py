"""uvicorn's httptools protocol, held to the gateway's limits for hostile peers.

uvicorn itself waits forever for a request's head (its keep-alive timer restarts on
every byte, and there is none before the first request) and lets llhttp buffer headers
of any size, so a socket sending one byte a second holds its connection slot and
memory indefinitely. This subclass adds what a reverse proxy would: the request line
and headers must arrive within ``limits.handshake_timeout_ms`` of the connection
opening or of the previous response (408, or a plain close if nothing was sent), a
request body within ``limits.frame_timeout_ms`` of its headers, and the head may be at
most :data:`MAX_HEAD_BYTES` (431). It also enters each connection in the gateway's
registry, which refuses it at the connection limits, and marks it established once a
first request's headers are complete.

Requests still being served are told their peer is gone (``disconnected``, so their
writes are dropped) before any close this makes, and in ``connection_lost`` all of
them, not just uvicorn's newest: on uvloop a write to a closed transport raises, and
``connection_lost`` comes an iteration or more after the close, so a handler resuming
in between, or one with requests pipelined behind it (uvicorn marked only the last),
logged a ``RuntimeError`` traceback (20-30 per 30 s of the network fuzzer). A request
that cannot be parsed gets 400 and an oversized head 431 after the answers owed to
the valid requests before it, in order, as nginx does (uvicorn wrote its 400 at once,
which a client then read as the answer to its first request).

Each response goes out in one write, head and body together (:class:`_OneWriteCycle`):
uvicorn writes them with two, which on loopback made two TCP segments, two wake-ups of
the client and twice the kernel's send path per request (profiled under bench.latency's
MNS case, the head's write alone was a fifth of the request path's samples).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import Literal

import httptools
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent, Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from polymq.gateway.config import LimitsConfig
from polymq.gateway.connections import ConnectionRegistry, TooManyConnections
from polymq.gateway.lazy_deadline import LazyDeadline
from polymq.protocols.mns.request import CONNECTION_ID

__all__ = ["MAX_HEAD_BYTES", "guarded_protocol"]

log = logging.getLogger(__name__)

# nginx's large_client_header_buffers is 4 x 8 KiB; MNS requests carry a few hundred
# bytes of headers. Counted from the bytes received, so a header llhttp is still
# buffering (no line end yet) counts too.
MAX_HEAD_BYTES = 64 << 10

_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)


class _HeadTooLarge(Exception):
    """Raised in llhttp's headers-complete callback: it stops parsing there."""


class _HeldHead(asyncio.Transport):
    """A request cycle's view of the connection's transport that can hold one write (a
    response head) back and send it in front of the next one (the body's first part),
    so that the two leave in one write call. A close sends what is held first: the
    bytes on the wire are uvicorn's, in uvicorn's order."""

    __slots__ = ("_held", "_holding", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._holding = False
        self._held = b""

    def hold_next(self) -> None:
        """Keep the next write until the one after it (or a release or close)."""
        self._holding = True

    def release(self) -> None:
        """Write what is held now (a streamed response's head: its body may be slow);
        nothing once the connection is closing (the peer is gone: it is dropped, as the
        cycle drops its writes then)."""
        self._holding = False
        if self._held:
            held, self._held = self._held, b""
            if not self._transport.is_closing():
                self._transport.write(held)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._holding:
            self._holding = False
            self._held = bytes(data)
            return
        if self._held:
            data, self._held = self._held + data, b""
        self._transport.write(data)

    def close(self) -> None:
        self.release()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)


class _OneWriteCycle(RequestResponseCycle):
    """uvicorn's request cycle, its response head held (by :class:`_HeldHead`) until the
    body's first write carries it. Not for HEAD (uvicorn writes no body for it, and the
    head would wait for the cycle's close) nor for a chunked response (a stream, whose
    first part may be long coming): their heads go at once, as uvicorn's."""

    transport: _HeldHead

    async def send(self, message: ASGISendEvent) -> None:
        if (
            message["type"] != "http.response.start"
            or self.response_started
            or self.scope["method"] == "HEAD"
        ):
            await super().send(message)
            return
        self.transport.hold_next()
        await super().send(message)
        if self.chunked_encoding:
            self.transport.release()


def _one_write(cycle: RequestResponseCycle) -> None:
    """Make ``cycle`` (made by uvicorn, not yet started) write each response once."""
    cycle.transport = _HeldHead(cycle.transport)
    cycle.__class__ = _OneWriteCycle


def guarded_protocol(
    connections: ConnectionRegistry, limits: LimitsConfig
) -> type[HttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``."""
    head_timeout_s = limits.handshake_timeout_ms / 1000
    body_timeout_s = limits.frame_timeout_ms / 1000
    # The timer's period: the shorter timeout, so that the other never moves it.
    deadline_period_s = min(head_timeout_s, body_timeout_s)

    class GuardedProtocol(HttpToolsProtocol):
        _connection_id: int | None = None
        _peer = "unknown"
        # Between a request's end (or the connection's start) and the next one's
        # headers: the bytes then received are head bytes.
        _in_head = True
        _head_bytes = 0
        # Requests whose headers arrived and whose response is not yet complete: while
        # one is served (a long poll, say) the peer owes no next head.
        _serving = 0
        # The one deadline running (the head's or the body's: never both), and which
        # one it is. A request moves the deadline twice and the timer not at all: a
        # timer started and cancelled per deadline was 4 of them per request, for
        # deadlines that almost never expire.
        _deadline: LazyDeadline
        _deadline_of: Literal["head", "body"] | None = None
        # The requests whose headers arrived and whose response is not complete, in
        # order (uvicorn keeps only the newest one and the queue behind the running one).
        _cycles: collections.deque[RequestResponseCycle]
        # Set once the peer's bytes are refused: nothing more is parsed, and this answer
        # (if any) is written once the requests before the bad one are answered.
        _refusing = False
        _refusal: bytes | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._cycles = collections.deque()
            self._deadline = LazyDeadline(self.loop, self._deadline_reached, deadline_period_s)
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = self.client
            self._peer = f"{client[0]}:{client[1]}" if client else "unknown"

            async def close() -> None:
                self._close(None)

            try:
                connection_id = connections.register(
                    protocol="http", peer=self._peer, close=close
                ).id
            except TooManyConnections as e:
                log.warning("http: refused %s: %s", self._peer, e)
                transport.close()
                return
            self._connection_id = connection_id
            inner = self.app

            async def app(
                scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
            ) -> None:
                # Handlers find their connection's registry entry here (CONNECTION_ID).
                scope[CONNECTION_ID] = connection_id  # type: ignore[literal-required]
                await inner(scope, receive, send)

            self.app = app
            self._arm_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline_of = None
            self._deadline.close()
            # uvicorn tells only its newest request: with requests pipelined behind it,
            # the one being served (a long poll, say) went on to write to the closed
            # transport.
            self._disconnect_all()
            if self._connection_id is not None:
                connections.unregister(self._connection_id)
                self._connection_id = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._connection_id is None or self._refusing or self.transport.is_closing():
                return  # refused or being closed: nothing more is parsed
            if self._in_head:
                self._head_bytes += len(data)
            # uvicorn's data_received, but for its parse error: that wrote a 400 and
            # closed at once (ahead of the answers owed, and under running handlers),
            # with a warning that names no peer.
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as e:
                if isinstance(e.__context__, _HeadTooLarge):
                    self._refuse(_TOO_LARGE, f"request head over {MAX_HEAD_BYTES} bytes")
                else:
                    reason = str(e)[:80] or type(e).__name__
                    self._refuse(_BAD_REQUEST, f"invalid HTTP request ({reason})")
                return
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()  # ws="none": no Upgrade is served
                return
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(_TOO_LARGE, f"request head over {MAX_HEAD_BYTES} bytes")

        # -- llhttp callbacks (during parser.feed_data) -----------------------------

        def on_headers_complete(self) -> None:
            # A whole head that arrived in one read is parsed before data_received can
            # count it: measured here, from what llhttp parsed.
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > MAX_HEAD_BYTES:
                raise _HeadTooLarge  # llhttp stops; data_received refuses with 431
            self._in_head = False
            self._head_bytes = 0
            self._serving += 1
            if self._connection_id is not None:
                connections.established(self._connection_id)
            self._start_deadline("body", body_timeout_s)  # in place of the head's
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not None and self.cycle is not before:
                _one_write(self.cycle)
                self._cycles.append(self.cycle)

        def on_message_complete(self) -> None:
            self._stop_deadline("body")
            self._in_head = True
            if self._serving == 0:  # answered before its body was read: next head is due
                self._arm_head()
            super().on_message_complete()

        # -- called by the request cycle once a response is written ----------------

        def on_response_complete(self) -> None:
            self._serving = max(0, self._serving - 1)
            super().on_response_complete()  # starts the next pipelined request, if any
            while self._cycles and self._cycles[0].response_complete:
                self._cycles.popleft()
            if self.transport.is_closing():
                return
            if self._refusing:
                if not self._cycles:  # every request before the bad one is answered
                    self._close(self._refusal)
                return
            if self._serving == 0 and self._in_head:
                self._arm_head()

        def _unsupported_upgrade_warning(self) -> None:
            """An Upgrade the app does not serve (WebSocket, h2c): the request is answered
            in HTTP/1.1 and the connection then closes, since llhttp parses nothing more
            on it; one line, not uvicorn's two warnings per packet."""
            log.info("http: %s asked for an unsupported Upgrade; closing after it", self._peer)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            else:
                self._close(None)

        # -- deadlines ---------------------------------------------------------------

        def _arm_head(self) -> None:
            self._start_deadline("head", head_timeout_s)

        def _start_deadline(self, which: Literal["head", "body"], timeout_s: float) -> None:
            """``which`` is due within ``timeout_s`` from now (the other one is off)."""
            self._deadline_of = which
            self._deadline.start(self.loop.time() + timeout_s)

        def _stop_deadline(self, which: Literal["head", "body"]) -> None:
            """``which`` is no longer due (the timer, when it fires, finds nothing)."""
            if self._deadline_of == which:
                self._deadline_of = None
                self._deadline.stop()

        def _stop_deadlines(self) -> None:
            self._deadline_of = None
            self._deadline.stop()

        def _deadline_reached(self) -> None:
            which, self._deadline_of = self._deadline_of, None
            if which == "head":
                self._head_expired()
            else:
                self._body_expired()

        def _head_expired(self) -> None:
            if self.transport.is_closing() or not self._in_head or self._serving:
                return
            if self._head_bytes:
                self._refuse(_TIMEOUT, f"no request head within {head_timeout_s:g} s")
                return
            # Idle: a 408 could cross the peer's next request, so just close. An idle
            # keep-alive connection is routine (a client between calls): not logged.
            never_asked = self._connection_id is not None and not connections.is_established(
                self._connection_id
            )
            log.log(
                logging.INFO if never_asked else logging.DEBUG,
                "http: closing %s: idle for %g s",
                self._peer,
                head_timeout_s,
            )
            self._close(None)

        def _body_expired(self) -> None:
            if not self.transport.is_closing():
                log.info(
                    "http: closing %s: request body not complete within %g s",
                    self._peer,
                    body_timeout_s,
                )
                self._close(None)

        # -- refusing and closing ------------------------------------------------------

        def _refuse(self, response: bytes, why: str) -> None:
            """Parse nothing more; answer ``response`` and close once the complete
            requests before the refused bytes are answered (at once if none is owed)."""
            if self._refusing or self.transport.is_closing():
                return
            log.info("http: closing %s: %s", self._peer, why)
            self._refusing = True
            self._stop_deadlines()
            self._drop_unfinished()
            if self._cycles:
                self._refusal = response  # its "connection: close" tells the peer
            else:
                self._close(response)

        def _drop_unfinished(self) -> None:
            """The newest request, if its body never finished (the refused bytes were
            in it), is not answered: queued, it is never started; running, its handler
            is told the peer is gone (its reads end, its writes are dropped)."""
            if not self._cycles or not self._cycles[-1].more_body:
                return
            cycle = self._cycles.pop()
            queued = [entry for entry in self.pipeline if entry[0] is cycle]
            for entry in queued:
                self.pipeline.remove(entry)
            if not queued:
                cycle.disconnected = True
                cycle.message_event.set()

        def _disconnect_all(self) -> None:
            for cycle in self._cycles:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._cycles.clear()
            self.pipeline.clear()

        def _close(self, response: bytes | None) -> None:
            """Close, telling every request still served that its peer is gone first:
            uvicorn would learn it in ``connection_lost`` only, and on uvloop a handler
            writing before then raises on the closed handle."""
            self._disconnect_all()
            if self.transport.is_closing():
                return
            if response:
                self.transport.write(response)
            self.transport.close()

    return GuardedProtocol
