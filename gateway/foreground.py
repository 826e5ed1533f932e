"""A process of either form in the foreground: logging set up, SIGINT and SIGTERM
stop it, SIGHUP is its reload signal, and a failure to start (a port taken, a data
dir not writable) is its exit code.

Apart from :mod:`polymq.gateway.server` so that the processes that are not gateways
(a storage node, the nameserver, navigation) start without importing every
protocol: a process's start-up time is mostly its imports, and a storage node that
restarts is a shard that waits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from polymq.gateway.config import ConfigError
from polymq.gateway.log_format import JsonFormatter
from polymq.storage.errors import StorageError

__all__ = ["announce", "configure_logging", "on_reload_signal", "run_foreground"]

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


def announce(logger: logging.Logger, message: str, *args: object) -> None:
    """An INFO line logged whatever ``--log-level`` says, for the addresses a process
    bound and its "ready": a supervising parent (``cluster up``, ``run --workers``)
    learns its children's ports and readiness from these lines, and an operator who
    quieted the log to warnings still sees where the server listens (PostgreSQL
    prints "ready to accept connections" at any level). ``Logger.handle`` skips the
    level check that ``Logger.info`` makes; handlers and filters still apply."""
    if not logger.disabled:
        logger.handle(logger.makeRecord(logger.name, logging.INFO, "", 0, message, args, None))


def on_reload_signal(
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
        on_reload_signal(lambda: None, done="SIGHUP: nothing to reload in this process")
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
