"""The RocketMQ 5 gRPC listener (port 8081 by default).

grpc owns the socket, so this is a small :class:`~gateway.listeners.Listener` of its
own rather than a ``TcpListener``: plaintext HTTP/2 (the official clients connect
without TLS unless told ``tls_enable=True``), ``SO_REUSEPORT`` off so a taken port is an
error rather than a silently shared one. Connections are counted per client through
their Telemetry streams (:mod:`protocols.rocketmq.sessions`).
"""

from __future__ import annotations

import logging

import grpc

from gateway.listeners import Listener, ListenerContext
from protocols.rocketmq.activities.transaction import TransactionChecker
from protocols.rocketmq.options import RocketMQOptions
from protocols.rocketmq.runtime import Runtime
from protocols.rocketmq.service import messaging_service

__all__ = ["RocketMQListener", "rocketmq_listener"]

log = logging.getLogger(__name__)

_STOP_GRACE_S = 1.0


class RocketMQListener:
    def __init__(self, context: ListenerContext, options: RocketMQOptions | None = None) -> None:
        self._context = context
        self._name = context.name
        self._host = context.host
        self._port = context.port
        self.runtime = Runtime(
            processor=context.processor,
            accounts=context.accounts,
            config=context.config,
            connections=context.connections,
            options=options or RocketMQOptions(),
            directory=context.directory,
        )
        self._checker = TransactionChecker(self.runtime)
        self._server: grpc.aio.Server | None = None
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

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"listener {self._name} is already started")
        max_bytes = self._context.config.limits.max_frame_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.max_send_message_length", max_bytes),
            ]
        )
        server.add_generic_rpc_handlers((messaging_service(self.runtime),))
        try:
            host = f"[{self._host}]" if ":" in self._host else self._host
            port = server.add_insecure_port(f"{host}:{self._port}")
        except RuntimeError as e:
            raise OSError(f"{self._name}: cannot bind {self._host}:{self._port}: {e}") from e
        if port == 0:
            raise OSError(f"{self._name}: cannot bind {self._host}:{self._port}")
        await server.start()
        self._server = server
        self._address = (self._host, port)
        self.runtime.address = self._address
        self._checker.start()
        self.runtime.renewer.start()

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await self._checker.stop()
        await self.runtime.renewer.stop()
        self.runtime.sessions.close_all()  # ends Telemetry streams, so stop is quick
        await server.stop(_STOP_GRACE_S)
        self._address = None


def rocketmq_listener(context: ListenerContext, options: RocketMQOptions | None = None) -> Listener:
    return RocketMQListener(context, options)
