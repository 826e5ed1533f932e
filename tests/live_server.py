"""A real gateway, on free ports, in a thread of its own: for tests that drive it with
real clients.

Many clients are blocking (pika, paho-mqtt, kafka-python, the MNS SDK), so the server
cannot share the test's event loop; in a thread it can also be stopped and started
again over the same data directory, which restart tests need. Async clients work the
same way, from the test's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from polymq.gateway.assembly import build_gateway, protocol_listeners
from polymq.gateway.config import (
    GatewayConfig,
    ListenerConfig,
    ListenersConfig,
    engine_config,
    load_config,
)
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import ListenerFactory
from polymq.navigation.endpoints import GatewayEndpoint
from polymq.storage.api import StorageAPI
from polymq.storage.engine import Engine
from polymq.storage.errors import StorageUnavailable

__all__ = ["LiveServer", "SharedStorage", "live_gateways", "live_server", "server_form"]

_T = TypeVar("_T")
_START_TIMEOUT_S = 30.0
_form = "merged"  # set per test module by tests/conftest.py
_STORAGE_NODES = 2  # the cluster form: topics spread over two storage nodes
_HEARTBEAT_MS = 200


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
    storage, say) and returns its result. ``engines``: the storage engines behind it
    (its own in the merged form, the storage nodes' in the cluster form), for the few
    tests that must look inside storage."""

    def __init__(
        self, gateway: Gateway, loop: asyncio.AbstractEventLoop, engines: Sequence[Engine] = ()
    ) -> None:
        self.gateway = gateway
        self.loop = loop
        self.host = gateway.config.server.host
        self.engines = list(engines)

    def port(self, name: str) -> int:
        listener = self.gateway.listeners.get(name)
        if listener is None or listener.address is None:
            raise KeyError(f"listener {name!r} is not serving")
        return listener.address[1]

    def address(self, name: str) -> tuple[str, int]:
        return self.host, self.port(name)

    def call(self, factory: Callable[[], Coroutine[Any, Any, _T]], timeout: float = 30.0) -> _T:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result(timeout)


async def _start_storage_pool(
    stack: contextlib.AsyncExitStack, config: GatewayConfig, data_dir: Path, engines: list[Engine]
) -> str:
    """The separated form's storage side, in this loop on free ports: a nameserver and
    ``_STORAGE_NODES`` storage nodes with data folders under ``data_dir`` (so a restart
    over the same folder finds its data). Returns the nameserver's address."""
    from polymq.nameserver.server import Nameserver
    from polymq.storage.node import StorageNode

    nameserver = Nameserver(host="127.0.0.1", port=0, node_expiry_ms=10 * _HEARTBEAT_MS)
    await stack.enter_async_context(nameserver)
    host, port = nameserver.address
    address = f"{host}:{port}"
    for i in range(_STORAGE_NODES):
        node_dir = data_dir / f"node-{i + 1}"
        storage = dataclasses.replace(config.storage, data_dir=node_dir)
        engine = Engine(engine_config(dataclasses.replace(config, storage=storage)))
        engines.append(engine)
        node = StorageNode(
            engine,
            node_id=f"node-{i + 1}",
            host="127.0.0.1",
            port=0,
            nameservers=[address],
            heartbeat_ms=_HEARTBEAT_MS,
        )
        await node.start()
        stack.push_async_callback(node.close)
    return address


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
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
) -> Iterator[LiveServer]:
    """Start a gateway serving ``listeners`` in a background thread; stop it (and its
    storage, flushed) on exit. ``factories`` defaults to the gateway's own table;
    ``loop_factory`` gives its loop (``uvloop.new_event_loop``: as ``polymq run``)."""
    with live_gateways(
        data_dir,
        listeners,
        1,
        overrides=overrides,
        config=config,
        factories=factories,
        loop_factory=loop_factory,
    ) as (server,):
        yield server


@contextmanager
def live_gateways(
    data_dir: Path,
    listeners: tuple[str, ...],
    count: int,
    *,
    overrides: Mapping[str, Any] | None = None,
    config: GatewayConfig | None = None,
    factories: Mapping[str, ListenerFactory] | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
) -> Iterator[list[LiveServer]]:
    """``count`` gateways over the same storage (one engine in the merged form, the
    same storage nodes in the cluster form), each on its own free ports and each
    knowing the others as its peers (what navigation tells gateways): for the tests
    of state that must not live in one gateway."""
    config = config or server_config(data_dir, listeners, overrides)
    factories = factories if factories is not None else protocol_listeners()
    missing = [name for name in listeners if name not in factories]
    if missing:
        raise KeyError(f"no protocol serves listener(s) {missing}")
    loop = loop_factory()
    cluster = _form == "cluster"
    started = threading.Event()
    stop: asyncio.Event | None = None
    failure: list[BaseException] = []
    built: list[Gateway] = []
    engines: list[Engine] = []  # behind the gateways, when not their own storage

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        try:
            async with contextlib.AsyncExitStack() as stack:
                shared: StorageAPI | None = None
                if cluster:
                    nameserver = await _start_storage_pool(stack, config, data_dir, engines)
                    gateway_config = dataclasses.replace(
                        config,
                        cluster=dataclasses.replace(
                            config.cluster, nameservers=(nameserver,), heartbeat_ms=_HEARTBEAT_MS
                        ),
                    )
                elif count > 1:
                    engine = Engine(engine_config(config))
                    engines.append(engine)
                    await engine.start()
                    stack.push_async_callback(engine.close)
                    shared = cast(StorageAPI, SharedStorage(cast(StorageAPI, engine)))
                    gateway_config = config
                else:
                    gateway_config = config
                for i in range(count):
                    one = gateway_config
                    if count > 1:
                        one = dataclasses.replace(
                            one,
                            cluster=dataclasses.replace(one.cluster, gateway_id=f"gateway-{i + 1}"),
                        )
                    peers = _Peers(built, one.cluster.gateway_id) if count > 1 else None
                    gateway = build_gateway(
                        one, listener_factories=factories, directory=peers, storage=shared
                    )
                    built.append(gateway)
                    await stack.enter_async_context(gateway)
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
        merged = [g.storage for g in built if isinstance(g.storage, Engine)]
        yield [LiveServer(gateway, loop, engines or merged) for gateway in built]
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(_START_TIMEOUT_S)
        loop.close()


class _Peers:
    """The gateways of one ``live_gateways`` as each other's directory: every
    gateway's bound endpoints, as navigation would list them."""

    def __init__(self, gateways: list[Gateway], self_id: str) -> None:
        self._gateways = gateways
        self._self_id = self_id

    @property
    def self_id(self) -> str:
        return self._self_id

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]:
        found = (gateway.own_endpoints().get(protocol) for gateway in self._gateways)
        return [endpoint for endpoint in found if endpoint is not None]


class SharedStorage:
    """Forwards every StorageAPI call to ``inner`` except start and close (the owner
    of the engine does those), and raises :class:`StorageUnavailable` from every call
    while ``down`` is set: a storage node out of reach, as the cluster client reports
    it."""

    def __init__(self, inner: StorageAPI) -> None:
        self._inner = inner
        self.down = False

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StorageUnavailable(f"storage node for {name} is down (test)")
            return await method(*args, **kwargs)

        return call
