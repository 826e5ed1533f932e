"""The merged server in the foreground: one process, embedded storage, every enabled
listener; stopped cleanly by SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Mapping

from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from gateway.listeners import ListenerFactory
from storage.errors import StorageError

__all__ = ["configure_logging", "run", "serve"]

log = logging.getLogger("polymq")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


async def serve(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    listener_factories: Mapping[str, ListenerFactory] | None = None,
) -> None:
    """Run until ``stop`` is set or a stop signal arrives, then shut down in order.

    Logs one line per fact an operator checks first (data dir, durability, each
    listener's bound address) and ``ready`` once every listener accepts connections.
    """
    stop = stop or asyncio.Event()
    gateway = Gateway.local(config, listener_factories=listener_factories)
    log.info(
        "storage: embedded engine, data dir %s, durability %s",
        config.storage.data_dir.resolve(),
        config.storage.durability,
    )
    remove_handlers = _on_stop_signals(stop)
    try:
        async with gateway:
            for listener in gateway.listeners:
                host, port = listener.address or (config.server.host, listener.port)
                log.info("listener %s: %s:%d", listener.name, host, port)
            for name in gateway.unbuilt:
                port = getattr(config.listeners, name).port
                log.info("listener %s (port %d): not built yet, not listening", name, port)
            if not len(gateway.listeners):
                log.warning("no protocol listeners are built yet: serving storage only")
            # What start-up created (the protocol libraries' modules, storage's indexes
            # loaded from a checkpoint) lives as long as the process: keep it out of
            # the garbage collector's full passes, which would otherwise rescan it
            # over and over while messages flow.
            gc.freeze()
            log.info("ready (pid %d)", os.getpid())
            await stop.wait()
            log.info("stopping")
    finally:
        remove_handlers()
    log.info("stopped")


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
    """Serve in the foreground on uvloop when installed; the process exit code."""
    configure_logging(config.server.log_level)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    log.info(
        "polymq starting (merged form, %s event loop)", "uvloop" if loop_factory else "asyncio"
    )
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config))
    except (OSError, StorageError) as e:  # a port taken, a data dir not writable
        log.error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:  # SIGINT before the handlers were installed
        log.info("stopped")
    return 0
