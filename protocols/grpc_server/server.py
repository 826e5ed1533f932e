"""A gRPC server on the loop's own sockets: plaintext HTTP/2 ("prior knowledge", as
grpc clients speak it) or TLS with ALPN ``h2``."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from polymq.protocols.grpc_server.calls import Method
from polymq.protocols.grpc_server.connection import Http2Connection, Limits

__all__ = ["GrpcServer", "h2_tls_context"]


def h2_tls_context(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context`` offering HTTP/2 by ALPN, which grpc clients require of a server."""
    context.set_alpn_protocols(["h2"])
    return context


class GrpcServer:
    """Serves ``methods`` (keyed by their ``/package.Service/Method`` path)."""

    def __init__(self, methods: dict[str, Method], limits: Limits) -> None:
        self._methods = {path.encode(): method for path, method in methods.items()}
        self._limits = limits
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Http2Connection] = set()
        self._all_gone: asyncio.Event | None = None

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(
        self, host: str, port: int, *, tls: ssl.SSLContext | None = None, reuse_port: bool = False
    ) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {}
        if tls is not None:
            extra = {"ssl": tls, "ssl_handshake_timeout": self._limits.handshake_timeout_s}
        self._server = await loop.create_server(
            self._accepted, host, port, reuse_port=reuse_port or None, **extra
        )
        address = self._server.sockets[0].getsockname()
        return address[0], address[1]

    def _accepted(self) -> Http2Connection:
        return Http2Connection(self._methods, self._limits, self._connections.add, self._gone)

    def _gone(self, connection: Http2Connection) -> None:
        self._connections.discard(connection)
        if not self._connections and self._all_gone is not None:
            self._all_gone.set()

    async def stop(self, grace_s: float) -> None:
        """Stop listening, tell every peer to go away, and close the connections once
        their calls end, cutting what is left after ``grace_s``."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        self._all_gone = asyncio.Event()
        for connection in list(self._connections):
            connection.drain()
        if self._connections:
            try:
                async with asyncio.timeout(grace_s):
                    await self._all_gone.wait()
            except TimeoutError:
                for connection in list(self._connections):
                    connection.abort()  # (its loss is reported in a later loop turn)
                await asyncio.sleep(0)
        self._all_gone = None
        await server.wait_closed()
