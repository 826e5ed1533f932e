"""The navigation process: the FastAPI app on uvicorn, inside the caller's event loop.

Run as the gateway's HTTP listener runs uvicorn (protocols/http/listener.py): the
socket is bound here (so port 0 works and the address is known at once), uvicorn
serves it as a task and stops through ``should_exit``; signals stay with the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from ssl import SSLContext

import uvicorn

from polymq.navigation.app import build_app
from polymq.navigation.registry import GatewayRegistry
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.lifecycle import Service

__all__ = ["NavigationServer"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class NavigationServer(Service):
    """The navigation service's lifecycle (``async with``). ``port`` 0 picks a free
    port (see :attr:`address`)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        gateway_expiry_ms: int = 10_000,
        clock: Clock | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        super().__init__()
        # HTTPS for the gateways' heartbeats and clients' questions ([tls] internal).
        self._ssl = ssl
        self.host = host
        self.port = port
        self.registry = GatewayRegistry(gateway_expiry_ms=gateway_expiry_ms)
        self.app = build_app(self.registry, clock or SystemClock())
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("the navigation server is not started")
        return self._address

    @property
    def url(self) -> str:
        host, port = self.address
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the navigation server is already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            server_header=False,
        )
        if self._ssl is not None:
            config.load()
            config.ssl = self._ssl
        server = _EmbeddedServer(config)
        task = self.tasks.spawn(server.serve(sockets=[sock]), name="uvicorn navigation")
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                while not server.started:
                    if task.done():
                        await task  # raises what failed
                        raise RuntimeError("navigation: uvicorn stopped at start-up")
                    await asyncio.sleep(0.005)
        except BaseException:
            sock.close()
            task.cancel()
            raise
        sockname = sock.getsockname()
        self._address = (sockname[0], sockname[1])
        self._server, self._task = server, task

    async def close(self) -> None:
        """uvicorn is asked to stop (its connections end gracefully), not cancelled."""
        server, task = self._server, self._task
        self._server = self._task = None
        try:
            if server is not None and task is not None:
                server.should_exit = True
                await task
        finally:
            self._address = None
            await super().close()
