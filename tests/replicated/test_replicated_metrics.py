"""The replicated pool's figures on each storage process's own ``/metrics``
(docs/metrics.md), on real processes: three NATS servers, three storage processes
(``--metrics-port 0``) each preferring one shard, two gateways.

- At start each process owns its shard: one takeover each, one shard owned, and
  every metric of the pool that the Grafana dashboard and the alert rules query has
  a sample on some storage process.
- Kafka sends (kafka-python, acks=all, one at a time) to a topic on a shard grow its
  owner's JetStream publish count, group commits and records written by at least one
  each per send.
- The owner is SIGKILLed: the process that takes the shard over counts one takeover
  of it, with its duration, owns two shards, and the shard's publishes now grow there.
- Another owner is SIGSTOPped until its shard is taken over, then SIGCONTed: it
  counts the lease it lost.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from kafka import KafkaProducer
from kafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, layout
from polymq.storage.replicated.local_nats import LocalNats
from tests.replicated.conftest import ReplicatedPool, replicated_env, storage_specs
from tests.replicated.test_replicated_clients_kill import (
    _make_kafka,
    gateways,
    place,
    server_of,
    until,
)

ONE_FORM = True
pytestmark = pytest.mark.timeout(300)

SENDS = 20
WAIT_S = 60.0
DOCS = Path(__file__).resolve().parents[2] / "docs"
Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


@asynccontextmanager
async def pool_with_metrics(directory: Path) -> AsyncIterator[ReplicatedPool]:
    """tests/replicated/conftest.py's pool, each storage process with its /metrics."""
    async with LocalNats(directory / "nats", 3) as nats:
        specs = layout(storage=0, gateways=2, data_dir=directory, port_offset=None)
        storage = [
            ProcessSpec(spec.name, (*spec.args, "--metrics-port", "0"))
            for spec in storage_specs(3, 3, nats, directory)
        ]
        local = LocalCluster([*specs[:2], *storage, *specs[2:]], env=replicated_env())
        try:
            await local.start()
            yield ReplicatedPool(nats, local, [spec.name for spec in storage])
        finally:
            await local.stop()


def _scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)  # valid exposition text
        for s in family.samples
    }


async def scrape(pool: ReplicatedPool, name: str) -> Samples:
    host, port = pool.cluster.address(name, "metrics")
    return await asyncio.to_thread(_scrape, f"http://{host}:{port}/metrics")


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def queried() -> set[str]:
    """The pool's metrics (storage and replication) the dashboard and alerts query."""
    dashboard = json.loads((DOCS / "grafana" / "polymq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DOCS / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    names = {m for e in exprs for m in re.findall(r"\bpolymq_[a-z0-9_]+", e)}
    return {n for n in names if n.startswith(("polymq_replication_", "polymq_storage_"))}


def produce(bootstrap: str, topic: str, count: int) -> None:
    """``count`` acknowledged acks=all sends, one at a time; a send that fails while a
    shard moves is sent again (at least once is enough: the counts only grow)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", retries=5)
    deadline = time.monotonic() + WAIT_S
    sent = 0
    try:
        while sent < count:
            try:
                producer.send(topic, b"r" * 100, partition=0).get(10)
                sent += 1
            except KafkaError:
                assert time.monotonic() < deadline, f"only {sent} of {count} sends acknowledged"
                time.sleep(0.2)
    finally:
        producer.close()


async def test_publish_takeover_and_ownership_figures_follow_traffic_and_a_kill(
    tmp_path: Path,
) -> None:
    async with pool_with_metrics(tmp_path) as pool:
        names = dict(zip(pool.storage, ("shard-1", "shard-2", "shard-3"), strict=True))

        async def one_shard_each() -> bool:
            for name, shard in names.items():
                samples = await scrape(pool, name)
                if value(samples, "polymq_replication_shards_owned") != 1:
                    return False
                if value(samples, "polymq_replication_takeovers_total", shard=shard) != 1:
                    return False
            return True

        await until(one_shard_each, "each storage process to own its shard", pool)
        sampled = {
            sample_name for name in pool.storage for sample_name, _ in await scrape(pool, name)
        }
        wanted = queried()
        assert "polymq_replication_takeovers_total" in wanted
        assert wanted - sampled == set()
        first = await scrape(pool, "storage-1")
        assert value(first, "polymq_replication_shards") == 3
        assert value(first, "polymq_replication_takeover_seconds_count", shard="shard-1") == 1

        topic = await place(pool, "shard-1", _make_kafka)
        owner = await server_of(pool, "shard-1")
        assert owner is not None
        bootstrap = gateways(pool).bootstrap
        before = await scrape(pool, owner)
        await asyncio.to_thread(produce, bootstrap, topic, SENDS)
        after = await scrape(pool, owner)

        def grew(name: str, by: int) -> None:
            delta = value(after, name, shard="shard-1") - value(before, name, shard="shard-1")
            assert delta >= by, f"{name} grew by {delta}, not {by}"

        grew("polymq_replication_publish_seconds_count", SENDS)
        grew("polymq_storage_commit_seconds_count", SENDS)
        grew("polymq_storage_written_records_total", SENDS)

        # Counts from here on are compared with what each process counted before: a
        # start-up where processes came up side by side may already have moved a
        # shard once (taken by a neighbour while its own process was still starting,
        # then handed back).
        survivors = [name for name in pool.storage if name != owner]
        takeovers = {
            name: value(
                await scrape(pool, name), "polymq_replication_takeovers_total", shard="shard-1"
            )
            for name in survivors
        }
        await pool.cluster.kill(owner)
        taker: list[str] = []

        async def taken_over() -> bool:
            for name in survivors:
                samples = await scrape(pool, name)
                taken = value(samples, "polymq_replication_takeovers_total", shard="shard-1")
                if taken == takeovers[name] + 1:
                    taker.append(name)
                    return True
            return False

        await until(taken_over, "a survivor to count its takeover of shard-1", pool)
        new_owner = taker[0]
        samples = await scrape(pool, new_owner)
        assert value(samples, "polymq_replication_shards_owned") == 2
        assert (
            value(samples, "polymq_replication_takeover_seconds_count", shard="shard-1")
            == takeovers[new_owner] + 1
        )
        assert value(samples, "polymq_replication_last_takeover_seconds", shard="shard-1") > 0
        assert value(samples, "polymq_replication_leases_lost_total", shard="shard-1") == 0

        before = samples
        await asyncio.to_thread(produce, bootstrap, topic, SENDS)
        after = await scrape(pool, new_owner)
        grew("polymq_replication_publish_seconds_count", SENDS)

        # A stopped owner whose shard was taken meanwhile finds its lease gone when it
        # resumes: it counts the loss (the new owner counts the takeover).
        [stopped] = [name for name in survivors if name != new_owner]
        shard = names[stopped]
        taken_before = value(
            await scrape(pool, new_owner), "polymq_replication_takeovers_total", shard=shard
        )
        lost_before = value(
            await scrape(pool, stopped), "polymq_replication_leases_lost_total", shard=shard
        )
        child = pool.cluster.children[stopped]
        child.send(signal.SIGSTOP)
        try:

            async def moved() -> bool:
                samples = await scrape(pool, new_owner)
                taken = value(samples, "polymq_replication_takeovers_total", shard=shard)
                return taken == taken_before + 1

            await until(moved, f"{new_owner} to take {shard} from the stopped {stopped}", pool)
        finally:
            child.send(signal.SIGCONT)

        async def lost() -> bool:
            samples = await scrape(pool, stopped)
            return (
                value(samples, "polymq_replication_leases_lost_total", shard=shard)
                == lost_before + 1
            )

        await until(lost, f"{stopped} to count the lease of {shard} lost", pool)
