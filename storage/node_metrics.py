"""The storage side of ``/metrics`` (docs/metrics.md): the commit log's fsync and
group-commit figures of each engine, and the replicated pool's publish, lease and
takeover figures of this process.

Rendered in two places. In the merged form the gateway's ``/metrics`` adds
:class:`StorageCollector` over its embedded engine. In the separated form storage
runs in processes of its own, so each one serves its figures on a port of its own
(``node.metrics_port``), as each Kafka broker does: :class:`MetricsServer`, a plain
HTTP responder on the process's event loop, where the collectors read their counts
(the loop is the only thread that changes them, but for the fsync thread's, see
``storage/engine/stats.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from polymq.storage.engine.stats import HistogramSnapshot, LogStats
from polymq.storage.lifecycle import Service
from polymq.storage.replicated.stats import ReplicationStats

__all__ = ["MetricsServer", "StorageCollector", "histogram_family", "serving_metrics"]


LogSource = Callable[[], Iterable[tuple[str, LogStats]]]  # (shard, its log's figures)
_REQUEST_TIMEOUT_S = 10.0
_MAX_HEAD_BYTES = 8192


def histogram_family(
    name: str, help_text: str, label: str, snapshots: Mapping[str, HistogramSnapshot]
) -> HistogramMetricFamily:
    """A Prometheus histogram of one series per value of ``label``."""
    family = HistogramMetricFamily(name, help_text, labels=[label])
    for value, snap in sorted(snapshots.items()):
        family.add_metric(
            [value],
            [(str(bound) if bound != float("inf") else "+Inf", n) for bound, n in snap.buckets],
            snap.total,
        )
    return family


class StorageCollector(Collector):
    """The figures of the engines ``logs`` names (labelled by shard) and, in a storage
    process of the replicated pool, of its ``replication``."""

    def __init__(self, logs: LogSource, replication: ReplicationStats | None = None) -> None:
        self._logs = logs
        self._replication = replication

    def collect(self) -> Iterable[Metric]:
        logs = sorted(self._logs(), key=lambda pair: pair[0])
        yield histogram_family(
            "polymq_storage_fsync_seconds",
            "Duration of each fdatasync of a commit-log segment.",
            "shard",
            {shard: stats.fsync.snapshot() for shard, stats in logs},
        )
        yield histogram_family(
            "polymq_storage_commit_seconds",
            "Group commit: from the first append of a group being queued to the group "
            "being durable (fsynced; replicated logs: acknowledged by JetStream too).",
            "shard",
            {shard: stats.commit.snapshot() for shard, stats in logs},
        )
        for name, help_text, values in (
            (
                "polymq_storage_fsyncs",
                "Commit-log fsyncs (fdatasync of a segment).",
                [(shard, stats.fsync.snapshot().count) for shard, stats in logs],
            ),
            (
                "polymq_storage_written_records",
                "Records written to the commit log.",
                [(shard, stats.records) for shard, stats in logs],
            ),
            (
                "polymq_storage_written_bytes",
                "Bytes written to the commit log (framed).",
                [(shard, stats.bytes) for shard, stats in logs],
            ),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["shard"])
            for shard, value in values:
                counter.add_metric([shard], value)
            yield counter
        if self._replication is not None:
            yield from _replication_families(self._replication)


def _replication_families(stats: ReplicationStats) -> Iterable[Metric]:
    yield histogram_family(
        "polymq_replication_publish_seconds",
        "JetStream publish of a commit-log chunk until its acknowledgement (a quorum "
        "of the stream's replicas has it), retries included.",
        "shard",
        stats.publish.snapshot(),
    )
    yield histogram_family(
        "polymq_replication_takeover_seconds",
        "From winning a shard's lease to serving it (its stream replayed), per takeover.",
        "shard",
        stats.takeover_seconds.snapshot(),
    )
    last = GaugeMetricFamily(
        "polymq_replication_last_takeover_seconds",
        "How long the last takeover of a shard by this process took.",
        labels=["shard"],
    )
    for shard, seconds in sorted(stats.last_takeover_seconds.items()):
        last.add_metric([shard], seconds)
    yield last
    for name, help_text, counts in (
        (
            "polymq_replication_takeovers",
            "Shards this process acquired (lease won and served), its first start included.",
            stats.takeovers,
        ),
        (
            "polymq_replication_lease_renewals_failed",
            "Lease renewals that got no answer from NATS (the lease may still hold).",
            stats.renewals_failed,
        ),
        (
            "polymq_replication_leases_lost",
            "Leases lost: a renewal was refused (expired, or another process holds it).",
            stats.leases_lost,
        ),
    ):
        counter = CounterMetricFamily(name, help_text, labels=["shard"])
        for shard, n in sorted(counts.items()):
            counter.add_metric([shard], n)
        yield counter
    yield GaugeMetricFamily(
        "polymq_replication_shards_owned",
        "Shards this process serves now.",
        value=len(stats.owned),
    )
    yield GaugeMetricFamily(
        "polymq_replication_shards",
        "Shards of the pool (each should have one owner among the storage processes).",
        value=stats.shards,
    )


class MetricsServer(Service):
    """``GET /metrics`` of ``registry`` on ``host:port`` (0: any free port, see
    :attr:`address`). HTTP/1.0-style: one request per connection, then close."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int) -> None:
        super().__init__()
        self._registry = registry
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "MetricsServer.start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await super().close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(head)
            if method not in ("GET", "HEAD"):
                status, body, kind = "405 Method Not Allowed", b"", "text/plain"
            elif path.split("?")[0] != "/metrics":
                status, body, kind = "404 Not Found", b"see /metrics\n", "text/plain"
            else:
                status, body, kind = "200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a scraper that went away or sent no request: nothing to answer
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _request_line(head: bytes) -> tuple[str, str]:
    line = head[:_MAX_HEAD_BYTES].split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    return (parts[0], parts[1]) if len(parts) >= 2 else ("", "")


@contextlib.asynccontextmanager
async def serving_metrics(
    port: int | None, host: str, logs: LogSource, replication: ReplicationStats | None = None
) -> AsyncIterator[MetricsServer | None]:
    """A storage process's own ``/metrics`` on ``port`` (``None``: none) while inside."""
    if port is None:
        yield None
        return
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StorageCollector(logs, replication))
    server = MetricsServer(registry, host=host, port=port)
    await server.start()
    try:
        yield server
    finally:
        await server.close()
