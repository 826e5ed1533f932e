"""Killing the gateway that leads a partition costs a Kafka producer about what killing
the other one costs, not navigation's whole gateway expiry.

Before: the live gateway went on naming the dead one as the partition's leader in
Metadata until navigation expired it, so the producer waited for the dead gateway
(4-6 s in the kill loop of issue 22, with the 2 s test expiry; the whole 10 s default
here). Now a gateway dials its peers at every refresh and when a client asks
Metadata (which a client does within milliseconds of losing a broker), leaves out
one that refuses connections (navigation/liveness.py), and keeps a departed gateway
in the brokers list for a few seconds, leading nothing, so librdkafka moves the
partition at once instead of a second later (protocols/kafka/cluster.py).

The expiry is the default 10 s, not the test env's 2 s, so that the old behaviour
cannot pass by luck; only an ordering with a wide margin is asserted, never a time.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.gateway.config import ENV_PREFIX
from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.kafka.cluster import DepartedBrokers
from tests.cluster.fast_failure import cluster_env

_TIMEOUT_S = 90.0
_ACKS_AROUND_A_KILL = 50  # acknowledged sends before and after each kill


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    env = cluster_env()
    env[ENV_PREFIX + "NAVIGATION__GATEWAY_EXPIRY_MS"] = "10000"  # the default
    local = LocalCluster(
        layout(storage=1, gateways=2, data_dir=tmp_path, port_offset=None), env=env
    )
    try:
        await local.start()
        yield local
    finally:
        await local.stop()


def _bootstrap(cluster: LocalCluster, gateway: str) -> str:
    host, port = cluster.address(gateway, "kafka")
    return f"{host}:{port}"


def _topic_led_by(gateway: str) -> str:
    """A topic name whose partition 0 the rendezvous hashing gives to ``gateway``
    while both gateways are up (protocols/kafka/cluster.py)."""
    both = [GatewayEndpoint(gateway_id=g, host="", port=0) for g in ("gateway-1", "gateway-2")]
    while True:
        topic = f"kill-{uuid.uuid4().hex[:8]}"
        owner = owner_of(f"{topic}/0", both)
        if owner is not None and owner.gateway_id == gateway:
            return topic


def _wait_for_brokers(client: AdminClient | Producer, count: int) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while len(client.list_topics(timeout=10).brokers) != count:
        assert time.monotonic() < deadline, f"Metadata never listed {count} gateways"
        time.sleep(0.1)


class _Sender:
    """Produces one record every few milliseconds from a thread, and notes when each
    acknowledgement arrived."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer = producer
        self.topic = topic
        self.acked: list[float] = []
        self.errors: list[KafkaError] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Sender:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(_TIMEOUT_S)

    def _delivered(self, err: KafkaError | None, msg: object) -> None:
        if err is None:
            self.acked.append(time.monotonic())
        else:
            self.errors.append(err)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.producer.produce(self.topic, b"x", on_delivery=self._delivered)
            self.producer.poll(0.005)
        self.producer.flush(_TIMEOUT_S)

    async def acks_since(self, since: float, count: int) -> None:
        async with asyncio.timeout(_TIMEOUT_S):
            while sum(1 for t in self.acked if t >= since) < count:
                await asyncio.sleep(0.05)

    async def gap_across_kill(self, cluster: LocalCluster, gateway: str) -> float:
        """The longest time between two acknowledgements around killing ``gateway``."""
        await self.acks_since(time.monotonic(), _ACKS_AROUND_A_KILL)
        before = time.monotonic()
        await self.acks_since(before, 1)
        await cluster.kill(gateway)
        killed = time.monotonic()
        await self.acks_since(killed, _ACKS_AROUND_A_KILL)
        around = [t for t in self.acked if t >= before]
        return max(b - a for a, b in itertools.pairwise(around))


async def test_killing_the_leader_costs_about_what_killing_the_other_does(
    cluster: LocalCluster,
) -> None:
    topic = _topic_led_by("gateway-2")
    admin = AdminClient({"bootstrap.servers": _bootstrap(cluster, "gateway-1")})
    await asyncio.to_thread(_wait_for_brokers, admin, 2)
    await asyncio.to_thread(
        lambda: admin.create_topics([NewTopic(topic, 1)])[topic].result(_TIMEOUT_S)
    )
    brokers = {b.id: f"{b.host}:{b.port}" for b in admin.list_topics(timeout=10).brokers.values()}
    leader = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    assert brokers[leader] == _bootstrap(cluster, "gateway-2")

    # Told of gateway-2, the leader, by gateway-1's Metadata, as in the kill loop.
    producer = Producer(
        {
            "bootstrap.servers": _bootstrap(cluster, "gateway-1"),
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": int(_TIMEOUT_S * 1000),
            # A restarted gateway-1 must not wait out a long reconnect backoff when it
            # becomes the leader: that would measure the client, not the server.
            "reconnect.backoff.max.ms": 500,
        }
    )
    with _Sender(producer, topic) as sender:
        other_gap = await sender.gap_across_kill(cluster, "gateway-1")
        await cluster.start("gateway-1")
        await asyncio.to_thread(_wait_for_brokers, producer, 2)
        leader_gap = await sender.gap_across_kill(cluster, "gateway-2")
    assert not sender.errors, sender.errors[:3]
    assert leader_gap <= 3 * other_gap + 2.0, (
        f"killing the leader stalled the producer {leader_gap:.2f} s, "
        f"killing the other gateway {other_gap:.2f} s"
    )


def test_a_departed_gateway_is_listed_for_a_while_from_the_view_that_missed_it() -> None:
    now = [100.0]
    departed = DepartedBrokers(linger_s=5.0, clock=lambda: now[0])
    one, two = (GatewayEndpoint(gateway_id=g, host="h", port=1) for g in ("g1", "g2"))
    assert departed.note([one, two]) == []
    now[0] = 500.0  # no view for minutes, then g2 is gone: listed from now on
    assert departed.note([one]) == [two]
    now[0] = 504.0
    assert departed.note([one]) == [two]
    now[0] = 505.5
    assert departed.note([one]) == []
    assert departed.note([one, two]) == []  # back: live, not departed
    now[0] = 506.0
    assert departed.note([two]) == [one]
    assert departed.note([one, two]) == []
