"""The nameserver process: the :class:`~nameserver.registry.Registry` served over the
storage RPC (:mod:`storage.rpc`), with a periodic sweep that expires silent nodes.

It keeps nothing on disk: a restarted nameserver is whole again once every node has
heartbeated (one interval), and several run side by side without talking to each
other, each told everything by every node (RocketMQ's NameServer).
"""

from __future__ import annotations

import logging
from ssl import SSLContext

from polymq.nameserver.registry import Registry
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.errors import InvalidArgument
from polymq.storage.lifecycle import Service
from polymq.storage.names import check_name
from polymq.storage.routes import NodeHeartbeat, RouteTable
from polymq.storage.rpc import Handler, RpcServer

__all__ = ["Nameserver", "NameserverService"]

log = logging.getLogger(__name__)


class NameserverService:
    """The RPC methods, one per registry question, with time taken from ``clock``.
    Arguments arrive from the network, so each is checked before the registry sees it
    (a bad one is an ``invalid_argument`` error to that caller only)."""

    def __init__(self, registry: Registry, clock: Clock) -> None:
        self.registry = registry
        self._clock = clock

    async def heartbeat(self, hb: NodeHeartbeat) -> int:
        """The routes' version after recording ``hb``."""
        return self.registry.heartbeat(hb, self._clock.now_ms())

    async def routes(self, since_version: int = 0) -> RouteTable | None:
        if type(since_version) is not int:
            raise InvalidArgument(f"since_version must be an integer, got {since_version!r}")
        return self.registry.routes(since_version)

    async def place_topic(self, namespace: str, topic: str) -> str:
        check_name("namespace", namespace)
        check_name("topic", topic)
        return self.registry.place_topic(namespace, topic, self._clock.now_ms())

    async def place_home(self, namespace: str) -> str:
        check_name("namespace", namespace)
        return self.registry.place_home(namespace, self._clock.now_ms())

    async def status(self) -> RouteTable:
        return self.registry.status()

    def handlers(self) -> dict[str, Handler]:
        return {
            "heartbeat": self.heartbeat,
            "routes": self.routes,
            "place_topic": self.place_topic,
            "place_home": self.place_home,
            "status": self.status,
        }

    async def expire_forever(self, interval_ms: int) -> None:
        """Expire silent nodes every ``interval_ms`` until cancelled."""
        while True:
            await self._clock.sleep_until(self._clock.now_ms() + interval_ms)
            self.registry.expire(self._clock.now_ms())


class Nameserver(Service):
    """A nameserver's lifecycle: the RPC server and the expiry sweep, started and
    stopped together (``async with``). ``port`` 0 picks a free port (see
    :attr:`address`). ``warmup_ms``: see :class:`Registry`."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        node_expiry_ms: int = 10_000,
        warmup_ms: int = 0,
        clock: Clock | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        super().__init__()
        self._clock: Clock = clock or SystemClock()
        self.registry = Registry(
            node_expiry_ms=node_expiry_ms,
            started_ms=self._clock.now_ms(),
            warmup_ms=warmup_ms,
        )
        self.service = NameserverService(self.registry, self._clock)
        # ``ssl``: TLS for nodes and gateways ([tls] internal; mutual when it asks).
        self._server = RpcServer(self.service.handlers(), host, port, ssl=ssl)
        # A node is declared dead at most a quarter of the expiry late.
        self._sweep_ms = max(10, min(1000, node_expiry_ms // 4))

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    async def start(self) -> None:
        await self._server.start()
        self.tasks.spawn(self.service.expire_forever(self._sweep_ms), name="nameserver expiry")

    async def close(self) -> None:
        await super().close()
        await self._server.close()
