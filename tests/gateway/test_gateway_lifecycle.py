from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import cast

import pytest

from polymq.gateway.assembly import build_gateway, open_storage, storage_url
from polymq.gateway.config import (
    LISTENER_NAMES,
    AccountConfig,
    AuthConfig,
    ConfigError,
    GatewayConfig,
    load_config,
)
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import Listener, ListenerContext
from polymq.storage.api import StorageAPI
from polymq.storage.clock import SystemClock
from polymq.storage.memory import MemoryEngine
from tests.gateway.gateway_fakes import RecordedStorage, echo_listener

TIMEOUT = 5


def config(tmp_path: Path, **env: str) -> GatewayConfig:
    # Every listener on a free port, so tests never collide with a running server.
    overrides: dict[str, object] = {f"listeners.{name}.port": 0 for name in LISTENER_NAMES}
    overrides["storage.data_dir"] = str(tmp_path / "data")
    return load_config(None, {f"POLYMQ_{k}": v for k, v in env.items()}, overrides)


class StorageWatcher:
    """A listener that records whether storage was open when it started and stopped."""

    def __init__(self, context: ListenerContext, storage: RecordedStorage, *, fail: bool = False):
        self.name = context.name
        self.port = context.port
        self.address: tuple[str, int] | None = None
        self._storage = storage
        self._fail = fail
        self.storage_open_at_start: bool | None = None
        self.storage_open_at_stop: bool | None = None

    async def start(self) -> None:
        if self._fail:
            raise OSError(f"{self.name}: address already in use")
        self.storage_open_at_start = self._storage.started and not self._storage.closed
        self.address = ("127.0.0.1", 1)

    async def stop(self) -> None:
        self.storage_open_at_stop = self._storage.started and not self._storage.closed


async def echo_roundtrip(address: tuple[str, int]) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"ping\n")
    line = await asyncio.wait_for(reader.readline(), TIMEOUT)
    writer.close()
    await writer.wait_closed()
    return line


async def test_lifecycle_over_a_storage(tmp_path: Path) -> None:
    storage = RecordedStorage()
    watchers: list[StorageWatcher] = []

    def watcher(context: ListenerContext) -> Listener:
        watchers.append(StorageWatcher(context, storage))
        return watchers[-1]

    alice = AccountConfig(user="alice", password="pw", namespaces=("alice",))
    cfg = dataclasses.replace(
        config(tmp_path, SERVER__NAMESPACES="default,extra"),
        auth=AuthConfig(mode="accounts", accounts=(alice,)),
    )
    gateway = Gateway(
        cfg,
        storage=cast(StorageAPI, storage),
        listener_factories={"kafka": echo_listener, "amqp": watcher},
    )
    assert gateway.unbuilt == ("mqtt", "mqtt_ws", "rocketmq", "http")
    async with gateway as gw:
        assert set(await storage.list_namespaces()) == {"default", "extra", "alice"}
        kafka = gw.listeners.get("kafka")
        assert kafka is not None and kafka.address is not None
        assert await echo_roundtrip(kafka.address) == b"ping\n"
        assert [w.storage_open_at_start for w in watchers] == [True]
    assert storage.closed
    assert [w.storage_open_at_stop for w in watchers] == [True]  # stopped before storage
    assert len(gateway.connections) == 0


async def test_existing_namespaces_are_fine(tmp_path: Path) -> None:
    storage = RecordedStorage()
    async with Gateway(config(tmp_path), storage=cast(StorageAPI, storage), listener_factories={}):
        # The engine made "default" itself, so the gateway's create found it there.
        assert await storage.list_namespaces() == ["default"]
        assert "create_namespace" in storage.names()


async def test_listener_failure_closes_storage(tmp_path: Path) -> None:
    storage = RecordedStorage()
    gateway = Gateway(
        config(tmp_path),
        storage=cast(StorageAPI, storage),
        listener_factories={"http": lambda c: StorageWatcher(c, storage, fail=True)},
    )
    with pytest.raises(OSError, match="address already in use"):
        async with gateway:
            pytest.fail("must not get here")
    assert storage.closed


async def test_disabled_listener_is_not_built(tmp_path: Path) -> None:
    gateway = Gateway(
        config(tmp_path, LISTENERS__KAFKA__ENABLED="false"),
        storage=cast(StorageAPI, RecordedStorage()),
        listener_factories={"kafka": echo_listener},
    )
    assert len(gateway.listeners) == 0
    assert "kafka" not in gateway.unbuilt


def test_storage_is_chosen_by_url(tmp_path: Path) -> None:
    assert storage_url(config(tmp_path)) == (tmp_path / "data").resolve().as_uri()
    cluster = config(tmp_path, CLUSTER__NAMESERVERS="a:1,b:2")
    assert storage_url(cluster) == "polymq://a:1,b:2"
    assert storage_url(config(tmp_path, STORAGE__URL="memory://")) == "memory://"
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_storage("s3://bucket", GatewayConfig(), SystemClock())
    with pytest.raises(ConfigError, match="no nameserver"):
        open_storage("polymq://", GatewayConfig(), SystemClock())


async def test_memory_storage_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = config(tmp_path, STORAGE__URL="memory://")
    async with build_gateway(cfg, listener_factories={}) as gw:
        assert isinstance(gw.storage, MemoryEngine)
        scratch = gw.storage.scratch
        assert scratch.is_dir()
        await gw.storage.create_topic("default", "t")
        assert [t.name for t in await gw.storage.list_topics("default")] == ["t"]
    assert not scratch.exists()
    assert not (tmp_path / "data").exists()


async def test_merged_directory_names_this_gateway_on_its_bound_ports(tmp_path: Path) -> None:
    cfg = config(tmp_path, CLUSTER__ADVERTISED_HOST="gw.example", CLUSTER__GATEWAY_ID="gw-1")
    async with build_gateway(cfg, listener_factories={"mqtt": echo_listener}) as gw:
        mqtt = gw.listeners.get("mqtt")
        assert mqtt is not None and mqtt.address is not None
        (endpoint,) = gw.directory.endpoints("mqtt")
        assert (endpoint.gateway_id, endpoint.host) == ("gw-1", "gw.example")
        assert endpoint.port == mqtt.address[1] != 0
        own = gw.own_endpoints()["mqtt"]
        assert (own.gateway_id, own.host, own.port) == ("gw-1", "gw.example", endpoint.port)
        assert gw.directory.endpoints("kafka") == ()


async def test_local_form_over_the_real_engine(tmp_path: Path) -> None:
    cfg = config(tmp_path, SERVER__NAMESPACES="default,team")
    async with build_gateway(cfg, listener_factories={"mqtt": echo_listener}) as gw:
        assert sorted(await gw.storage.list_namespaces()) == ["default", "team"]
        mqtt = gw.listeners.get("mqtt")
        assert mqtt is not None and mqtt.address is not None
        assert await echo_roundtrip(mqtt.address) == b"ping\n"
    assert (tmp_path / "data").is_dir()
    # A second start over the same data finds the namespaces and does not fail on them.
    async with build_gateway(cfg, listener_factories={}) as gw:
        assert sorted(await gw.storage.list_namespaces()) == ["default", "team"]
