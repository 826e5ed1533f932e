"""The RocketMQ 5 gRPC listener (port 8081 by default).

grpc owns the socket, so this is a small :class:`~gateway.listeners.Listener` of its
own rather than a ``TcpListener``: plaintext HTTP/2 on ``rocketmq`` (the official
clients connect without TLS unless told ``tls_enable=True``), gRPC over TLS on
``rocketmq_tls`` (grpc's own TLS, with credentials that fetch the gateway's current
certificate at each handshake, so SIGHUP reaches it; routes answered there name the
gateways' TLS endpoints). Connections are counted per client through their Telemetry
streams (:mod:`protocols.rocketmq.sessions`).

grpcio's server gives up for good on some hostile requests (see
:mod:`protocols.rocketmq.grpc_guard`), so the listener supervises it: the moment grpc's
serving loop fails, a fresh server is bound to the same port (``SO_REUSEPORT``, so it
listens before grpc closes the failed one's socket and no connect is refused) and
started; the failed server's RPCs in flight finish within a grace period, its
streams are then cancelled and its clients reconnect to the new one. ``SO_REUSEPORT`` is
only there for that hand-over: at start the port is bound once without it, so a port
another process listens on is still an error rather than a silently shared one.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc

from polymq.gateway.listeners import Listener, ListenerBase, ListenerContext
from polymq.protocols.rocketmq.activities.transaction import TransactionChecker
from polymq.protocols.rocketmq.grpc_guard import ServingLoop, install_log_filters
from polymq.protocols.rocketmq.options import RocketMQOptions
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.service import messaging_service
from polymq.storage.lifecycle import TaskSet

__all__ = ["RocketMQListener", "rocketmq_listener"]

log = logging.getLogger(__name__)

_STOP_GRACE_S = 1.0
# HTTP/2 streams (RPCs) open at once on one connection; grpc's default is unbounded.
_MAX_CONCURRENT_STREAMS = 1000
# Request metadata per RPC; the official clients send under 1 KiB (grpc's soft default
# is 8 KiB, its hard one 16 KiB).
_MAX_METADATA_BYTES = 16 << 10
_KEEPALIVE_TIMEOUT_MS = 20_000
_REBIND_FIRST_DELAY_S = 0.01
_REBIND_MAX_DELAY_S = 1.0


class RocketMQListener(ListenerBase):
    def __init__(self, context: ListenerContext, options: RocketMQOptions | None = None) -> None:
        super().__init__(context.name, context.port)
        self._context = context
        self._host = context.host
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
        self._tls = context.tls
        self._checker = TransactionChecker(self.services)
        self._server: grpc.aio.Server | None = None
        # The supervisor, the transaction checks and the receipt renewals; one set per
        # start, so a stopped listener can start again.
        self._tasks: TaskSet | None = None
        self._restarts = 0
        self._failure: BaseException | None = None
        self._successor: grpc.aio.Server | None = None
        self._retiring: set[grpc.aio.Server] = set()

    @property
    def restarts(self) -> int:
        """How many times grpc's server gave up and a fresh one took its port."""
        return self._restarts

    def _grpc_options(self) -> list[tuple[str, int]]:
        limits = self._context.config.limits
        return [
            ("grpc.so_reuseport", 1),  # for the hand-over only; see _claim_port
            ("grpc.max_receive_message_length", limits.max_frame_bytes),
            ("grpc.max_send_message_length", limits.max_frame_bytes),
            # the connection is closed unless the client's HTTP/2 preface and first
            # SETTINGS frame arrive within this (grpc's default is 120 s)
            ("grpc.server_handshake_timeout_ms", limits.handshake_timeout_ms),
            ("grpc.max_concurrent_streams", _MAX_CONCURRENT_STREAMS),
            ("grpc.max_metadata_size", _MAX_METADATA_BYTES),
            ("grpc.absolute_max_metadata_size", _MAX_METADATA_BYTES),
            # a connection with RPCs open is pinged this often and closed if the ping
            # is not answered: a peer that stops reading does not hold it for ever
            ("grpc.keepalive_time_ms", limits.frame_timeout_ms),
            ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ]

    def _bind(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=self._grpc_options())
        server.add_generic_rpc_handlers((messaging_service(self.services),))
        address = f"{_bracketed(self._host)}:{self._port}"
        try:
            if self._tls is not None:
                port = server.add_secure_port(address, self._tls.grpc_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"{self._name}: cannot bind {self._host}:{self._port}: {e}") from e
        if port == 0:
            raise OSError(f"{self._name}: cannot bind {self._host}:{self._port}")
        return server

    async def _serve(self, server: grpc.aio.Server) -> ServingLoop:
        serving = ServingLoop(self._failed)
        self._server = server
        await serving.start(server)
        return serving

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"listener {self._name} is already started")
        install_log_filters()
        if not (self._context.config.workers.reuse_port and self._port):
            # A worker of polymq run --workers N shares the port with the others
            # (grpc binds it with SO_REUSEPORT): it is not ours alone to claim.
            self._port = _claim_port(self._name, self._host, self._port)
        serving = await self._serve(self._bind())
        self._address = (self._host, self._port)
        self.services.address = self._address
        tasks = self._tasks = TaskSet(f"rocketmq listener {self._name}")
        tasks.spawn(self._supervise(serving), name=f"{self._name}-grpc")
        self._checker.start(tasks)
        self.services.renewer.start(tasks)

    def _failed(self, error: BaseException) -> None:
        """grpc's serving loop just failed; its socket still listens for an instant.
        Bind the successor now (synchronously), so it is listening before that one
        closes and a client connecting meanwhile is queued rather than refused."""
        self._failure = error
        if self._server is None:
            return  # stopping
        try:
            self._successor = self._bind()
        except OSError as e:
            log.info("%s: the successor could not bind at once (%s), trying again", self._name, e)

    async def _supervise(self, serving: ServingLoop) -> None:
        while True:
            if serving.task is None:
                log.warning("%s: grpc's serving task was not found; not supervised", self._name)
                return
            await asyncio.wait((serving.task,))
            old = self._server
            if old is None:
                return  # stopping
            error = self._failure
            log.warning(
                "%s: grpc's server gave up (%s); a fresh one serves port %d, the RPCs "
                "open on the old one finish or are cancelled within %.0f s",
                self._name,
                f"{type(error).__name__}: {error}" if error else "its serving loop ended",
                self._port,
                _STOP_GRACE_S,
            )
            successor, self._successor = self._successor, None
            if successor is None:
                successor = await self._bind_again()
            if serving.shutdown is not None:
                await asyncio.wait((serving.shutdown,))
            self._retiring.add(old)
            serving = await self._serve(successor)
            self._restarts += 1
            await self._dispose(old)
            self._retiring.discard(old)

    async def _bind_again(self) -> grpc.aio.Server:
        delay = _REBIND_FIRST_DELAY_S
        while True:
            try:
                return self._bind()
            except OSError as e:
                log.info("%s: %s; trying again in %.2f s", self._name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _REBIND_MAX_DELAY_S)

    @staticmethod
    async def _dispose(server: grpc.aio.Server) -> None:
        """End a server grpc gave up on: its calls finished or cancelled, its core
        objects freed. Its Telemetry sessions end as their streams are cancelled."""
        for _ in range(2):  # a first stop may re-raise the serving loop's exception
            try:
                await server.stop(_STOP_GRACE_S)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # grpc's own failure, logged by the supervisor
                continue

    async def stop(self) -> None:
        if self._server is None:
            return
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            await tasks.close()
        server, self._server = self._server, None
        successor, self._successor = self._successor, None
        self.services.renewer.clear()
        self.services.sessions.close_all()  # ends Telemetry streams, so stop is quick
        if successor is not None:  # bound, not started: only a started server frees its port
            await successor.start()
            await successor.stop(None)
        for retiring in (*self._retiring, *((server,) if server is not None else ())):
            await self._dispose(retiring)
        self._retiring.clear()
        self._address = None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _claim_port(name: str, host: str, port: int) -> int:
    """Bind ``host:port`` once without ``SO_REUSEPORT``: fails if anything listens on it
    already (the server then binds it with ``SO_REUSEPORT`` for its hand-overs); a port
    of 0 becomes the free port the kernel picks, so a successor binds the same one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise OSError(f"{name}: cannot resolve {host}: {e}") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise OSError(f"{name}: cannot bind {host}:{port}: {e}") from e
        return int(probe.getsockname()[1])


def rocketmq_listener(context: ListenerContext, options: RocketMQOptions | None = None) -> Listener:
    return RocketMQListener(context, options)
