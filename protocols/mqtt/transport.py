"""The byte pipes an MQTT connection runs over: a TCP stream or a WebSocket (whose
binary frames carry MQTT bytes with no regard to packet boundaries, v5 6.0)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol, cast

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

__all__ = ["TcpTransport", "Transport", "WebSocketTransport"]

log = logging.getLogger(__name__)

# Bytes one read hands the connection: what it decodes and handles before it reads
# again, whatever the size of the WebSocket message they came in.
READ_BYTES = 1 << 16
# Close codes websockets sends when it gives up on what the peer sent (RFC 6455 7.4.1).
_PEER_FAULTS = frozenset(
    (CloseCode.PROTOCOL_ERROR, CloseCode.INVALID_DATA, CloseCode.MESSAGE_TOO_BIG)
)


class Transport(Protocol):
    def read(self) -> Awaitable[bytes]:
        """The next bytes from the peer; ``b""`` once it has closed."""
        ...

    def write(self, data: bytes | bytearray) -> None:
        """Send ``data``, which the caller hands over (it is not changed afterwards)."""
        ...

    def limit_packets(self, max_bytes: int) -> None:
        """The largest packet now accepted (smaller before CONNECT is accepted): a
        transport that buffers whole messages itself bounds them by it."""
        ...

    def backlog(self) -> int:
        """Bytes written but not yet handed to the kernel."""
        ...

    def asked_to_park(self) -> bool:
        """After a read returned ``b""``: whether that was the transport asking the
        connection to park, not the peer's end."""
        ...

    def park(self) -> bool:
        """Park: the connection stops waiting with a task, and the transport starts
        it again when bytes come, the peer leaves, or :meth:`unpark` is called.
        False when bytes (or the peer's end) came meanwhile, or the transport
        cannot: read on."""
        ...

    def unpark(self) -> None:
        """Start a parked connection again now (to end it)."""
        ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class TcpTransport(asyncio.Protocol):
    """MQTT over TCP (or TLS) as the loop's protocol itself, not a StreamReader,
    StreamReaderProtocol and StreamWriter: those three, their futures and the deque
    of drain waiters weighed about 2.5 KiB per connection, and servers hold tens of
    thousands of mostly idle ones. An idle connection holds this object, its empty
    buffer and the one future its task awaits.

    What arrives while the connection handles a batch waits here, up to
    ``READ_BYTES``; past that reading pauses, so the peer is held back by TCP rather
    than by our memory (as StreamReader's limit did)."""

    __slots__ = (
        "_buffer",
        "_closed",
        "_drained",
        "_eof",
        "_loop",
        "_paused",
        "_transport",
        "_waiter",
    )

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        # Kept: asyncio.get_running_loop() is a getpid() system call each time (CPython
        # checks for a fork), and a read asks for a future per batch of packets.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buffer = b""
        self._eof = False
        self._paused = False  # reading paused: the buffer is full
        self._waiter: asyncio.Future[bytes] | None = None  # a read waiting for bytes
        self._drained: asyncio.Future[None] | None = None  # a drain waiting for room
        self._closed: asyncio.Future[None] | None = None  # wait_closed's

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCP transports have every method but do not subclass Transport)
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self._buffer = self._buffer + data if self._buffer else data
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(self._take())
                return
        if len(self._buffer) > READ_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._end()
        return True  # keep the transport: the connection closes it after its goodbye

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _end(self) -> None:
        """The peer closed (or the connection was lost): reads return ``b""`` once
        what arrived before is read."""
        self._eof = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._take())

    def _take(self) -> bytes:
        data, self._buffer = self._buffer[:READ_BYTES], self._buffer[READ_BYTES:]
        if self._paused and len(self._buffer) <= READ_BYTES and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    # -- Transport (what the MQTT connection uses) -----------------------------------

    def read(self) -> Awaitable[bytes]:
        # A future, not a coroutine: no frame per (mostly idle) connection.
        loop = self._loop or asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        if self._buffer or self._eof:
            future.set_result(self._take())
        else:
            self._waiter = future
        return future

    def write(self, data: bytes | bytearray) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def limit_packets(self, max_bytes: int) -> None:
        pass  # the decoder holds what a stream brings, and checks it

    def asked_to_park(self) -> bool:
        return False

    def park(self) -> bool:
        return False  # nobody to start the connection again (tcp_listener's can)

    def unpark(self) -> None:
        pass

    def backlog(self) -> int:
        transport = self._transport
        return 0 if transport is None else transport.get_write_buffer_size()

    async def drain(self) -> None:
        drained = self._drained
        if drained is not None:
            await asyncio.shield(drained)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def wait_closed(self) -> None:
        """Until the loop says the connection is gone (after ``close``)."""
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._closed)

    @property
    def lost(self) -> bool:
        """Whether the loop said the connection is gone."""
        return self._closed is not None and self._closed.done()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def get_extra_info(self, name: str) -> Any:
        return None if self._transport is None else self._transport.get_extra_info(name)


class WebSocketTransport:
    """Writes are queued and sent in order by one task, since a WebSocket send is a
    coroutine and MQTT's writers are not. Reads hand out at most ``READ_BYTES`` of a
    message at a time, as a TCP read would."""

    def __init__(self, websocket: ServerConnection) -> None:
        self._ws = websocket
        self._unread = b""
        self._pending: list[bytes | bytearray] = []
        self._queued = 0
        self._sender: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing: asyncio.Task[None] | None = None

    async def read(self) -> bytes:
        data = self._unread
        if not data:
            try:
                message = await self._ws.recv()
            except ConnectionClosed as e:
                self._closed_by_peer_fault(e)
                return b""
            data = message.encode() if isinstance(message, str) else bytes(message)
        self._unread = data[READ_BYTES:]
        return data[:READ_BYTES]

    def _closed_by_peer_fault(self, closed: ConnectionClosed) -> None:
        """websockets closes a peer that breaks the WebSocket protocol (or sends a
        message over the packet limit) without a word: say it, once, here."""
        sent = closed.sent
        if closed.rcvd is None and sent is not None and sent.code in _PEER_FAULTS:
            address = self._ws.remote_address
            peer = f"{address[0]}:{address[1]}" if address else "?"
            log.info("mqtt_ws: closing %s: %s", peer, sent)

    def limit_packets(self, max_bytes: int) -> None:
        # websockets buffers a whole message before recv() returns: bound it (a
        # message may hold a packet and the start of the next, hence the slack).
        self._ws.protocol.max_size = max_bytes + 8

    def write(self, data: bytes | bytearray) -> None:
        self._pending.append(data)
        self._queued += len(data)
        if self._sender is None or self._sender.done():
            self._idle.clear()
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        try:
            while self._pending:
                chunk = b"".join(self._pending)
                self._pending.clear()
                self._queued = 0
                await self._ws.send(chunk)
        except ConnectionClosed:
            self._pending.clear()
        finally:
            self._idle.set()

    def backlog(self) -> int:
        return self._queued

    def asked_to_park(self) -> bool:
        return False

    def park(self) -> bool:
        return False  # websockets reads in a task of its own anyway

    def unpark(self) -> None:
        pass

    async def drain(self) -> None:
        await self._idle.wait()

    def close(self) -> None:
        async def close_after_send() -> None:
            await self._idle.wait()
            await self._ws.close()

        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(close_after_send())
