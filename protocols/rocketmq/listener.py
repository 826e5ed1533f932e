"""The RocketMQ 5 gRPC listener (port 8081 by default).

Served by polymq's own gRPC server (:mod:`polymq.protocols.grpc_server`) on the
loop's sockets: plaintext HTTP/2 on ``rocketmq`` (the official clients connect
without TLS unless told ``tls_enable=True``), gRPC over TLS on ``rocketmq_tls`` (the
gateway's live TLS context offering ``h2`` by ALPN, so SIGHUP reaches it; routes
answered there name the gateways' TLS endpoints). Connections are counted per client
through their Telemetry streams (:mod:`protocols.rocketmq.sessions`).
"""

from __future__ import annotations

from polymq.gateway.listeners import Listener, ListenerBase, ListenerContext
from polymq.protocols.grpc_server.connection import Limits
from polymq.protocols.grpc_server.server import GrpcServer
from polymq.protocols.rocketmq.activities.transaction import TransactionChecker
from polymq.protocols.rocketmq.options import RocketMQOptions
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.service import method_table
from polymq.storage.lifecycle import TaskSet

__all__ = ["RocketMQListener", "rocketmq_listener"]

_STOP_GRACE_S = 1.0
# HTTP/2 streams (RPCs) open at once on one connection.
_MAX_CONCURRENT_STREAMS = 1000
# Request metadata per RPC; the official clients send under 1 KiB (grpc's soft default
# is 8 KiB, its hard one 16 KiB).
_MAX_METADATA_BYTES = 16 << 10


class RocketMQListener(ListenerBase):
    def __init__(self, context: ListenerContext, options: RocketMQOptions | None = None) -> None:
        super().__init__(context.name, context.port)
        self._context = context
        self.services = RocketMQServices(
            processor=context.processor,
            accounts=context.accounts,
            config=context.config,
            connections=context.connections,
            options=options or RocketMQOptions(),
            directory=context.directory,
            quotas=context.quotas,
        )
        self.services.listener = context.name  # routes name this listener's endpoints
        self._checker = TransactionChecker(self.services)
        self._server: GrpcServer | None = None
        # The transaction checks and the receipt renewals; one set per start, so a
        # stopped listener can start again.
        self._tasks: TaskSet | None = None

    @property
    def open_connections(self) -> int:
        return self._server.connections if self._server is not None else 0

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"listener {self._name} is already started")
        limits = self._context.config.limits
        server = GrpcServer(
            method_table(self.services),
            Limits(
                max_message_bytes=limits.max_frame_bytes,
                handshake_timeout_s=limits.handshake_timeout_ms / 1000,
                # a peer that stops reading its answers is cut after this
                write_timeout_s=limits.frame_timeout_ms / 1000,
                # a silent peer is pinged this often, and cut if it does not answer
                keepalive_s=limits.frame_timeout_ms / 1000,
                max_concurrent_streams=_MAX_CONCURRENT_STREAMS,
                max_header_list_bytes=_MAX_METADATA_BYTES,
            ),
        )
        tls = self._context.tls
        try:
            self._address = await server.start(
                self._context.host,
                self._port,
                tls=tls.h2_context if tls is not None else None,
                # a worker of polymq run --workers N shares the port with the others
                reuse_port=self._context.config.workers.reuse_port,
            )
        except OSError as e:
            raise OSError(
                f"{self._name}: cannot bind {self._context.host}:{self._port}: {e}"
            ) from e
        self._server = server
        self._port = self._address[1]
        self.services.address = self._address
        tasks = self._tasks = TaskSet(f"rocketmq listener {self._name}")
        self._checker.start(tasks)
        self.services.renewer.start(tasks)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            await tasks.close()
        self.services.renewer.clear()
        self.services.sessions.close_all()  # ends Telemetry streams, so stop is quick
        await server.stop(_STOP_GRACE_S)
        self._address = None


def rocketmq_listener(context: ListenerContext, options: RocketMQOptions | None = None) -> Listener:
    return RocketMQListener(context, options)
