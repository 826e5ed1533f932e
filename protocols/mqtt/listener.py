"""The MQTT listeners: TCP (``mqtt``, 1883) and WebSocket (``mqtt_ws``, 8083, any
path, subprotocol ``mqtt``), and their TLS twins MQTTS (``mqtts``, 8883) and WSS
(``mqtt_wss``, 8084), all serving the same brokers.

Over WSS the TLS handshake is asyncio's under websockets (``serve(ssl=…)``), done
before the connection is made and registered, bounded by the same handshake timeout;
the upgrade's deadline still counts from the TCP accept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.typing import Subprotocol

from polymq.gateway.connections import serving_connection
from polymq.gateway.listeners import Listener, ListenerBase, ListenerContext
from polymq.protocols.mqtt.connection import MqttConnection
from polymq.protocols.mqtt.options import MqttOptions
from polymq.protocols.mqtt.services import MqttServices, services_for
from polymq.protocols.mqtt.tcp_listener import MqttTcpListener
from polymq.protocols.mqtt.transport import WebSocketTransport
from polymq.protocols.mqtt.ws_handshake import GuardedConnection, check_request

__all__ = ["MqttWebSocketListener", "mqtt_listener", "mqtt_ws_listener"]

log = logging.getLogger(__name__)

_SUBPROTOCOLS = [Subprotocol("mqtt"), Subprotocol("mqttv3.1")]
# Frames websockets holds for a connection beyond the one being read (its default is
# 16): past them it stops reading the socket, so a peer that sends faster than it is
# served holds at most this many frames, each at most the packet limit.
_MAX_QUEUED_FRAMES = 4


def mqtt_listener(context: ListenerContext, options: MqttOptions | None = None) -> Listener:
    return MqttTcpListener(context, services_for(context, options))


def mqtt_ws_listener(context: ListenerContext, options: MqttOptions | None = None) -> Listener:
    return MqttWebSocketListener(context, services_for(context, options))


class MqttWebSocketListener(ListenerBase):
    """MQTT over WebSocket (v5 6.0): binary frames carry the MQTT byte stream."""

    def __init__(self, context: ListenerContext, services: MqttServices) -> None:
        super().__init__(context.name, context.port)
        self._context = context
        self._services = services
        self._server: Server | None = None

    async def start(self) -> None:
        timeout_s = self._context.config.limits.handshake_timeout_ms / 1000

        class Connection(GuardedConnection):
            listener = self.name
            handshake_timeout_s = timeout_s
            registry = self._context.connections

        tls: dict[str, Any] = {}
        if self._context.tls is not None:
            tls = {"ssl": self._context.tls.context, "ssl_handshake_timeout": timeout_s}
        self._server = await serve(
            self._handle,
            self._context.host,
            self._context.port,
            subprotocols=_SUBPROTOCOLS,
            compression=None,
            # The HTTP upgrade and then CONNECT within one handshake deadline from the
            # TCP accept, kept by the connection (upgrade) and _handle (CONNECT), each
            # logging why it closes; messages bounded per connection by the transport
            # (small until CONNECT), and few of them queued.
            create_connection=Connection,
            process_request=check_request,
            open_timeout=None,
            max_size=self._services.config.max_packet_bytes + 8,
            max_queue=_MAX_QUEUED_FRAMES,
            ping_interval=None,
            # WSS: websockets' TLS is asyncio's, done before the connection is made
            # (and registered), within the same handshake timeout.
            **tls,
        )
        sockname = next(iter(self._server.sockets)).getsockname()
        self._address = (sockname[0], sockname[1])
        self._services.start()

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close(close_connections=True)
        await server.wait_closed()
        self._address = None
        await self._services.stop()

    async def _handle(self, websocket: ServerConnection) -> None:
        # Registered on the TCP accept (GuardedConnection), within the limits.
        assert isinstance(websocket, GuardedConnection) and websocket.connection_id is not None
        registry, conn_id = self._context.connections, websocket.connection_id
        sock = websocket.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as TcpListener
        task = asyncio.current_task()
        assert task is not None

        async def close() -> None:
            if task is not asyncio.current_task():
                task.cancel()
                await asyncio.wait([task])

        websocket.kick = close
        deadline = self._connect_deadline(websocket, conn_id, task)
        try:
            with serving_connection(conn_id), contextlib.suppress(asyncio.CancelledError):
                transport = WebSocketTransport(websocket)
                tls = self._context.tls
                ssl_object = websocket.transport.get_extra_info("ssl_object")
                name = tls.principal_name(ssl_object) if tls is not None else None
                await MqttConnection(
                    self._services, transport, conn_id, certificate_name=name
                ).run()
                await transport.drain()
        finally:
            deadline.cancel()
            registry.unregister(conn_id)
            await websocket.close()

    def _connect_deadline(
        self, websocket: GuardedConnection, conn_id: int, task: asyncio.Task[None]
    ) -> asyncio.TimerHandle:
        """CONNECT (and login) by the deadline the upgrade had, counted from the TCP
        accept: the upgrade does not give a peer another handshake timeout. The
        connection's own CONNECT timer runs as long again from now, so this one,
        earlier, is the one that fires (as the TCP listener's does for TCP)."""
        timeout_s = self._context.config.limits.handshake_timeout_ms / 1000
        registry = self._context.connections
        loop = asyncio.get_running_loop()
        when, peer = websocket.deadline, websocket.peer

        def expire() -> None:
            if not registry.is_established(conn_id) and not task.done():
                log.info("%s: closing %s: no CONNECT within %g s", self.name, peer, timeout_s)
                task.cancel()

        return loop.call_at(when, expire)
