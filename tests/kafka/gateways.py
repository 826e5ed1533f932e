"""Several real gateways over one storage, for tests of what the separated form adds
above storage: which gateway coordinates which group, and how adapters answer when
storage cannot be reached.

The gateways run in one background thread and loop, each a full :class:`Gateway` with
its own listeners, over one started engine shared through :class:`SharedStorage`
(storage is shared in the separated form too; only its transport differs). Each gets
a :class:`StaticDirectory` listing every gateway's real listeners.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from polymq.gateway.config import GatewayConfig, engine_config
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import ListenerFactory
from polymq.navigation.endpoints import GatewayEndpoint
from polymq.storage.api import StorageAPI
from polymq.storage.engine import Engine
from polymq.storage.errors import StorageUnavailable
from tests.live_server import LiveServer, SharedStorage, server_config

__all__ = ["Gateways", "LossyStorage", "StaticDirectory", "gateways"]

_T = TypeVar("_T")
_TIMEOUT_S = 30.0


class StaticDirectory:
    """A :class:`gateway.directory.GatewayDirectory` over a shared, fixed list (filled
    in once every gateway listens)."""

    def __init__(self, self_id: str, listed: dict[str, list[GatewayEndpoint]]) -> None:
        self._id = self_id
        self._listed = listed

    @property
    def self_id(self) -> str:
        return self._id

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]:
        return self._listed.get(protocol, [])


class LossyStorage(SharedStorage):
    """:class:`SharedStorage` that can also lose the answers of the next
    ``lost_append_answers`` appends: each is stored, then its caller gets
    :class:`StorageUnavailable` after ``lost_answer_delay_s``, as when a storage node is
    killed after its write and before its answer."""

    def __init__(self, inner: StorageAPI) -> None:
        super().__init__(inner)
        self.lost_append_answers = 0
        self.lost_answer_delay_s = 0.0

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name not in ("append", "append_visible"):  # both store, then answer
            return call

        async def append(*args: Any, **kwargs: Any) -> Any:
            result = await call(*args, **kwargs)
            if self.lost_append_answers > 0:
                self.lost_append_answers -= 1
                await asyncio.sleep(self.lost_answer_delay_s)
                raise StorageUnavailable("the storage node died before answering (test)")
            return result

        return append


class Gateways:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, listed: dict[str, list[GatewayEndpoint]]
    ) -> None:
        self.loop = loop
        # What every gateway's directory lists, per protocol (tests may change it, as
        # navigation would when a gateway leaves).
        self.listed = listed
        self.gateways: dict[str, Gateway] = {}
        self.storage: dict[str, LossyStorage] = {}

    def address(self, gateway_id: str, listener: str) -> tuple[str, int]:
        found = self.gateways[gateway_id].listeners.get(listener)
        assert found is not None and found.address is not None
        return "127.0.0.1", found.address[1]

    def bootstrap(self, gateway_id: str) -> str:
        host, port = self.address(gateway_id, "kafka")
        return f"{host}:{port}"

    def server(self, gateway_id: str) -> LiveServer:
        """One gateway as the single-gateway test helpers take it."""
        return LiveServer(self.gateways[gateway_id], self.loop)

    def call(self, factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result(_TIMEOUT_S)


@contextmanager
def gateways(
    data_dir: Path,
    ids: Sequence[str],
    factories: Mapping[str, ListenerFactory],
    *,
    overrides: Mapping[str, Any] | None = None,
) -> Iterator[Gateways]:
    """Start one gateway per id, each serving ``factories``' listeners on free ports,
    over one engine in ``data_dir``; every directory lists them all."""
    base: GatewayConfig = server_config(data_dir, tuple(factories), overrides)
    loop = asyncio.new_event_loop()
    listed: dict[str, list[GatewayEndpoint]] = {}
    live = Gateways(loop, listed)
    started = threading.Event()
    failure: list[BaseException] = []
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                engine = Engine(engine_config(base))
                await engine.start()
                stack.push_async_callback(engine.close)
                for gateway_id in ids:
                    config = dataclasses.replace(
                        base, cluster=dataclasses.replace(base.cluster, gateway_id=gateway_id)
                    )
                    shared = LossyStorage(cast(StorageAPI, engine))
                    gateway = Gateway(
                        config,
                        storage=cast(StorageAPI, shared),
                        listener_factories=factories,
                        directory=StaticDirectory(gateway_id, listed),
                    )
                    await stack.enter_async_context(gateway)
                    live.gateways[gateway_id], live.storage[gateway_id] = gateway, shared
                for gateway_id, gateway in live.gateways.items():
                    for listener in gateway.listeners:
                        assert listener.address is not None
                        listed.setdefault(listener.name, []).append(
                            GatewayEndpoint(
                                gateway_id=gateway_id, host="127.0.0.1", port=listener.address[1]
                            )
                        )
                started.set()
                await stop.wait()
        except BaseException as e:
            failure.append(e)
            raise
        finally:
            started.set()

    thread = threading.Thread(
        target=loop.run_until_complete, args=(main(),), name="gateways", daemon=True
    )
    thread.start()
    if not started.wait(_TIMEOUT_S) or failure:
        thread.join(_TIMEOUT_S)
        loop.close()
        raise RuntimeError("the gateways did not start") from (failure[0] if failure else None)
    try:
        yield live
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(_TIMEOUT_S)
        loop.close()
