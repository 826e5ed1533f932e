"""Two gateways; every MQTT client is on the first. What reaches a storage topic from
elsewhere (here MNS messages; in the replicated chaos run, publishes stored owing their
session-queue copies while a shard was away) is copied into persistent sessions' queues
by one gateway, chosen by the topic's hash among the gateways serving MQTT. When that
is the second gateway, it must do it although no MQTT client ever connected to it.

Before, a gateway loaded a namespace's MQTT broker at its first client's CONNECT: the
second one followed no topic, nobody made the copies, and the session never got the
messages (an acknowledged publish lost, as the chaos run found after a gateway
restart)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from tests.cluster.fast_failure import cluster_env
from tests.replicated.clients import MqttSubscriber

_JSON = {"Accept": "application/json", "Content-Type": "application/json"}
_TIMEOUT_S = 60.0


def _owned_by_second(prefix: str) -> str:
    """A topic name whose copies the second gateway makes (peers.owns)."""
    endpoints = [GatewayEndpoint(gateway_id=f"gateway-{i}", host="h", port=1) for i in (1, 2)]
    for n in range(1000):
        name = f"{prefix}{n}"
        owner = owner_of(name, endpoints)
        if owner is not None and owner.gateway_id == "gateway-2":
            return name
    raise AssertionError("no name owned by gateway-2")


async def test_a_gateway_without_mqtt_clients_copies_into_the_sessions_it_owns(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(
        layout(storage=1, gateways=2, data_dir=tmp_path, port_offset=None), env=cluster_env()
    )
    try:
        await cluster.start()
        topic = _owned_by_second(f"idle{int(time.time()) % 1000}x")
        subscriber = MqttSubscriber(cluster.address("gateway-1", "mqtt"), f"s-{topic}", {topic: 1})
        await asyncio.to_thread(subscriber.connect)
        host, port = cluster.address("gateway-1", "http")
        async with httpx.AsyncClient(
            base_url=f"http://{host}:{port}", headers=_JSON, timeout=30.0
        ) as http:
            assert (await http.put(f"/queues/{topic}")).status_code == 201
            await asyncio.to_thread(subscriber.subscribe, [(topic, 1)])
            # Sent until one arrives: the owner's tail starts at the topic's end once
            # it learned the subscription, so what came before may be left out.
            deadline, sent = time.monotonic() + _TIMEOUT_S, 0
            while not subscriber.deliveries:
                assert time.monotonic() < deadline, (
                    f"{sent} MNS messages to {topic}, none reached the persistent session"
                )
                reply = await http.post(
                    f"/queues/{topic}/messages", json={"MessageBody": f"m{sent}"}
                )
                assert reply.status_code == 201, reply.text
                sent += 1
                await asyncio.sleep(0.5)
        subscriber.client.disconnect()
        subscriber.client.loop_stop()
    finally:
        await cluster.stop()
