"""Listener lifecycle: the sockets the protocols serve, started in order and stopped
in reverse. Which protocol serves which listener is the composition root's table
(``gateway.assembly.protocol_listeners``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from polymq.gateway.accounts import Accounts
from polymq.gateway.config import GatewayConfig
from polymq.gateway.connections import ConnectionRegistry, TooManyConnections, serving_connection
from polymq.gateway.fairness import FrameBudget
from polymq.gateway.metering import Metering
from polymq.gateway.quotas import Quotas
from polymq.gateway.tls import ServerTls
from polymq.navigation.endpoints import GatewayDirectory
from polymq.storage.clock import Clock
from polymq.storage.lifecycle import Service

if TYPE_CHECKING:
    from polymq.gateway.processor import Processor

__all__ = [
    "ConnectionHandler",
    "GatewayTcpListener",
    "Listener",
    "ListenerBase",
    "ListenerContext",
    "ListenerFactory",
    "ListenerSet",
    "TcpListener",
    "peer_certificate_name",
]

log = logging.getLogger(__name__)

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Listener(Protocol):
    """One served endpoint. ``port`` is the configured port (0: any free one);
    ``address`` is what it is bound to once started, ``None`` before."""

    @property
    def name(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def address(self) -> tuple[str, int] | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerContext:
    """What a protocol gets to build its listener: the gateway's shared services, never
    storage itself (protocols reach storage only through the processor)."""

    name: str
    host: str
    port: int
    config: GatewayConfig
    processor: Processor
    accounts: Accounts
    metering: Metering
    connections: ConnectionRegistry
    clock: Clock
    # The live gateways per protocol (Kafka Metadata, RocketMQ routes): only this one
    # in the merged form.
    directory: GatewayDirectory
    # Memory for frames being read, shared by every listener (limits.max_buffered_frame_bytes).
    frame_budget: FrameBudget
    # Per-account rates and connection limits (docs/quotas.md); none by default.
    quotas: Quotas = field(default_factory=Quotas)
    # The live TLS context ([tls]) for a TLS listener (config.TLS_LISTENERS); None
    # for a plaintext one.
    tls: ServerTls | None = None


ListenerFactory = Callable[[ListenerContext], Listener]


class ListenerSet(Service):
    """Listeners started in the given order and stopped in reverse, as one unit: if
    one fails to start, those already started are stopped again before the error
    propagates, so no half-started server keeps ports bound."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        super().__init__()
        names = [listener.name for listener in listeners]
        if len(set(names)) != len(names):
            raise ValueError(f"listener names repeat: {names}")
        self._listeners = list(listeners)
        self._started: list[Listener] = []

    def __iter__(self) -> Iterator[Listener]:
        return iter(self._listeners)

    def __len__(self) -> int:
        return len(self._listeners)

    def get(self, name: str) -> Listener | None:
        return next((x for x in self._listeners if x.name == name), None)

    async def start(self) -> None:
        for listener in self._listeners:
            try:
                await listener.start()
            except BaseException:
                await self.stop()
                raise
            self._started.append(listener)

    async def stop(self) -> None:
        """Stop started listeners in reverse order; a failure is logged and the rest
        are still stopped."""
        while self._started:
            listener = self._started.pop()
            try:
                await listener.stop()
            except Exception:
                log.exception("listener %s failed to stop cleanly", listener.name)

    async def close(self) -> None:
        await self.stop()
        await super().close()


class ListenerBase:
    """The ``name``, ``port`` and ``address`` of a :class:`Listener`, kept in ``_name``,
    ``_port`` and ``_address`` (which ``start`` sets and ``stop`` clears)."""

    def __init__(self, name: str, port: int) -> None:
        self._name = name
        self._port = port
        self._address: tuple[str, int] | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> tuple[str, int] | None:
        return self._address


class TcpListener(ListenerBase):
    """A TCP server handing each accepted connection to ``handler(reader, writer)``.

    It sets ``TCP_NODELAY`` on every accepted socket (small messages otherwise stall
    ~40 ms behind Nagle), registers each connection with ``connections`` when given
    (refusing it at the limit), and on stop cancels the handlers still running, so a
    stopped listener leaves no connection behind. A handler's exception closes only
    its own connection. With ``handshake_timeout_s``, a registered connection that the
    protocol has not marked established (``ConnectionRegistry.established`` or
    ``identify``) by then is closed: a socket that never logs in holds no slot for long.

    With ``tls``, the loop does the TLS handshake (at most ``handshake_timeout_s``)
    before the connection is registered and handed to the handler; the handshake
    deadline counts from the TCP accept, so it covers TLS and the protocol's login
    together. A failed handshake (wrong CA, an expired or refused client certificate,
    plaintext on a TLS port) closes that socket alone and never reaches the registry;
    asyncio logs it at DEBUG, as the peer's doing.
    """

    def __init__(
        self,
        *,
        name: str,
        host: str,
        port: int,
        handler: ConnectionHandler,
        connections: ConnectionRegistry | None = None,
        protocol: str | None = None,
        close_grace_s: float = 2.0,
        handshake_timeout_s: float | None = None,
        tls: ssl.SSLContext | None = None,
        reuse_port: bool = False,
        own_port: int | None = None,
    ) -> None:
        super().__init__(name, port)
        self._reuse_port = reuse_port
        self._own_port = own_port
        self._own_server: asyncio.Server | None = None
        self.shared_address: tuple[str, int] | None = None
        self._tls = tls
        self._handshake_timeout_s = handshake_timeout_s
        self._close_grace_s = close_grace_s
        self._host = host
        self._handler = handler
        self._connections = connections
        self._protocol = protocol or name
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def open_connections(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"listener {self._name} is already started")
        self._stopping = False
        loop = asyncio.get_running_loop()

        def accepted() -> asyncio.StreamReaderProtocol:
            # Called at the TCP accept, before any TLS handshake: the handshake
            # deadline counts from here.
            at = loop.time()

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await self._serve(reader, writer, accepted_at=at)

            return asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), serve, loop=loop)

        tls: dict[str, Any] = {}
        if self._tls is not None:
            # The loop's own TLS (the handler sees a connection only once it is done);
            # StreamWriter.start_tls after the accept stalls handshakes on uvloop.
            timeout_s = self._handshake_timeout_s or _TLS_HANDSHAKE_TIMEOUT_S
            tls = {"ssl": self._tls, "ssl_handshake_timeout": timeout_s}
        if self._reuse_port:
            tls["reuse_port"] = True
        self._server = await loop.create_server(accepted, self._host, self._port, **tls)
        sockname = self._server.sockets[0].getsockname()
        self._address = self.shared_address = (sockname[0], sockname[1])
        if self._own_port is not None:
            # A worker's port of its own beside the shared one (polymq run --workers:
            # Kafka names each worker as a broker there); ``address`` is this one,
            # the port clients are told to dial.
            tls.pop("reuse_port", None)
            try:
                self._own_server = await loop.create_server(
                    accepted, self._host, self._own_port, **tls
                )
            except BaseException:
                self._server.close()
                self._server = None
                raise
            own = self._own_server.sockets[0].getsockname()
            self._address = (own[0], own[1])

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        own, self._own_server = self._own_server, None
        if own is not None:
            own.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
        if own is not None:
            await own.wait_closed()
        self._address = self.shared_address = None

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, accepted_at: float
    ) -> None:
        task = asyncio.current_task()
        if self._stopping or task is None:
            writer.close()
            return
        sock: socket.socket | None = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = _format_peer(writer.get_extra_info("peername"))
        conn_id: int | None = None
        self._tasks.add(task)
        try:
            if self._connections is not None:

                async def close() -> None:
                    task.cancel()
                    if task is not asyncio.current_task():
                        await asyncio.wait([task])

                try:
                    conn_id = self._connections.register(
                        protocol=self._protocol,
                        peer=peer,
                        close=close,
                        tls=self._tls is not None,
                        certificate=_certificate_name(writer),
                    ).id
                except TooManyConnections as e:
                    log.warning("%s: refused %s: %s", self._name, peer, e)
                    return
                deadline = self._handshake_deadline(conn_id, peer, task, accepted_at)
                try:
                    with serving_connection(conn_id):
                        await self._handler(reader, writer)
                finally:
                    if deadline is not None:
                        deadline.cancel()
            else:
                await self._handler(reader, writer)
        except asyncio.CancelledError:
            pass  # stop() or a kick: the connection just closes
        except ConnectionError as e:  # the peer went away: not our bug
            log.debug("%s: connection from %s lost: %s", self._name, peer, e)
        except Exception:
            log.exception("%s: connection from %s failed; closing it", self._name, peer)
        finally:
            if conn_id is not None and self._connections is not None:
                self._connections.unregister(conn_id)
            try:
                await _close(writer, self._close_grace_s)
            finally:
                self._tasks.discard(task)  # only now: stop() waits for the close too

    def _handshake_deadline(
        self, conn_id: int, peer: str, task: asyncio.Task[None], accepted_at: float
    ) -> asyncio.TimerHandle | None:
        """Close the connection unless it is established ``handshake_timeout_s`` after
        its TCP accept (``accepted_at``, loop time): a TLS handshake's time counts."""
        connections, timeout = self._connections, self._handshake_timeout_s
        if connections is None or timeout is None:
            return None

        def expire() -> None:
            if not connections.is_established(conn_id) and not task.done():
                log.info("%s: closing %s: no handshake within %.1f s", self._name, peer, timeout)
                task.cancel()

        return asyncio.get_running_loop().call_at(accepted_at + timeout, expire)


class GatewayTcpListener(TcpListener):
    """A :class:`TcpListener` on a gateway listener's context: its name and address,
    the gateway's connection registry (``protocol`` names the connections there),
    handshake timeout (``limits.handshake_timeout_ms``: what counts as the handshake is
    the protocol's, marked with ``ConnectionRegistry.established`` or ``identify``) and
    TLS context (a TLS listener's). In a worker of ``polymq run --workers N`` its port
    is shared with the other workers (``SO_REUSEPORT``: the kernel spreads the
    connections), and ``own_port`` adds one of this worker's alone."""

    def __init__(
        self,
        context: ListenerContext,
        handler: ConnectionHandler,
        *,
        protocol: str,
        own_port: int | None = None,
    ) -> None:
        super().__init__(
            name=context.name,
            host=context.host,
            port=context.port,
            handler=handler,
            connections=context.connections,
            protocol=protocol,
            handshake_timeout_s=context.config.limits.handshake_timeout_ms / 1000,
            tls=context.tls.context if context.tls is not None else None,
            reuse_port=context.config.workers.reuse_port,
            own_port=own_port,
        )


async def _close(writer: asyncio.StreamWriter, grace_s: float) -> None:
    """Close after flushing what the handler wrote (a protocol's goodbye frame), but
    abort a peer that stops reading rather than let it hold up shutdown."""
    writer.close()
    try:
        async with asyncio.timeout(grace_s):
            await writer.wait_closed()
    except (TimeoutError, asyncio.CancelledError):
        writer.transport.abort()
    except OSError:
        pass


def _certificate_name(writer: asyncio.StreamWriter) -> str | None:
    """The subject common name of the client certificate a TLS peer sent (the loop
    verified it in the handshake), for the connection list; None without one."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    certificate = ssl_object.getpeercert()
    for rdn in (certificate or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


# The TLS handshake's bound on a listener without a handshake timeout (asyncio's own).
_TLS_HANDSHAKE_TIMEOUT_S = 60.0


def peer_certificate_name(writer: asyncio.StreamWriter, tls: ServerTls | None) -> str | None:
    """The account name a TLS connection's verified client certificate gives, when
    ``[tls] principal_from`` asks for it (:meth:`ServerTls.principal_name`)."""
    if tls is None:
        return None
    ssl_object = writer.get_extra_info("ssl_object")
    return tls.principal_name(ssl_object)


def _format_peer(peername: object) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)
