"""A server process in the foreground: the merged server (one process, embedded
storage, every enabled listener), a gateway of the separated form, or any of the
separated form's other services; stopped cleanly by SIGINT or SIGTERM. SIGHUP
reloads the TLS certificate, key and CA files ([tls], docs/tls.md)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from polymq.gateway.assembly import build_gateway, storage_url
from polymq.gateway.config import ConfigError, GatewayConfig
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import ListenerFactory
from polymq.gateway.log_format import ConnectionFields, JsonFormatter
from polymq.storage.errors import StorageError

__all__ = ["configure_logging", "run", "run_foreground", "serve"]

log = logging.getLogger("polymq")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def configure_logging(level: str, log_format: str = "text") -> None:
    """``log_format`` ``json``: one JSON object per line (gateway/log_format.py)."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    # httpx logs every request at INFO: navigation heartbeats would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


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
            log.info("listener %s: %s:%d", listener.name, host, port)
        for name in gateway.unbuilt:
            port = getattr(config.listeners, name).port
            log.info("listener %s (port %d): not built yet, not listening", name, port)
        if not len(gateway.listeners):
            log.warning("no protocol listeners are built yet: serving storage only")
        if gateway.tls is None:
            log.info("TLS listeners off: [tls] names no cert_file")
        remove_reload = _on_reload_signal(gateway.reload_tls)
        # What start-up created (the protocol libraries' modules, storage's indexes
        # loaded from a checkpoint) lives as long as the process: keep it out of
        # the garbage collector's full passes, which would otherwise rescan it
        # over and over while messages flow.
        gc.freeze()
        log.info("ready (pid %d)", os.getpid())
        try:
            await stop.wait()
        finally:
            remove_reload()
        log.info("stopping")


def _on_reload_signal(
    reload: Callable[[], None], *, done: str = "SIGHUP: TLS files reloaded"
) -> Callable[[], None]:
    """SIGHUP reloads the TLS files (a bad file is logged; the old ones keep serving)."""
    loop = asyncio.get_running_loop()

    def handle() -> None:
        try:
            reload()
        except ConfigError as e:
            log.error("SIGHUP: TLS files not reloaded, the old ones serve on: %s", e)
        else:
            log.info("%s", done)

    try:
        loop.add_signal_handler(signal.SIGHUP, handle)
    except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
        return lambda: None

    def remove() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return remove


def _on_stop_signals(stop: asyncio.Event) -> Callable[[], None]:
    loop = asyncio.get_running_loop()

    def handle(signum: int) -> None:
        if stop.is_set():
            log.info("%s: already stopping", signal.Signals(signum).name)
        else:
            log.info("%s: stopping", signal.Signals(signum).name)
            stop.set()

    installed = []
    for signum in _STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, handle, signum)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            continue
        installed.append(signum)

    def remove() -> None:
        for signum in installed:
            loop.remove_signal_handler(signum)

    return remove


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


def run_foreground(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
    *,
    log_level: str,
    what: str,
    log_format: str = "text",
) -> int:
    """Run ``main(stop)`` on uvloop when installed, ``stop`` set by SIGINT/SIGTERM; the
    process exit code: 1 when it cannot start (a port taken, a data dir not writable).
    ``what`` opens the first log line; the event loop's name closes it."""
    configure_logging(log_level, log_format)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    log.info("%s, %s event loop)", what, "uvloop" if loop_factory else "asyncio")

    async def guarded() -> None:
        stop = asyncio.Event()
        remove_handlers = _on_stop_signals(stop)
        # SIGHUP must not kill a storage node, nameserver or navigation sent it along
        # with the gateways (whose serve() installs the TLS reload over this).
        _on_reload_signal(lambda: None, done="SIGHUP: nothing to reload in this process")
        try:
            await main(stop)
        finally:
            remove_handlers()

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(guarded())
    except (OSError, StorageError) as e:  # a port taken, a data dir not writable
        log.error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:  # SIGINT before the handlers were installed
        log.info("stopped")
    return 0
