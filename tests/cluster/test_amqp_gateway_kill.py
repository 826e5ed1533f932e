"""SIGKILL a gateway of the separated form (real processes: nameserver, navigation, a
storage node, two gateways) under a confirming publisher and a consumer with unacked
deliveries. Both reconnect with the gateway list they were given, so to the other
gateway, and every confirmed message arrives; the dead gateway's unacked deliveries
come back (redelivered) once their lease runs out, within seconds; its exclusive
queues go and its single-active consumer hands over to one on the other gateway."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pika
import pytest
from pika.exceptions import AMQPError

from polymq.gateway.cluster_tool import LocalCluster, layout
from tests.cluster.fast_failure import cluster_env

_TIMEOUT_S = 60.0
Address = tuple[str, int]
_SAC = {"x-single-active-consumer": True}


def _connect(addresses: Sequence[Address]) -> pika.BlockingConnection:
    """What a client given every gateway does: the first that answers."""
    return pika.BlockingConnection(
        [pika.ConnectionParameters(host, port, heartbeat=0) for host, port in addresses]
    )


class _Clients:
    """A confirming publisher and a consumer (prefetch 10, acking nothing) on the
    first gateway; the consumer's connection also holds an exclusive queue and the
    active consumer of a single-active-consumer queue."""

    def __init__(self, gateways: Sequence[Address], queue: str) -> None:
        self.queue = queue
        self.confirmed: list[int] = []
        self.unacked: list[int] = []
        self.publisher = _connect(gateways)
        self.channel = self.publisher.channel()
        self.channel.queue_declare(queue, durable=True)
        self.channel.confirm_delivery()
        self.consumer = _connect(gateways)
        consuming = self.consumer.channel()
        consuming.basic_qos(prefetch_count=10)
        consuming.basic_consume(queue, lambda c, m, p, body: self.unacked.append(int(body)))
        self.exclusive = consuming.queue_declare("", exclusive=True).method.queue
        self.single = queue + "-sac"
        consuming.queue_declare(self.single, durable=True, arguments=_SAC)
        consuming.basic_consume(self.single, lambda *args: None)

    def publish(self, values: range) -> None:
        for i in values:
            self.channel.basic_publish("", self.queue, str(i).encode())
            self.confirmed.append(i)

    def hold_deliveries(self) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while len(self.unacked) < 10:
            assert time.monotonic() < deadline, "the consumer got nothing before the kill"
            self.consumer.process_data_events(time_limit=0.05)

    def publish_until_it_fails(self, values: range) -> None:
        try:
            self.publish(values)
        except AMQPError:
            return
        raise AssertionError("the publisher never noticed its gateway died")


def _after_the_kill(gateways: Sequence[Address], clients: _Clients) -> tuple[set[int], set[int]]:
    """Reconnect both clients, publish more, consume everything."""
    with _connect(gateways) as publisher, _connect(gateways) as consumer:
        channel = publisher.channel()
        channel.confirm_delivery()
        channel.queue_declare(clients.queue, durable=True)
        for i in range(1000, 1020):
            channel.basic_publish("", clients.queue, str(i).encode())
            clients.confirmed.append(i)
        got: set[int] = set()
        redelivered: set[int] = set()

        def on_message(c: Any, m: Any, _p: Any, body: bytes) -> None:
            got.add(int(body))
            if m.redelivered:
                redelivered.add(int(body))
            c.basic_ack(m.delivery_tag)

        consumer.channel().basic_consume(clients.queue, on_message)
        handed_over: list[bytes] = []
        sac = consumer.channel()
        sac.queue_declare(clients.single, durable=True, arguments=_SAC)
        sac.basic_consume(clients.single, lambda c, m, p, body: handed_over.append(body), True)
        channel.basic_publish("", clients.single, b"next in line")
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline and not (
            got >= set(clients.confirmed) and handed_over and _gone(publisher, clients.exclusive)
        ):
            consumer.process_data_events(time_limit=0.1)
        assert handed_over == [b"next in line"], "the single active consumer did not hand over"
        assert _gone(publisher, clients.exclusive), "the dead connection's exclusive queue stayed"
        return got, redelivered


def _gone(connection: pika.BlockingConnection, queue: str) -> bool:
    try:
        connection.channel().queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code in (404, 405), e  # locked while its owner is thought alive
        return bool(e.reply_code == 404)
    return False


@pytest.mark.timeout(240)
async def test_a_killed_gateway_loses_no_confirmed_message(tmp_path: Path) -> None:
    specs = layout(storage=1, gateways=2, data_dir=tmp_path, port_offset=None)
    cluster = LocalCluster(specs, env=cluster_env())
    try:
        await cluster.start()
        gateways = [cluster.address(name, "amqp") for name in ("gateway-1", "gateway-2")]
        queue = f"kill-{uuid.uuid4().hex[:8]}"
        clients = await asyncio.to_thread(_Clients, gateways, queue)
        await asyncio.to_thread(clients.publish, range(50))
        await asyncio.to_thread(clients.hold_deliveries)
        await cluster.kill("gateway-1")
        await asyncio.to_thread(clients.publish_until_it_fails, range(50, 1000))
        got, redelivered = await asyncio.to_thread(_after_the_kill, gateways, clients)
        missing = set(clients.confirmed) - got
        assert not missing, f"{len(missing)} confirmed messages lost: {sorted(missing)[:10]}"
        assert set(clients.unacked) <= redelivered
    finally:
        await cluster.stop()
