"""``[tls] internal``: the separated form's own traffic over mutual TLS. A nameserver,
a storage node and navigation serve TLS requiring client certificates; a gateway
built from the configuration reaches all three with its certificate and serves a
Kafka round trip through them. An RPC client without a certificate, or in plaintext,
is refused by the storage node, while the gateway's traffic carries on."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from polymq.gateway.assembly import build_gateway
from polymq.gateway.config import LISTENER_NAMES, engine_config, load_config
from polymq.gateway.tls import internal_tls
from polymq.nameserver.server import Nameserver
from polymq.navigation.server import NavigationServer
from polymq.storage.clock import SystemClock
from polymq.storage.engine import Engine
from polymq.storage.errors import StorageUnavailable
from polymq.storage.node import StorageNode
from polymq.storage.remote import RemoteStorage
from tests.tls.conftest import Certs

ONE_FORM = True  # builds its own separated form, over TLS
TIMEOUT_S = 30.0


async def test_the_pool_gateway_and_navigation_speak_mutual_tls(
    tmp_path: Path, certs: Certs
) -> None:
    tls_keys = {
        "tls.cert_file": str(certs.server_chain),
        "tls.key_file": str(certs.server_key),
        "tls.ca_file": str(certs.ca),
        "tls.internal": "true",
    }
    base = load_config(overrides={"storage.data_dir": str(tmp_path / "node"), **tls_keys})
    tls = internal_tls(base.tls)
    assert tls is not None
    async with (
        Nameserver(port=0, node_expiry_ms=2000, ssl=tls.server) as nameserver,
        NavigationServer(port=0, ssl=tls.server) as navigation,
    ):
        ns = "{}:{}".format(*nameserver.address)
        node = StorageNode(
            Engine(engine_config(base)),
            "node-1",
            port=0,
            nameservers=[ns],
            heartbeat_ms=200,
            server_ssl=tls.server,
            client_ssl=tls.client,
        )
        await node.start()
        try:
            overrides = {
                **{f"listeners.{n}.enabled": "false" for n in LISTENER_NAMES if n != "kafka"},
                "listeners.kafka.port": "0",
                "cluster.nameservers": ns,
                "cluster.navigation": navigation.url,
                "cluster.heartbeat_ms": "200",
                **tls_keys,
            }
            config = load_config(overrides=overrides)
            config = dataclasses.replace(
                config, storage=dataclasses.replace(config.storage, data_dir=tmp_path / "gw")
            )
            assert navigation.url.startswith("https://")
            async with build_gateway(config) as gateway:
                listener = gateway.listeners.get("kafka")
                assert listener is not None and listener.address is not None
                bootstrap = "{}:{}".format(*listener.address)
                await _kafka_round_trip(bootstrap)
                await _wait_registered(navigation, gateway.gateway_id)

                # The node refuses RPC without a client certificate, and in plaintext.
                no_certificate = ssl.create_default_context(cafile=str(certs.ca))
                host, port = node.address
                for client in (
                    RemoteStorage(host, port, connect_timeout=5, ssl=no_certificate),
                    RemoteStorage(host, port, connect_timeout=5),
                ):
                    with pytest.raises(StorageUnavailable):
                        await client.list_namespaces()
                    await client.close()
                await _kafka_round_trip(bootstrap)
        finally:
            await node.close()


async def _kafka_round_trip(bootstrap: str) -> None:
    topic = f"internal-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, b"through tls"), TIMEOUT_S)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), TIMEOUT_S)
    finally:
        await consumer.stop()
    assert record.value == b"through tls"


async def _wait_registered(navigation: NavigationServer, gateway_id: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not any(
        e.gateway_id == gateway_id
        for e in navigation.registry.endpoints("kafka", SystemClock().now_ms())
    ):
        assert time.monotonic() < deadline, "the gateway never registered over https"
        await asyncio.sleep(0.05)
