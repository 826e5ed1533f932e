"""The HTTP listener: uvicorn serving the app inside the gateway's own event loop.

uvicorn owns the connections here, so this is a small Listener of its own rather than
a ``TcpListener``: it binds the socket itself (so port 0 works and the bound address
is known at once), runs ``uvicorn.Server.serve(sockets=[sock])`` as a task, and stops
it by setting ``should_exit``. Each HTTP connection is entered in the gateway's
connection registry (and refused at its limits) by a subclass of uvicorn's httptools
protocol (:mod:`protocols.http.guarded`), which also holds slow and oversized request
heads and bodies to the gateway's limits. httptools is required: its C parser costs a
fraction of h11's pure-Python one per request, and the guards hook its callbacks.

The HTTPS listener (``https``, 8443) is the same app with the gateway's live TLS
context given to uvicorn (``Config.ssl``, set after ``load()`` so uvicorn builds none
of its own): the MNS API, ``/admin`` and ``/metrics`` over TLS. Its TLS handshake is
asyncio's, before a connection is made and registered, bounded by asyncio's own
handshake timeout (60 s; uvicorn passes none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from polymq.gateway.listeners import Listener, ListenerBase, ListenerContext
from polymq.protocols.http.app import HttpApp, build_app
from polymq.protocols.http.guarded import guarded_protocol

__all__ = ["HTTP_PARSER", "HttpListener", "http_listener"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
_GRACEFUL_STOP_S = 2
_KEEP_ALIVE_S = 75  # MNS clients keep connections open between calls
# The C parser the guarded protocol is built on (bench/http.py reports it).
HTTP_PARSER = "httptools"


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the gateway: the gateway's own stop
    handling shuts us down through ``should_exit``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpListener(ListenerBase):
    def __init__(self, context: ListenerContext, *, notify_retry_unit_ms: int = 1000) -> None:
        super().__init__(context.name, context.port)
        self._context = context
        self._notify_retry_unit_ms = notify_retry_unit_ms
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._http: HttpApp | None = None

    @property
    def app(self) -> HttpApp | None:
        return self._http

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"listener {self.name} is already started")
        host = self._context.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets that
        # say so, and without it every response waits ~40 ms behind Nagle.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._context.config.workers.reuse_port:  # shared by polymq run --workers N
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, self._context.port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        http = build_app(self._context, notify_retry_unit_ms=self._notify_retry_unit_ms)
        config = uvicorn.Config(
            http.asgi,
            lifespan="off",
            log_config=None,  # the gateway configured logging; uvicorn's loggers propagate
            log_level="warning",
            access_log=False,
            http=guarded_protocol(self._context.connections, self._context.config.limits),
            # No WebSocket route is served here: an Upgrade is answered in HTTP/1.1
            # (uvicorn's WebSocket protocol would take the connection out of the guards).
            ws="none",
            # The guard's head deadline (limits.handshake_timeout_ms) closes idle
            # keep-alive connections first when it is shorter.
            timeout_keep_alive=_KEEP_ALIVE_S,
            timeout_graceful_shutdown=_GRACEFUL_STOP_S,
            server_header=False,
            proxy_headers=False,  # no proxy in front to trust; and a layer less per request
        )
        if self._context.tls is not None:
            config.load()
            config.ssl = self._context.tls.context  # reloaded in place on SIGHUP
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn {self.name}")
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not server.started:
                if task.done():
                    sock.close()
                    await task  # raises what failed
                    raise RuntimeError(f"listener {self.name}: uvicorn stopped at start-up")
                await asyncio.sleep(0.005)
        sockname = sock.getsockname()
        self._address = (sockname[0], sockname[1])
        self._server, self._task, self._http = server, task, http
        await http.notifier.start_from(http.api.topics.http_subscriptions)

    def socket_options(self, level: int, option: int) -> list[int]:
        """``getsockopt`` of every open connection (for tests and diagnostics)."""
        if self._server is None:
            return []
        values = []
        for connection in list(self._server.server_state.connections):
            transport = getattr(connection, "transport", None)
            sock = transport.get_extra_info("socket") if transport is not None else None
            if sock is not None:
                values.append(sock.getsockopt(level, option))
        return values

    def requests_in_flight(self) -> int:
        """Requests whose handler is still running, on any connection (for tests and
        diagnostics: a handler can outlive its connection)."""
        return len(self._server.server_state.tasks) if self._server is not None else 0

    async def stop(self) -> None:
        server, task, http = self._server, self._task, self._http
        self._server = self._task = None
        if server is None or task is None:
            return
        if http is not None:
            await http.notifier.stop()
        server.should_exit = True
        try:
            await task
        finally:
            self._address = None


def http_listener(context: ListenerContext) -> Listener:
    """The gateway's factory for listener ``http`` (port 8080 by default)."""
    return HttpListener(context)
