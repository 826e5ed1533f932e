"""The MQTT TCP listener (``mqtt``, and ``mqtts`` with TLS): the gateway's
:class:`~polymq.gateway.listeners.TcpListener` contract (TCP_NODELAY, the connection
registry and its limits, the handshake deadline from the TCP accept, TLS by the loop,
every connection closed on stop), served with :class:`TcpTransport` as the loop's
protocol instead of asyncio streams.

Why not the gateway's listener: its StreamReader, StreamReaderProtocol, StreamWriter
and the closures around each connection's handler weighed about 3.5 KiB per
connection, most of the memory an idle MQTT connection held (docs/mqtt.md, "Memory
per connection")."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
from typing import Any

from polymq.gateway.connections import TooManyConnections, serve_connection
from polymq.gateway.listeners import ListenerBase, ListenerContext
from polymq.protocols.mqtt.connection import MqttConnection
from polymq.protocols.mqtt.idle_sockets import IdleSockets, idle_sockets
from polymq.protocols.mqtt.services import MqttServices
from polymq.protocols.mqtt.transport import TcpTransport

__all__ = ["MqttTcpListener"]

log = logging.getLogger(__name__)

_CLOSE_GRACE_S = 2.0  # for the goodbye to flush before a peer that stops reading is cut


class MqttTcpListener(ListenerBase):
    """MQTT over TCP (or TLS), one :class:`_Served` per connection."""

    def __init__(self, context: ListenerContext, services: MqttServices) -> None:
        super().__init__(context.name, context.port)
        self._context = context
        self._services = services
        self._server: asyncio.AbstractServer | None = None
        self._served: set[_Served] = set()  # until the loop says each is gone
        self._stopping = False
        # Parked connections' sockets, off the loop's transports (plain TCP only).
        self._idle: IdleSockets | None = None

    @property
    def open_connections(self) -> int:
        return len(self._served)

    @property
    def parked_connections(self) -> int:
        """Connections idle with no task (for tests and the curious: it counts)."""
        served = list(self._served)  # (a copy: read from another thread in tests)
        return sum(1 for s in served if s.connection is not None and s.connection.parked)

    @property
    def detached_connections(self) -> int:
        """Parked connections whose socket waits in :attr:`_idle`, with no transport."""
        return len(self._idle) if self._idle is not None else 0

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"listener {self._name} is already started")
        self._stopping = False
        loop = asyncio.get_running_loop()
        timeout_s = self._context.config.limits.handshake_timeout_ms / 1000
        tls: dict[str, Any] = {}
        if self._context.tls is not None:
            # The loop's own TLS: a connection is made (and registered) once it is done.
            tls = {"ssl": self._context.tls.context, "ssl_handshake_timeout": timeout_s}

        def accepted() -> _Served:
            # At the TCP accept, before any TLS handshake: the deadline counts from here.
            return _Served(self, loop.time())

        # A worker of polymq run --workers N shares the port with the others.
        reuse_port = self._context.config.workers.reuse_port
        self._server = await loop.create_server(
            accepted, self._context.host, self._context.port, reuse_port=reuse_port, **tls
        )
        sockname = self._server.sockets[0].getsockname()
        self._address = (sockname[0], sockname[1])
        if self._context.tls is None:  # a TLS session lives in its transport: kept
            self._idle = idle_sockets(loop)
        self._services.start()

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        served = list(self._served)
        # Each ended as an admin's kick ends it: a parked one started again to end.
        await asyncio.gather(*(s.kick() for s in served), return_exceptions=True)
        await asyncio.gather(*(_close(s) for s in served))  # their goodbyes flushed
        await server.wait_closed()
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.close()
        self._address = None
        await self._services.stop()

    # -- one connection ------------------------------------------------------------------

    def serve(self, served: _Served, accepted_at: float) -> None:
        """Register the connection made on ``served`` and start its task, or close it
        (the listener stopping, a connection limit reached)."""
        transport = served._transport
        assert transport is not None
        if self._stopping:
            transport.close()
            return
        sock: socket.socket | None = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = _format_peer(transport.get_extra_info("peername"))
        registry = self._context.connections
        try:
            conn_id = registry.register(
                protocol="mqtt",
                peer=peer,
                close=served.kick,
                tls=self._context.tls is not None,
                certificate=_certificate_name(transport.get_extra_info("ssl_object")),
            ).id
        except TooManyConnections as e:
            log.warning("%s: refused %s: %s", self._name, peer, e)
            transport.close()
            return
        tls = self._context.tls
        name = tls.principal_name(transport.get_extra_info("ssl_object")) if tls else None
        served.conn_id = conn_id
        served.connection = MqttConnection(self._services, served, conn_id, certificate_name=name)
        self._served.add(served)
        self.resume(served)
        # Not a timer per connection: one entry in the services' deadlines, asked
        # for the handshake deadline, then whether the connection idles (to park).
        timeout_s = self._context.config.limits.handshake_timeout_ms / 1000
        first = min(timeout_s, self._services.options.park_after_s)
        self._services.deadlines.add(served, accepted_at + first)

    def resume(self, served: _Served) -> None:
        """Start (or start again, after a park) the connection's ``run()`` as a task.
        Its coroutine is the task's, with no coroutine around it to unregister and
        close (a frame per connection): its end is a callback, :meth:`ended`."""
        connection = served.connection
        assert connection is not None
        if connection.parked:  # asked again whether it idles, a while from now
            self._services.deadlines.discard(served)  # (still filed if it parked early)
            loop_time = asyncio.get_running_loop().time()
            self._services.deadlines.add(served, loop_time + self._services.options.park_after_s)
        context = contextvars.copy_context()
        context.run(serve_connection, served.conn_id)  # the task's log lines name it
        task = asyncio.get_running_loop().create_task(connection.run(), context=context)
        task.add_done_callback(served.ended)
        served.task = task

    def ended(self, served: _Served, task: asyncio.Task[None]) -> None:
        """The connection's task ended: parked (idle, the connection lives on with
        no task), or the connection's end: unregister it, say why if it failed, close
        its socket after what it wrote, and cut a peer that does not read that
        within the grace."""
        if served.task is not task:
            return  # bytes came meanwhile: a newer run() serves it
        connection = served.connection
        if connection is not None and connection.parked:
            if not task.cancelled():
                served.task = None  # idle: nothing but the connection's state held
                if served.went_idle():  # (not the park at once after CONNACK)
                    served.detach(self._idle)
                return
            # Cancelled before it ran (so it could not end the connection): run it
            # again, to end. The kick's wake does not start it when the wake that
            # made this task was the transport's (it is used up): start it here.
            connection.kick()
            if served.task is task:
                self.resume(served)
            return
        self._context.connections.unregister(served.conn_id)
        self._services.deadlines.discard(served)
        if not task.cancelled():  # cancelled: stop() or a kick; it just closes
            error = task.exception()
            if error is not None:
                peer = _format_peer(served.get_extra_info("peername"))
                if isinstance(error, ConnectionError):  # the peer went away: not our bug
                    log.debug("%s: connection from %s lost: %s", self._name, peer, error)
                else:
                    log.error(
                        "%s: connection from %s failed; closing it",
                        self._name,
                        peer,
                        exc_info=error,
                    )
        served.close()
        if served.lost:
            self._served.discard(served)
        else:
            asyncio.get_running_loop().call_later(_CLOSE_GRACE_S, served.abort)

    def release(self, held: int) -> None:
        """A detached socket's descriptor taken back (or closed) by its connection."""
        if self._idle is not None:
            self._idle.release(held)

    def lost(self, served: _Served) -> None:
        """The loop says the connection is gone: forgotten once its task ended too
        (until then stop() still has the task to cancel)."""
        task = served.task
        if task is None or task.done():
            self._served.discard(served)

    def due(self, served: _Served, now: float) -> float | None:
        """The deadlines' question for ``served`` (protocols/mqtt/deadlines.py):
        before CONNECT is accepted, the handshake deadline from the TCP accept; then,
        every ``park_after_s``, whether it received nothing since the last look
        while its connection waits for bytes: then it parks (and is not asked again
        until it wakes). When to ask again, or None."""
        task = served.task
        if task is None and served.connection is not None and served.connection.parked:
            served.detach(self._idle)  # parked since CONNACK, and still idle
            return None
        if task is None or task.done():
            return None  # ended, or parked
        if not self._context.connections.is_established(served.conn_id):
            timeout_s = self._context.config.limits.handshake_timeout_ms / 1000
            deadline = served._accepted_at + timeout_s
            if now < deadline:
                return deadline
            peer = _format_peer(served.get_extra_info("peername"))
            log.info("%s: closing %s: no handshake within %.1f s", self._name, peer, timeout_s)
            task.cancel()
            return None
        if served.idle_since_asked():
            return None  # asked to park
        return now + self._services.options.park_after_s


class _Served(TcpTransport):
    """A connection's transport that, once made, asks the listener to serve it.

    Parked a while, it gives its loop transport up and leaves the bare socket with
    the listener's :class:`IdleSockets` (:meth:`detach`); it takes a transport again
    (:meth:`readable`) when the socket has something to read, or when the connection
    writes (a delivery to an idle subscriber) or closes, and what it writes
    meanwhile waits for it."""

    __slots__ = (
        "_accepted_at",
        "_active",
        "_attaching",
        "_held",
        "_listener",
        "_on_attach",
        "_sleeping",
        "_unsent",
        "conn_id",
        "connection",
        "deadline_tick",
        "task",
    )

    def __init__(self, listener: MqttTcpListener, accepted_at: float) -> None:
        super().__init__()
        self._listener = listener
        self._accepted_at = accepted_at
        self.task: asyncio.Task[None] | None = None  # run()'s, None while parked
        self.connection: MqttConnection | None = None
        self._sleeping = False  # parked: bytes (or the peer's end) start run() again
        self._active = True  # bytes came since the deadlines last asked
        self.conn_id = 0
        self.deadline_tick = 0  # (protocols/mqtt/deadlines.py)
        # Detached: the socket's descriptor, held in the listener's IdleSockets (-1:
        # not detached), then the task that gives it a transport again, what the
        # connection wrote meanwhile, and _CLOSE or _ABORT if it asked for that.
        self._held = -1
        self._attaching: asyncio.Task[None] | None = None
        self._unsent = b""
        self._on_attach = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.connection is None:
            self._listener.serve(self, self._accepted_at)
            return
        # A transport again, for the socket it detached.
        unsent, self._unsent = self._unsent, b""
        if unsent:
            self.write(unsent)
        if self._on_attach == _ABORT:
            self.abort()
        elif self._on_attach == _CLOSE:
            self.close()

    def data_received(self, data: bytes) -> None:
        self._active = True
        super().data_received(data)
        self.unpark()

    def eof_received(self) -> bool:
        keep = super().eof_received()
        self.unpark()
        return keep

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.unpark()
        self._listener.lost(self)

    def idle_since_asked(self) -> bool:
        """Ask the connection to park if nothing came since the last call and it
        waits for bytes (its read answered ``b""``, :meth:`park` then True)."""
        waiter = self._waiter
        if self._active or waiter is None or waiter.done() or self._buffer or self._eof:
            self._active = False
            return False
        self._waiter = None
        self._sleeping = True
        waiter.set_result(b"")
        return True

    def asked_to_park(self) -> bool:
        return self._sleeping

    def park(self) -> bool:
        if self._buffer or self._eof or self._transport is None:
            self._sleeping = False  # bytes (or the peer's end) came meanwhile: read on
            return False
        self._sleeping = True
        return True

    def unpark(self) -> None:
        if self._sleeping:
            connection = self.connection
            if connection is not None and connection.parked:
                self._sleeping = False
                self._listener.resume(self)

    def ended(self, task: asyncio.Task[None]) -> None:
        self._listener.ended(self, task)

    def went_idle(self) -> bool:
        """Whether it parked because the deadlines found it idle (see :meth:`due`)."""
        return not self._active

    # -- detached: the socket without a loop transport ---------------------------------

    def detach(self, idle: IdleSockets | None) -> None:
        """Hand the socket of this parked connection to ``idle`` and drop the loop's
        transport, when nothing is left to write (or to read) on it."""
        transport = self._transport
        if (
            idle is None
            or transport is None
            or self._buffer
            or self._eof
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        held = -1
        try:
            held = os.dup(sock.fileno())
            idle.hold(held, self)
        except OSError as e:  # out of descriptors, say: it stays attached
            log.warning("mqtt: cannot detach an idle socket: %s", e)
            if held >= 0:
                os.close(held)
            return
        # The transport's close is not this connection's end: its socket lives on as
        # ``held``, and closing the transport's own descriptor says nothing to the peer.
        transport.set_protocol(_DETACHED)
        transport.abort()
        self._transport = None
        self._held = held
        self._accepted_at = 0.0  # long past its handshake: no float of its own kept
        if self.connection is not None:
            self.connection.shed()

    def readable(self) -> None:
        """The detached socket has bytes or the peer's end (IdleSockets), or the
        connection needs to write or close: give it a transport again."""
        held, self._held = self._held, -1
        if held < 0:
            return
        self._listener.release(held)
        loop = self._loop or asyncio.get_running_loop()
        self._attaching = loop.create_task(self._attach(held))

    async def _attach(self, held: int) -> None:
        loop = self._loop or asyncio.get_running_loop()
        try:
            sock = socket.socket(fileno=held)
        except OSError as e:
            os.close(held)
            self.connection_lost(e)
            return
        try:
            await loop.connect_accepted_socket(lambda: self, sock)
        except Exception as e:  # the loop closing: the connection ends here
            sock.close()
            self.connection_lost(e)
        finally:
            self._attaching = None

    def _detached(self) -> bool:
        return self._transport is None and (self._held >= 0 or self._attaching is not None)

    def write(self, data: bytes | bytearray) -> None:
        if self._detached():
            self._unsent += data
            self.readable()
            return
        super().write(data)

    def backlog(self) -> int:
        return super().backlog() + len(self._unsent)

    def close(self) -> None:
        if self._detached():
            self._end_detached(_CLOSE)
            return
        super().close()

    def abort(self) -> None:
        if self._detached():
            self._end_detached(_ABORT)
            return
        super().abort()

    def _end_detached(self, how: int) -> None:
        """Close (or abort) with no transport: at once when nothing waits to be
        written, else once the transport it is getting has written it."""
        if self._held >= 0 and not self._unsent:
            held, self._held = self._held, -1
            self._listener.release(held)
            os.close(held)
            self.connection_lost(None)
            return
        self._on_attach = max(self._on_attach, how)
        self.readable()

    def due(self, now: float) -> float | None:
        return self._listener.due(self, now)

    async def kick(self) -> None:
        """The registry's close (an admin's kick, the gateway's shutdown): end the
        connection and wait for it. A running task is cancelled; a parked
        connection is started again to end (a task cancelled before its first step
        would not run the connection's end at all)."""
        connection = self.connection
        if connection is None:
            self.close()
            return
        if connection.parked:
            connection.kick()
        elif self.task is not None:
            self.task.cancel()
        task = self.task
        if task is not None and task is not asyncio.current_task():
            await asyncio.wait([task])


_CLOSE, _ABORT = 1, 2  # what a detached connection asked for before its transport came
# The protocol a detached socket's old transport reports its close to: nobody.
_DETACHED = asyncio.Protocol()


async def _close(served: TcpTransport) -> None:
    """Close after flushing what the connection wrote (its goodbye), but abort a peer
    that stops reading rather than let it hold up shutdown."""
    served.close()
    try:
        async with asyncio.timeout(_CLOSE_GRACE_S):
            await served.wait_closed()
    except (TimeoutError, asyncio.CancelledError):
        served.abort()


def _certificate_name(ssl_object: Any) -> str | None:
    """The subject common name of the client certificate a TLS peer sent (the loop
    verified it in the handshake), for the connection list; None without one (as the
    gateway's TCP listener says it)."""
    if ssl_object is None:
        return None
    certificate = ssl_object.getpeercert()
    for rdn in (certificate or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _format_peer(peername: object) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)
