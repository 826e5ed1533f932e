"""The gateway's process: the merged server (one process, embedded storage, every
enabled listener) or a gateway of the separated form, run in the foreground by
:mod:`polymq.gateway.foreground`; SIGHUP reloads the TLS certificate, key and CA
files ([tls], docs/tls.md)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Mapping

from polymq.gateway.assembly import build_gateway, storage_url
from polymq.gateway.config import GatewayConfig
from polymq.gateway.foreground import announce, on_reload_signal, run_foreground
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import ListenerFactory
from polymq.gateway.log_format import ConnectionFields

__all__ = ["run", "serve"]

log = logging.getLogger("polymq")


async def serve(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    listener_factories: Mapping[str, ListenerFactory] | None = None,
) -> None:
    """Run until ``stop`` is set, then shut down in order.

    Logs one line per fact an operator checks first (data dir, durability, each
    listener's bound address) and ``ready`` once every listener accepts connections.
    """
    stop = stop or asyncio.Event()
    url = storage_url(config)
    gateway = build_gateway(config, listener_factories=listener_factories)
    if url.startswith("polymq:"):
        log.info(
            "storage: %s (storage nodes through the nameservers); navigation %s; gateway id %s",
            url,
            config.cluster.navigation or "none",
            gateway.gateway_id,
        )
    else:
        log.info("storage: %s, durability %s", url, config.storage.durability)
    # Lines logged while a connection is served name it and its account.
    fields = ConnectionFields(gateway.connections)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(fields)
    try:
        await _serve_gateway(config, gateway, stop)
    finally:
        for handler in handlers:
            handler.removeFilter(fields)
    log.info("stopped")


async def _serve_gateway(config: GatewayConfig, gateway: Gateway, stop: asyncio.Event) -> None:
    async with gateway:
        for listener in gateway.listeners:
            host, port = listener.address or (config.server.host, listener.port)
            announce(log, "listener %s: %s:%d", listener.name, host, port)
        for name in gateway.unbuilt:
            port = getattr(config.listeners, name).port
            log.info("listener %s (port %d): not built yet, not listening", name, port)
        if not len(gateway.listeners):
            log.warning("no protocol listeners are built yet: serving storage only")
        if gateway.tls is None:
            log.info("TLS listeners off: [tls] names no cert_file")
        remove_reload = on_reload_signal(gateway.reload_tls)
        # What start-up created (the protocol libraries' modules, storage's indexes
        # loaded from a checkpoint) lives as long as the process: keep it out of
        # the garbage collector's full passes, which would otherwise rescan it
        # over and over while messages flow.
        gc.freeze()
        announce(log, "ready (pid %d)", os.getpid())
        try:
            await stop.wait()
        finally:
            remove_reload()
        log.info("stopping")


def run(config: GatewayConfig) -> int:
    """The merged server (or, when its storage is the pool's, a gateway of the
    separated form) in the foreground; the process exit code."""
    separated = storage_url(config).startswith("polymq:")
    form = "separated form: gateway" if separated else "merged form"
    return run_foreground(
        lambda stop: serve(config, stop=stop),
        log_level=config.server.log_level,
        log_format=config.server.log_format,
        what=f"polymq starting ({form}",
    )
