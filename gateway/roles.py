"""The processes of the separated form other than the gateway, each run from the one
configuration: ``polymq storage``, ``polymq nameserver`` and ``polymq navigation``.

Part of the composition root: it reads the whole configuration and hands each role
only its own settings, so the storage node, the nameserver and navigation never import
the gateway's configuration. Each role imports its own server when it starts: a
process's start-up time is mostly its imports, and a nameserver need not load the
storage engine, nor a storage node the navigation service's web framework.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from polymq.gateway.config import GatewayConfig, engine_config
from polymq.gateway.foreground import announce
from polymq.gateway.tls import internal_tls
from polymq.protocols.kafka.records import BATCH_FORMAT, expand_batch
from polymq.storage import batch_formats
from polymq.storage.replicated.config import ReplicationConfig

if TYPE_CHECKING:
    from polymq.storage.engine import Engine, EngineConfig
    from polymq.storage.node import StorageNode
    from polymq.storage.node_metrics import MetricsServer

__all__ = [
    "register_batch_formats",
    "serve_nameserver",
    "serve_navigation",
    "serve_node",
    "shard_names",
]

log = logging.getLogger(__name__)


def register_batch_formats() -> None:
    """Batches stored raw by a protocol (Kafka's record batches) are expanded when
    another protocol reads one message at a time: every process that holds or reads
    storage needs the expanders, which only the root may name."""
    if not batch_formats.is_registered(BATCH_FORMAT):
        batch_formats.register(BATCH_FORMAT, expand_batch)


def _announce_metrics(metrics: MetricsServer | None) -> None:
    """cluster_tool learns a storage process's ``/metrics`` port from this line."""
    if metrics is not None:
        announce(log, "storage node: metrics on http://%s:%d/metrics", *metrics.address)


async def serve_node(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Run a storage node from the gateway's config until ``stop`` is set
    (``polymq storage``): the shards it holds leases of in the replicated pool, or
    one engine over its own disk."""
    from polymq.storage.engine import Engine
    from polymq.storage.node import StorageNode
    from polymq.storage.node_metrics import serving_metrics

    register_batch_formats()
    if config.replication.enabled:
        await _serve_shards(config, stop)
        return
    engine = Engine(engine_config(config))
    tls = internal_tls(config.tls)
    node = StorageNode(
        engine,
        config.node.node_id or None,
        host=config.server.host,
        port=config.node.port,
        nameservers=config.cluster.nameservers,
        heartbeat_ms=config.cluster.heartbeat_ms,
        advertised_host=config.cluster.advertised_host or None,
        server_ssl=tls.server if tls is not None else None,
        client_ssl=tls.client if tls is not None else None,
    )
    await node.start()
    try:
        async with serving_metrics(
            config.node.metrics_port,
            config.server.host,
            lambda: [(node.node_id, engine.log_stats)],
        ) as metrics:
            _announce_metrics(metrics)
            host, port = node.address
            log.info("storage node: id %s", node.node_id)
            listening = "storage node: listening on %s:%d (advertised as %s)"
            announce(log, listening, host, port, node.advertised_host)
            log.info("storage node: data in %s", engine.config.data_dir)
            log.info(
                "storage node: nameservers %s",
                ", ".join(node.nameservers)
                if node.nameservers
                else "none (not registered anywhere)",
            )
            announce(log, "storage node: ready")
            await stop.wait()
    finally:
        await node.close()


def shard_names(replication: ReplicationConfig) -> list[str]:
    """``shard-1`` … ``shard-N``, and any other name a node prefers."""
    names = [f"shard-{i}" for i in range(1, replication.shards + 1)]
    return names + [shard for shard in replication.prefer if shard not in names]


async def _serve_shards(config: GatewayConfig, stop: asyncio.Event) -> None:
    from polymq.storage.node import StorageNode
    from polymq.storage.node_metrics import serving_metrics
    from polymq.storage.replicated.host import ShardHost
    from polymq.storage.replicated.pool import NatsPool

    replication = config.replication
    name = config.node.node_id or f"{config.server.host}:{config.node.port}"
    base = engine_config(config)

    def shard_config(shard: str) -> EngineConfig:
        return dataclasses.replace(base, data_dir=Path(base.data_dir) / shard)

    tls = internal_tls(config.tls)

    def shard_node(engine: Engine, shard: str, epoch: int) -> StorageNode:
        return StorageNode(
            engine,
            shard,
            host=config.server.host,
            port=0,  # each shard its own port: the route says which
            nameservers=config.cluster.nameservers,
            heartbeat_ms=config.cluster.heartbeat_ms,
            advertised_host=config.cluster.advertised_host or None,
            epoch=epoch,
            owner=name,
            server_ssl=tls.server if tls is not None else None,
            client_ssl=tls.client if tls is not None else None,
        )

    host = ShardHost(
        NatsPool(replication, owner=name),
        shards=shard_names(replication),
        prefer=replication.prefer,
        engine_config=shard_config,
        node=shard_node,
    )
    await host.start()
    try:
        async with serving_metrics(
            config.node.metrics_port,
            config.server.host,
            lambda: [(shard, served.log.stats) for shard, served in host.served.items()],
            host.pool.stats,
        ) as metrics:
            _announce_metrics(metrics)
            nats = ", ".join(replication.nats)
            log.info("storage node: %s, replicated pool over NATS %s", name, nats)
            log.info(
                "storage node: %d replicas, lease %d ms", replication.replicas, replication.lease_ms
            )
            log.info(
                "storage node: serving shards %s", ", ".join(sorted(host.served)) or "none yet"
            )
            # cluster_tool learns a storage process's address from this line: the port
            # of its first shard (the shard's own route is in the nameserver).
            served = sorted(host.served.values(), key=lambda s: s.node.node_id)
            if served:
                announce(log, "storage node: listening on %s:%d", *served[0].node.address)
            announce(log, "storage node: ready")
            await stop.wait()
    finally:
        await host.close()


async def serve_nameserver(config: GatewayConfig, stop: asyncio.Event) -> None:
    """``polymq nameserver``: serve until ``stop`` is set (signals are the caller's).

    Warm-up after a start: three node heartbeat intervals (bounded by the expiry), the
    time every live node needs to report in."""
    from polymq.nameserver.server import Nameserver

    expiry_ms = config.nameserver.node_expiry_ms
    nameserver = Nameserver(
        host=config.server.host,
        port=config.nameserver.port,
        node_expiry_ms=expiry_ms,
        warmup_ms=min(expiry_ms, 3 * config.cluster.heartbeat_ms),
        ssl=_server_ssl(config),
    )
    async with nameserver:
        host, port = nameserver.address
        announce(log, "nameserver: listening on %s:%d, node expiry %d ms", host, port, expiry_ms)
        announce(log, "ready")
        await stop.wait()
        log.info("stopping")
    log.info("stopped")


async def serve_navigation(config: GatewayConfig, stop: asyncio.Event) -> None:
    """``polymq navigation``: serve until ``stop`` is set (signals are the caller's)."""
    from polymq.navigation.server import NavigationServer

    expiry_ms = config.navigation.gateway_expiry_ms
    async with NavigationServer(
        host=config.server.host,
        port=config.navigation.port,
        gateway_expiry_ms=expiry_ms,
        ssl=_server_ssl(config),
    ) as navigation:
        url = navigation.url
        announce(log, "navigation: listening on %s, gateway expiry %d ms", url, expiry_ms)
        announce(log, "ready")
        await stop.wait()
        log.info("stopping")
    log.info("stopped")


def _server_ssl(config: GatewayConfig) -> ssl.SSLContext | None:
    """The servers' side of ``[tls] internal`` (mutual TLS), if it is on."""
    tls = internal_tls(config.tls)
    return tls.server if tls is not None else None
