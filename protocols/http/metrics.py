"""Prometheus ``/metrics``: the gateway's metering (messages and bytes in and out per
namespace and protocol), open connections, queue depth and HTTP request latency, and
in the merged form the embedded engine's fsync and group-commit figures
(docs/metrics.md).

Each app gets its own ``CollectorRegistry`` (never the process-global one), so several
gateways in one process, as tests run them, do not clash over metric names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from polymq.gateway.accounts import Principal
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.processor import Caller
from polymq.protocols.http.operator_metrics import OperatorMetrics
from polymq.protocols.http.quota_metrics import QuotaCollector
from polymq.protocols.mns.queues import QUEUE_KIND, queue_counts
from polymq.storage.errors import QueueNotFound, TopicNotFound
from polymq.storage.node_metrics import StorageCollector

__all__ = ["GatewayMetrics", "LatencyMiddleware"]

# Scrapes read every namespace; this identity exists only inside the gateway.
_SCRAPER = Principal(
    name="metrics", namespaces=frozenset(), default_namespace="default", admin=True
)
_MAX_TOPICS_PER_NAMESPACE = 1000  # a scrape stays cheap with millions of MQTT sessions
MERGED_SHARD = "merged"  # the shard label of the embedded engine's figures


@dataclass(slots=True)
class _Depths:
    """Queue depths taken just before a scrape (the collector itself cannot await)."""

    topics: dict[tuple[str, str], int] = field(default_factory=dict)
    mns: dict[tuple[str, str, str], int] = field(default_factory=dict)


class _GatewayCollector(Collector):
    def __init__(self, context: ListenerContext, depths: _Depths) -> None:
        self._context = context
        self._depths = depths

    def collect(self) -> Iterable[Metric]:
        usage = self._context.metering.snapshot()
        families = (
            ("polymq_messages_in", "Messages accepted from producers.", "messages_in"),
            ("polymq_messages_out", "Messages delivered to consumers.", "messages_out"),
            ("polymq_bytes_in", "Message bytes accepted from producers.", "bytes_in"),
            ("polymq_bytes_out", "Message bytes delivered to consumers.", "bytes_out"),
        )
        for name, help_text, attr in families:
            counter = CounterMetricFamily(name, help_text, labels=["namespace", "protocol"])
            for u in usage:
                counter.add_metric([u.namespace, u.protocol], getattr(u, attr))
            yield counter
        tenants = GaugeMetricFamily(
            "polymq_tenant_connections",
            "Authenticated client connections per namespace and protocol.",
            labels=["namespace", "protocol"],
        )
        for u in usage:
            tenants.add_metric([u.namespace, u.protocol], u.connections)
        yield tenants
        per_protocol: dict[str, int] = {}
        for conn in self._context.connections.list():
            per_protocol[conn.protocol] = per_protocol.get(conn.protocol, 0) + 1
        connections = GaugeMetricFamily(
            "polymq_connections_open", "Open client connections.", labels=["protocol"]
        )
        for protocol, count in sorted(per_protocol.items()):
            connections.add_metric([protocol], count)
        yield connections
        failed = CounterMetricFamily(
            "polymq_login_failures",
            "Failed logins (bad user name or password), by protocol.",
            labels=["protocol"],
        )
        for protocol, count in sorted(self._context.accounts.login_failures().items()):
            failed.add_metric([protocol], count)
        yield failed
        depth = GaugeMetricFamily(
            "polymq_topic_messages",
            "Messages retained in a topic (latest minus earliest offset, all queues).",
            labels=["namespace", "topic"],
        )
        for (namespace, topic), count in sorted(self._depths.topics.items()):
            depth.add_metric([namespace, topic], count)
        yield depth
        mns = GaugeMetricFamily(
            "polymq_mns_queue_messages",
            "MNS queue depth: active (visible) and inactive (received, not deleted).",
            labels=["namespace", "queue", "state"],
        )
        for (namespace, queue, state), count in sorted(self._depths.mns.items()):
            mns.add_metric([namespace, queue, state], count)
        yield mns


class GatewayMetrics:
    def __init__(self, context: ListenerContext) -> None:
        self._context = context
        self.registry = CollectorRegistry(auto_describe=False)
        self._depths = _Depths()
        self.registry.register(_GatewayCollector(context, self._depths))
        self.registry.register(QuotaCollector(context.quotas, context.connections))
        self._operator = OperatorMetrics(context.processor)  # lag, rates, latencies
        self.registry.register(self._operator.collector)
        log_stats = context.processor.storage_log_stats()
        if log_stats is not None:  # the merged form: the engine's fsyncs and group commits
            self.registry.register(StorageCollector(lambda: [(MERGED_SHARD, log_stats)]))
        self.latency = Histogram(
            "polymq_http_request_duration_seconds",
            "HTTP request latency on the MNS / admin port, by route.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
        )

    async def refresh(self) -> None:
        """Take queue depths from storage, for the next :meth:`render`."""
        processor = self._context.processor
        topics: dict[tuple[str, str], int] = {}
        mns: dict[tuple[str, str, str], int] = {}
        scraper = Caller(principal=_SCRAPER, namespace="default", protocol="http")
        for namespace in await processor.list_namespaces(scraper):
            caller = Caller(principal=_SCRAPER, namespace=namespace, protocol="http")
            infos = await processor.list_topics(caller)
            for info in infos[:_MAX_TOPICS_PER_NAMESPACE]:
                topics[(namespace, info.name)] = sum(q.latest - q.earliest for q in info.queues)
            for queue in list(await processor.meta_list(caller, QUEUE_KIND))[
                :_MAX_TOPICS_PER_NAMESPACE
            ]:
                try:
                    counts = await queue_counts(processor, caller, queue)
                except (TopicNotFound, QueueNotFound):
                    continue  # its topic was deleted under it (by another protocol)
                mns[(namespace, queue, "active")] = counts.active
                mns[(namespace, queue, "inactive")] = counts.inactive
        self._depths.topics = topics
        self._depths.mns = mns
        await self._operator.refresh()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyMiddleware:
    """Times every HTTP request, labelled by its route template (not the raw path, so
    queue names do not explode the label set)."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self._app = app
        self._histogram = histogram
        # Label sets are few (method x route template x status): bounded.
        self._children: dict[tuple[str, str, int], Histogram] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, timed_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            key = (scope["method"], route, status)
            child = self._children.get(key)
            if child is None:  # ``labels`` is slow for a per-request call: keep each
                child = self._children[key] = self._histogram.labels(
                    route=route, method=key[0], status=str(status)
                )
            child.observe(time.perf_counter() - start)
