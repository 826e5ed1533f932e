"""The gateway: the stateless compute node, composed once over a storage backend.

It is given its storage (any :class:`~storage.api.StorageAPI`) and its protocols'
listener factories; which backend and which protocols is decided once, by the
composition root (:mod:`gateway.assembly`), as RocketMQ's proxy decides between
``createForLocalMode`` and ``createForClusterMode``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from polymq.gateway.accounts import Accounts
from polymq.gateway.config import TLS_LISTENERS, GatewayConfig
from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.fairness import FrameBudget
from polymq.gateway.listeners import (
    Listener,
    ListenerContext,
    ListenerFactory,
    ListenerSet,
)
from polymq.gateway.metering import Metering
from polymq.gateway.processor import Processor
from polymq.gateway.quotas import Quotas
from polymq.gateway.tls import server_tls
from polymq.navigation.endpoints import (
    GatewayDirectory,
    GatewayEndpoint,
    RegisteredDirectory,
    SingleGateway,
)
from polymq.storage.api import StorageAPI
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.errors import NamespaceAlreadyExists, StorageUnavailable
from polymq.storage.lifecycle import Service

__all__ = ["Gateway"]

log = logging.getLogger(__name__)


class Gateway(Service):
    """Storage, accounts, metering, connections, the processor and the listeners,
    with one lifecycle: ``async with`` starts storage, creates the configured
    namespaces and starts the listeners; leaving stops the listeners in reverse,
    closes remaining connections, then closes storage. Storage that does not answer
    at the start does not stop it: the listeners serve (storage calls answer each
    protocol's retryable error) and the configured namespaces are created once it does.

    ``gateway.assembly.build_gateway`` builds one from the configuration; several
    gateways over one storage (tests) are composed here directly.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        storage: StorageAPI,
        clock: Clock | None = None,
        listener_factories: Mapping[str, ListenerFactory] | None = None,
        directory: GatewayDirectory | Callable[[Gateway], GatewayDirectory] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.storage = storage
        self.accounts = Accounts(config.auth)
        self.metering = Metering()
        # Per-account rates and connection limits, per gateway process (docs/quotas.md).
        self.quotas = Quotas(config.quotas, config.auth, self.clock)
        limits = config.limits
        self.connections = ConnectionRegistry(
            max_connections=limits.max_connections,
            max_per_protocol=limits.max_connections_per_protocol,
            max_per_address=limits.max_connections_per_address,
            metering=self.metering,
            clock=self.clock,
            quotas=self.quotas,
        )
        # Frames being read, all listeners together (gateway.fairness).
        self.frame_budget = FrameBudget(limits.max_buffered_frame_bytes)
        self.processor = Processor(storage, self.accounts, self.metering, self.clock)
        # The TLS listeners' live context ([tls]); None: they are not served.
        self.tls = server_tls(config.tls)
        # A factory when the directory needs the gateway itself (its endpoints, load).
        if isinstance(directory, GatewayDirectory):
            self.directory: GatewayDirectory = directory
        elif directory is not None:
            self.directory = directory(self)
        else:
            # Ports are filled in as the listeners bind (port 0 is any free one).
            self.directory = SingleGateway(self.gateway_id, {}, config.cluster.advertised_host)
        factories = listener_factories or {}
        self.listeners = ListenerSet(self._build_listeners(factories))
        # Enabled in the config but no protocol serves them yet: reported at start-up.
        self.unbuilt = tuple(
            name
            for name, listener in config.listeners.items()
            if listener.enabled and name not in factories and self._serves_tls(name)
        )
        self._storage_started = False

    @property
    def gateway_id(self) -> str:
        """This gateway's name in navigation: configured, or its advertised host and
        the port of its first listener (unique on one machine, stable across restarts
        when the ports are fixed)."""
        if self.config.cluster.gateway_id:
            return self.config.cluster.gateway_id
        host = self.config.cluster.advertised_host or self.config.server.host
        ports = [listener.port for _, listener in self.config.listeners.items() if listener.enabled]
        return f"{host}:{ports[0] if ports else 0}"

    def own_endpoints(self) -> dict[str, GatewayEndpoint]:
        """Where clients reach this gateway, by protocol (listener name), once the
        listeners are bound."""
        host = self.config.cluster.advertised_host or self.config.server.host
        return {
            listener.name: GatewayEndpoint(
                gateway_id=self.gateway_id,
                host=host,
                port=listener.address[1],
                zone=self.config.cluster.zone,
            )
            for listener in self.listeners
            if listener.address is not None
        }

    def _serves_tls(self, name: str) -> bool:
        """A TLS listener is served only when [tls] names a certificate."""
        return name not in TLS_LISTENERS or self.tls is not None

    def reload_tls(self) -> None:
        """Load [tls]'s files again into the live TLS listeners (SIGHUP): new
        connections get the new certificate, open ones carry on. Raises ConfigError
        (and changes nothing) when a file is bad."""
        if self.tls is not None:
            self.tls.reload()

    def _build_listeners(self, factories: Mapping[str, ListenerFactory]) -> list[Listener]:
        built: list[Listener] = []
        for name, listener in self.config.listeners.items():
            factory = factories.get(name)
            if not listener.enabled or factory is None or not self._serves_tls(name):
                continue
            context = ListenerContext(
                name=name,
                host=self.config.server.host,
                port=listener.port,
                config=self.config,
                processor=self.processor,
                accounts=self.accounts,
                metering=self.metering,
                connections=self.connections,
                clock=self.clock,
                directory=self.directory,
                frame_budget=self.frame_budget,
                quotas=self.quotas,
                tls=self.tls if name in TLS_LISTENERS else None,
            )
            built.append(factory(context))
        return built

    def namespaces(self) -> list[str]:
        """Namespaces the gateway makes sure exist: configured ones and every account's."""
        return sorted(set(self.config.server.namespaces) | self.accounts.namespaces())

    async def start(self) -> None:
        await self.storage.start()
        self._storage_started = True
        try:
            missing = await self._create_namespaces(self.namespaces())
            if missing:
                log.warning(
                    "storage unavailable: namespaces %s are created once it answers",
                    ", ".join(missing),
                )
                self.tasks.spawn(self._create_later(missing), name="gateway-namespaces")
            await self.listeners.start()
            if isinstance(self.directory, SingleGateway):
                for listener in self.listeners:
                    if listener.address is not None:
                        self.directory.set_port(listener.name, listener.address[1])
            if isinstance(self.directory, RegisteredDirectory):
                await self.directory.start()
        except BaseException:
            await self.close()
            raise

    async def _create_namespaces(self, namespaces: list[str]) -> list[str]:
        """Create each namespace; those storage could not take now (no live node, a
        shard moving) are returned, to be created later rather than fail the start."""
        missing: list[str] = []
        for namespace in namespaces:
            try:
                await self.storage.create_namespace(namespace)
            except NamespaceAlreadyExists:
                pass
            except StorageUnavailable:
                missing.append(namespace)
        return missing

    async def _create_later(self, namespaces: list[str]) -> None:
        """Retry until every namespace exists (backing off to 2 s between tries)."""
        delay_s = 0.1
        while namespaces:
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)
            namespaces = await self._create_namespaces(namespaces)
        log.info("storage answers: configured namespaces exist")

    async def close(self) -> None:
        """Idempotent; each step runs even if an earlier one failed, so storage is
        always closed (and flushed) last."""
        await self.tasks.close()  # first: no namespace creation left over closed storage
        try:
            if isinstance(self.directory, RegisteredDirectory):
                await self.directory.close()  # first: clients stop being sent here
            await self.listeners.stop()
            await self.connections.close_all()
        finally:
            if self._storage_started:
                self._storage_started = False
                await self.storage.close()
            await super().close()
