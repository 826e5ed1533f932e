"""Helpers for the Kafka tests of the separated form: a LocalCluster of 3 storage nodes
and 2 gateways, which gateway owns which Kafka key, which node holds a topic, and a
raw read of a partition's record batches (producer id and sequences included, which
no client library shows)."""

from __future__ import annotations

import asyncio
import itertools
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from confluent_kafka.admin import AdminClient

from polymq.gateway.cluster_tool import LocalCluster, layout
from polymq.nameserver.client import NameserverClient
from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.kafka.records import parse_header
from tests.cluster.fast_failure import cluster_env
from tests.kafka.raw import RawKafka

__all__ = [
    "GATEWAYS",
    "StoredBatch",
    "bootstrap",
    "kafka_cluster",
    "node_of",
    "owner",
    "read_partition",
    "unique_name",
    "until",
]

GATEWAYS = ("gateway-1", "gateway-2")
_STORAGE_ERROR = 56  # KAFKA_STORAGE_ERROR: the partition's storage node is away
_TIMEOUT_S = 60.0
_names = itertools.count()


def unique_name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}-{next(_names)}"


@asynccontextmanager
async def kafka_cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    """Three storage nodes and two gateways (``polymq cluster up --storage 3
    --gateways 2``, on free ports), all stopped afterwards."""
    specs = layout(storage=3, gateways=2, data_dir=tmp_path, port_offset=None)
    local = LocalCluster(specs, env=cluster_env())
    try:
        await local.start()
        for gateway in GATEWAYS:
            await until(partial(_lists_every_gateway, local, gateway), f"{gateway}'s brokers")
        yield local
    finally:
        await local.stop()


async def _lists_every_gateway(cluster: LocalCluster, gateway: str) -> bool:
    """Whether ``gateway`` knows every gateway yet: until then it takes itself for
    the owner of every key, and coordinators would move under a test's feet."""
    admin = AdminClient({"bootstrap.servers": bootstrap(cluster, gateway)})
    metadata = await asyncio.to_thread(admin.list_topics, timeout=10)
    return len(metadata.brokers) == len(GATEWAYS)


def bootstrap(cluster: LocalCluster, gateway: str = "gateway-1") -> str:
    host, port = cluster.address(gateway, "kafka")
    return f"{host}:{port}"


def owner(key: str) -> str:
    """The gateway owning a Kafka key (a transactional id, ``"<topic>/<partition>"``
    for a leader), as every gateway computes it (protocols/kafka/cluster.py)."""
    endpoints = [GatewayEndpoint(gateway_id=g, host="", port=0) for g in GATEWAYS]
    found = owner_of(key, endpoints)
    assert found is not None
    return found.gateway_id


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def node_of(cluster: LocalCluster, topic: str) -> str:
    """The storage process (``storage-N``) holding ``topic``, once routes list it."""
    found: list[str] = []

    async def placed() -> bool:
        client = NameserverClient([cluster.nameserver])
        try:
            routes = await client.status()
        finally:
            await client.close()
        node = routes.topics.get(("default", topic))
        if node is not None:
            found.append(node)
        return node is not None

    await until(placed, f"topic {topic} to be placed")
    return "storage-" + found[0].removeprefix("node-")


@dataclass(frozen=True, slots=True)
class StoredBatch:
    base_offset: int
    count: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    control: bool
    records: bytes


def read_partition(address: tuple[str, int], topic: str, partition: int = 0) -> list[StoredBatch]:
    """Every record batch of a partition, read_uncommitted, through a raw Fetch."""
    out: list[StoredBatch] = []
    offset = 0
    deadline = time.monotonic() + 30.0  # for the gateway to reach a restarted node
    with RawKafka(*address, timeout=30.0) as client:
        while True:
            body = {
                "replica_id": -1,
                "max_wait": 0,
                "min_bytes": 0,
                "max_bytes": 8 << 20,
                "isolation_level": 0,
                "topics": [
                    {
                        "topic": topic,
                        "partitions": [
                            {
                                "partition": partition,
                                "fetch_offset": offset,
                                "partition_max_bytes": 8 << 20,
                            }
                        ],
                    }
                ],
            }
            answer = client.request(1, 11, body).responses[0].partitions[0]
            if answer.error_code == _STORAGE_ERROR and time.monotonic() < deadline:
                time.sleep(0.1)  # the node just restarted: the gateway reaches it soon
                continue
            assert answer.error_code == 0, answer.error_code
            batches = _batches(answer.records or b"")
            if not batches:
                return out
            out += batches
            offset = batches[-1].base_offset + batches[-1].count


def _batches(data: bytes) -> list[StoredBatch]:
    batches = []
    position = 0
    while position + 12 <= len(data):
        (length,) = struct.unpack_from(">i", data, position + 8)
        end = position + 12 + length
        if end > len(data):
            break  # a partial batch at the end of the response
        header = parse_header(memoryview(data[position:end]))
        batches.append(
            StoredBatch(
                base_offset=header.base_offset,
                count=header.record_count,
                producer_id=header.producer_id,
                producer_epoch=header.producer_epoch,
                base_sequence=header.base_sequence,
                control=header.control,
                records=data[position:end],
            )
        )
        position = end
    return batches
