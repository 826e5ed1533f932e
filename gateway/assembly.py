"""The composition root of a gateway: the one place that knows the list of protocols
and picks the storage backend.

Storage is named by URL (tansu's pattern), so the form is chosen once, here:

- ``file:///path``: the embedded engine over a data directory (the merged form; the
  default, from ``storage.data_dir``);
- ``memory://``: the embedded engine over a private directory in memory, discarded
  at close (tests, trials);
- ``polymq://host:port,host:port``: the separated form, storage nodes found through
  those nameservers (the default when ``cluster.nameservers`` is set).

Below this module nothing asks which backend it got: the gateway, the processor and
every protocol see a :class:`~storage.api.StorageAPI`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from polymq.gateway.config import ConfigError, GatewayConfig, engine_config
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import ListenerFactory
from polymq.gateway.roles import register_batch_formats
from polymq.gateway.tls import internal_tls
from polymq.nameserver.client import NameserverClient
from polymq.navigation.directory import NavigationDirectory
from polymq.navigation.endpoints import GatewayDirectory
from polymq.protocols.amqp.listener import amqp_listener
from polymq.protocols.http.listener import http_listener
from polymq.protocols.kafka.listener import kafka_listener
from polymq.protocols.mqtt.listener import mqtt_listener, mqtt_ws_listener
from polymq.protocols.rocketmq.listener import rocketmq_listener
from polymq.storage.api import StorageAPI
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.cluster import ClusterStorage
from polymq.storage.engine import Engine
from polymq.storage.memory import MemoryEngine
from polymq.storage.remote import RemoteStorage
from polymq.storage.replicated.config import parse_nats_url
from polymq.storage.replicated.standalone import standalone_engine

__all__ = [
    "SCHEMES",
    "build_gateway",
    "open_storage",
    "protocol_listeners",
    "storage_url",
]

log = logging.getLogger(__name__)

SCHEMES = ("file", "memory", "polymq", "nats")


def protocol_listeners() -> Mapping[str, ListenerFactory]:
    """Listener name (a key of ``[listeners]``) to the factory of its protocol server."""
    return {
        "kafka": kafka_listener,
        "amqp": amqp_listener,
        "mqtt": mqtt_listener,
        "mqtt_ws": mqtt_ws_listener,
        "rocketmq": rocketmq_listener,
        "http": http_listener,
        # TLS beside them ([tls]; docs/tls.md): the same servers over the live context.
        "kafka_tls": kafka_listener,
        "amqps": amqp_listener,
        "mqtts": mqtt_listener,
        "mqtt_wss": mqtt_ws_listener,
        "rocketmq_tls": rocketmq_listener,
        "https": http_listener,
    }


def storage_url(config: GatewayConfig) -> str:
    """``storage.url`` when set; else the separated form's when nameservers are
    configured, else the embedded engine over ``storage.data_dir``."""
    if config.storage.url:
        return config.storage.url
    if config.cluster.nameservers:
        return "polymq://" + ",".join(config.cluster.nameservers)
    return config.storage.data_dir.resolve().as_uri()


def open_storage(url: str, config: GatewayConfig, clock: Clock) -> StorageAPI:
    """The storage backend ``url`` names, not started yet."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        data_dir = Path(unquote(parts.path))
        settings = dataclasses.replace(config.storage, data_dir=data_dir)
        return Engine(engine_config(dataclasses.replace(config, storage=settings)), clock=clock)
    if parts.scheme == "memory":
        return MemoryEngine(engine_config(config), clock=clock)
    if parts.scheme == "polymq":
        nameservers = [address for address in parts.netloc.split(",") if address]
        if not nameservers:
            raise ConfigError(f"storage URL {url!r} names no nameserver (polymq://host:port,…)")
        tls = internal_tls(config.tls)  # [tls] internal: mutual TLS to the pool
        client_ssl = tls.client if tls is not None else None
        return ClusterStorage(
            NameserverClient(nameservers, ssl=client_ssl),
            lambda node: RemoteStorage(node.host, node.port, ssl=client_ssl),
            start_timeout_s=max(0, config.cluster.storage_wait_ms) / 1000,
        )
    if parts.scheme == "nats":
        servers, options = parse_nats_url(url)
        if not servers:
            raise ConfigError(f"storage URL {url!r} names no NATS server (nats://host:port,…)")
        try:
            replication = dataclasses.replace(
                config.replication,
                nats=servers,
                replicas=int(options.get("replicas", config.replication.replicas)),
            )
        except ValueError as exc:
            raise ConfigError(f"storage URL {url!r}: {exc}") from exc
        shard = options.get("shard", "merged")
        engine = engine_config(config)
        return standalone_engine(
            replication,
            shard,
            dataclasses.replace(engine, data_dir=Path(engine.data_dir) / shard),
            owner=options.get("owner", f"{socket.gethostname()}:{os.getpid()}"),
            clock=clock,
            on_lost=_stop_this_process,
        )
    raise ConfigError(
        f"storage URL {url!r}: unknown scheme {parts.scheme!r} (one of {', '.join(SCHEMES)})"
    )


def _stop_this_process(error: BaseException) -> None:
    """A merged server whose shard went to another server stops (fail-stop, as after
    a disk error): a standby serves, and a supervisor restarts this one as a standby."""
    log.critical("stopping: %s", error)
    os.kill(os.getpid(), signal.SIGTERM)


def build_gateway(
    config: GatewayConfig,
    *,
    clock: Clock | None = None,
    listener_factories: Mapping[str, ListenerFactory] | None = None,
    directory: GatewayDirectory | None = None,
    storage: StorageAPI | None = None,
) -> Gateway:
    """A gateway over the storage its configuration names (or ``storage``, shared by
    several gateways in tests), registered with navigation when one is configured
    (unless ``directory`` says who the peers are), serving every built protocol."""
    register_batch_formats()
    clock = clock or SystemClock()
    url = storage_url(config)
    storage = storage if storage is not None else open_storage(url, config, clock)
    peers: GatewayDirectory | Callable[[Gateway], GatewayDirectory] | None = directory
    # Only gateways of the separated form register: a merged server is its own peer.
    if peers is None and config.cluster.navigation and url.startswith("polymq:"):

        def peers(gateway: Gateway) -> GatewayDirectory:
            tls = internal_tls(config.tls)
            return NavigationDirectory(
                config.cluster.navigation,
                ssl=tls.client if tls is not None else None,
                gateway_id=gateway.gateway_id,
                zone=config.cluster.zone,
                endpoints=gateway.own_endpoints,
                load=lambda: float(len(gateway.connections)),
                heartbeat_ms=config.cluster.heartbeat_ms,
            )

    return Gateway(
        config,
        storage=storage,
        clock=clock,
        listener_factories=protocol_listeners()
        if listener_factories is None
        else listener_factories,
        directory=peers,
    )
