"""A real gateway, on free ports, in a thread of its own: for tests that drive it with
real clients.

Many clients are blocking (pika, paho-mqtt, kafka-python, the MNS SDK), so the server
cannot share the test's event loop; in a thread it can also be stopped and started
again over the same data directory, which restart tests need. Async clients work the
same way, from the test's own loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from gateway.config import GatewayConfig, ListenerConfig, ListenersConfig, load_config
from gateway.gateway import Gateway
from gateway.listeners import ListenerFactory, protocol_listeners

__all__ = ["LiveServer", "live_server", "server_form"]

_T = TypeVar("_T")
_START_TIMEOUT_S = 30.0
_form = "merged"  # set per test module by tests/conftest.py


@contextmanager
def server_form(form: str) -> Iterator[None]:
    """Make ``live_server`` start ``form`` ("merged" or "cluster") inside the block."""
    global _form
    before, _form = _form, form
    try:
        yield
    finally:
        _form = before


class LiveServer:
    """A started gateway. ``port(name)`` is where listener ``name`` accepts
    connections; ``call(coro)`` runs a coroutine on the server's loop (to inspect
    storage, say) and returns its result."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.host = gateway.config.server.host

    def port(self, name: str) -> int:
        listener = self.gateway.listeners.get(name)
        if listener is None or listener.address is None:
            raise KeyError(f"listener {name!r} is not serving")
        return listener.address[1]

    def address(self, name: str) -> tuple[str, int]:
        return self.host, self.port(name)

    def call(self, factory: Callable[[], Coroutine[Any, Any, _T]], timeout: float = 30.0) -> _T:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result(timeout)


def server_config(
    data_dir: Path,
    listeners: tuple[str, ...],
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Config with only ``listeners`` enabled, each on a free port (0), storage in
    ``data_dir``; ``overrides`` are dotted keys as the CLI gives them
    (``{"kafka.auto_create_topics": "false"}``)."""
    config = load_config(overrides={"storage.data_dir": str(data_dir), **(overrides or {})})
    enabled = {
        field.name: ListenerConfig(enabled=field.name in listeners, port=0)
        for field in dataclasses.fields(ListenersConfig)
    }
    return dataclasses.replace(config, listeners=ListenersConfig(**enabled))


@contextmanager
def live_server(
    data_dir: Path,
    listeners: tuple[str, ...],
    *,
    overrides: Mapping[str, Any] | None = None,
    config: GatewayConfig | None = None,
    factories: Mapping[str, ListenerFactory] | None = None,
) -> Iterator[LiveServer]:
    """Start a gateway serving ``listeners`` in a background thread; stop it (and its
    storage, flushed) on exit. ``factories`` defaults to the gateway's own table."""
    config = config or server_config(data_dir, listeners, overrides)
    factories = factories if factories is not None else protocol_listeners()
    missing = [name for name in listeners if name not in factories]
    if missing:
        raise KeyError(f"no protocol serves listener(s) {missing}")
    loop = asyncio.new_event_loop()
    gateway = Gateway.local(config, listener_factories=factories)
    started = threading.Event()
    stop: asyncio.Event | None = None
    failure: list[BaseException] = []

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        try:
            async with gateway:
                started.set()
                await stop.wait()
        except BaseException as e:
            failure.append(e)
            raise
        finally:
            started.set()

    thread = threading.Thread(
        target=loop.run_until_complete, args=(main(),), name="live-server", daemon=True
    )
    thread.start()
    if not started.wait(_START_TIMEOUT_S):
        raise TimeoutError("the gateway did not start in time")
    if failure:
        thread.join()
        loop.close()
        raise RuntimeError("the gateway failed to start") from failure[0]
    try:
        yield LiveServer(gateway, loop)
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(_START_TIMEOUT_S)
        loop.close()
