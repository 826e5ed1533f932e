"""The processes of the separated form other than the gateway, each run from the one
configuration: ``polymq storage``, ``polymq nameserver`` and ``polymq navigation``.

Part of the composition root: it reads the whole configuration and hands each role
only its own settings, so the storage node, the nameserver and navigation never import
the gateway's configuration.
"""

from __future__ import annotations

import asyncio
import logging

from polymq.gateway.config import GatewayConfig, engine_config
from polymq.nameserver.server import Nameserver
from polymq.navigation.server import NavigationServer
from polymq.protocols.kafka.records import BATCH_FORMAT, expand_batch
from polymq.storage import batch_formats
from polymq.storage.engine import Engine
from polymq.storage.node import StorageNode

__all__ = ["register_batch_formats", "serve_nameserver", "serve_navigation", "serve_node"]

log = logging.getLogger(__name__)


def register_batch_formats() -> None:
    """Batches stored raw by a protocol (Kafka's record batches) are expanded when
    another protocol reads one message at a time: every process that holds or reads
    storage needs the expanders, which only the root may name."""
    if not batch_formats.is_registered(BATCH_FORMAT):
        batch_formats.register(BATCH_FORMAT, expand_batch)


async def serve_node(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Run a storage node from the gateway's config until ``stop`` is set
    (``polymq storage``)."""
    register_batch_formats()
    engine = Engine(engine_config(config))
    node = StorageNode(
        engine,
        config.node.node_id or None,
        host=config.server.host,
        port=config.node.port,
        nameservers=config.cluster.nameservers,
        heartbeat_ms=config.cluster.heartbeat_ms,
        advertised_host=config.cluster.advertised_host or None,
    )
    await node.start()
    try:
        host, port = node.address
        log.info("storage node: id %s", node.node_id)
        log.info(
            "storage node: listening on %s:%d (advertised as %s)", host, port, node.advertised_host
        )
        log.info("storage node: data in %s", engine.config.data_dir)
        log.info(
            "storage node: nameservers %s",
            ", ".join(node.nameservers) if node.nameservers else "none (not registered anywhere)",
        )
        log.info("storage node: ready")
        await stop.wait()
    finally:
        await node.close()


async def serve_nameserver(config: GatewayConfig, stop: asyncio.Event) -> None:
    """``polymq nameserver``: serve until ``stop`` is set (signals are the caller's).

    Warm-up after a start: three node heartbeat intervals (bounded by the expiry), the
    time every live node needs to report in."""
    expiry_ms = config.nameserver.node_expiry_ms
    nameserver = Nameserver(
        host=config.server.host,
        port=config.nameserver.port,
        node_expiry_ms=expiry_ms,
        warmup_ms=min(expiry_ms, 3 * config.cluster.heartbeat_ms),
    )
    async with nameserver:
        host, port = nameserver.address
        log.info("nameserver: listening on %s:%d, node expiry %d ms", host, port, expiry_ms)
        log.info("ready")
        await stop.wait()
        log.info("stopping")
    log.info("stopped")


async def serve_navigation(config: GatewayConfig, stop: asyncio.Event) -> None:
    """``polymq navigation``: serve until ``stop`` is set (signals are the caller's)."""
    expiry_ms = config.navigation.gateway_expiry_ms
    async with NavigationServer(
        host=config.server.host, port=config.navigation.port, gateway_expiry_ms=expiry_ms
    ) as navigation:
        log.info("navigation: listening on %s, gateway expiry %d ms", navigation.url, expiry_ms)
        log.info("ready")
        await stop.wait()
        log.info("stopping")
    log.info("stopped")
