"""The storage engine's own figures on ``/metrics`` (docs/metrics.md): fsyncs, group
commits, records and bytes written, measured in the commit log.

In the merged form they are on the gateway's ``/metrics``; in the separated form each
storage process serves them on a port of its own (``--metrics-port``, wired by
``polymq cluster up``'s layout) and the gateway shows none. Traffic is real: Kafka
produces with acks=all through kafka-python, each send waiting for its fsync, so the
counts grow by at least one record, one fsync and one group commit per send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from polymq.gateway.cluster_tool import LocalCluster, layout
from tests.cluster.fast_failure import cluster_env
from tests.live_server import live_server

ONE_FORM = True  # builds its own servers: one merged, one separated
pytestmark = pytest.mark.timeout(180)

SENDS = 25
BODY = b"m" * 100
WAIT_S = 30.0
Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text page, parsed by prometheus_client's own
    parser (so the page must be valid exposition text)."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text[:200]
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def produce(bootstrap: str, topic: str) -> None:
    """``SENDS`` records, one acks=all send at a time (each its own group commit)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    for _ in range(SENDS):
        producer.send(topic, BODY, partition=0).get(WAIT_S)
    producer.close()


def check_grew(before: Samples, after: Samples, shard: str) -> None:
    """The engine's counts grew by at least what was sent, and each histogram is whole
    (its +Inf bucket is its count, which is the fsync counter for fsyncs)."""

    def delta(name: str, **labels: str) -> float:
        return value(after, name, shard=shard, **labels) - value(
            before, name, shard=shard, **labels
        )

    assert delta("polymq_storage_written_records_total") >= SENDS
    assert delta("polymq_storage_written_bytes_total") >= SENDS * len(BODY)
    assert delta("polymq_storage_fsyncs_total") >= SENDS
    assert delta("polymq_storage_commit_seconds_count") >= SENDS
    assert delta("polymq_storage_commit_seconds_sum") > 0
    assert delta("polymq_storage_fsync_seconds_sum") > 0
    for histogram in ("polymq_storage_fsync_seconds", "polymq_storage_commit_seconds"):
        count = value(after, f"{histogram}_count", shard=shard)
        assert value(after, f"{histogram}_bucket", shard=shard, le="+Inf") == count
    assert value(after, "polymq_storage_fsync_seconds_count", shard=shard) == value(
        after, "polymq_storage_fsyncs_total", shard=shard
    )


def test_the_merged_gateway_shows_its_engine_fsyncs_and_group_commits(tmp_path: Path) -> None:
    with live_server(tmp_path, ("http", "kafka")) as server:
        host, port = server.address("http")
        metrics = f"http://{host}:{port}/metrics"
        before = scrape(metrics)
        kafka_host, kafka_port = server.address("kafka")
        produce(f"{kafka_host}:{kafka_port}", "fsynced")
        after = scrape(metrics)
    check_grew(before, after, "merged")


async def test_a_storage_process_serves_its_own_metrics_and_the_gateway_none(
    tmp_path: Path,
) -> None:
    """``polymq cluster up``'s layout: a nameserver, navigation, one storage process
    (with ``--metrics-port``) and one gateway, as real processes."""
    specs = layout(storage=1, gateways=1, data_dir=tmp_path, port_offset=None)
    storage = next(spec for spec in specs if spec.name == "storage-1")
    assert "--metrics-port" in storage.args
    cluster = LocalCluster(specs, env=cluster_env())
    try:
        await cluster.start()
        host, port = cluster.address("storage-1", "metrics")
        node_metrics = f"http://{host}:{port}/metrics"
        gateway_host, gateway_port = cluster.address("gateway-1", "http")
        gateway_metrics = f"http://{gateway_host}:{gateway_port}/metrics"
        before = await asyncio.to_thread(scrape, node_metrics)
        kafka_host, kafka_port = cluster.address("gateway-1", "kafka")
        await asyncio.to_thread(produce, f"{kafka_host}:{kafka_port}", "remote-fsynced")
        after = await asyncio.to_thread(scrape, node_metrics)
        check_grew(before, after, "node-1")
        on_gateway = await asyncio.to_thread(scrape, gateway_metrics)
        assert not [name for name, _ in on_gateway if name.startswith("polymq_storage_")]
        assert httpx.get(node_metrics.removesuffix("metrics") + "other").status_code == 404
    finally:
        await cluster.stop()
