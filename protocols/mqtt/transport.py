"""The byte pipes an MQTT connection runs over: a TCP stream or a WebSocket (whose
binary frames carry MQTT bytes with no regard to packet boundaries, v5 6.0)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol

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

    def write(self, data: bytes) -> None: ...

    def limit_packets(self, max_bytes: int) -> None:
        """The largest packet now accepted (smaller before CONNECT is accepted): a
        transport that buffers whole messages itself bounds them by it."""
        ...

    def backlog(self) -> int:
        """Bytes written but not yet handed to the kernel."""
        ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class TcpTransport:
    __slots__ = ("_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    def read(self) -> Awaitable[bytes]:
        # The reader's coroutine itself, not one around it: a frame less per
        # (mostly idle) connection.
        return self._reader.read(READ_BYTES)

    def write(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    def limit_packets(self, max_bytes: int) -> None:
        pass  # the decoder holds what a stream brings, and checks it

    def backlog(self) -> int:
        return self._writer.transport.get_write_buffer_size()

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


class WebSocketTransport:
    """Writes are queued and sent in order by one task, since a WebSocket send is a
    coroutine and MQTT's writers are not. Reads hand out at most ``READ_BYTES`` of a
    message at a time, as a TCP read would."""

    def __init__(self, websocket: ServerConnection) -> None:
        self._ws = websocket
        self._unread = b""
        self._pending: list[bytes] = []
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

    def write(self, data: bytes) -> None:
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

    async def drain(self) -> None:
        await self._idle.wait()

    def close(self) -> None:
        async def close_after_send() -> None:
            await self._idle.wait()
            await self._ws.close()

        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(close_after_send())
