"""The part of ``/metrics`` that answers an operator's questions beyond the metering
(docs/admin.md, "Metrics"): how fast each topic grows, how far behind each consumer
group is, how long storage takes to acknowledge a publish per protocol and how long
messages wait before delivery. ``docs/grafana/polymq.json`` and
``docs/prometheus/alerts.yml`` query these.

Lags and offsets are taken from storage through the processor just before a scrape
(:meth:`OperatorMetrics.refresh`: a collector cannot await), bounded per namespace so
a scrape stays cheap with many groups; the histograms are the processor's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from polymq.gateway.accounts import Principal
from polymq.gateway.processor import Caller, Processor
from polymq.storage.errors import QueueNotFound, TopicNotFound
from polymq.storage.node_metrics import histogram_family

__all__ = ["OperatorMetrics"]

_SCRAPER = Principal(
    name="metrics", namespaces=frozenset(), default_namespace="default", admin=True
)
_MAX_PER_NAMESPACE = 1000  # topics and groups read per scrape and namespace


@dataclass(slots=True)
class _Taken:
    # (namespace, topic) -> sum of the latest offsets of its queues: grows by one per
    # message appended, so rate() of it is the topic's message-in rate.
    appended: dict[tuple[str, str], int] = field(default_factory=dict)
    # (namespace, group, topic) -> latest minus committed, over the topic's queues
    lag: dict[tuple[str, str, str], int] = field(default_factory=dict)


class _Collector(Collector):
    def __init__(self, processor: Processor, taken: _Taken) -> None:
        self._processor = processor
        self._taken = taken

    def collect(self) -> Iterable[Metric]:
        appended = CounterMetricFamily(
            "polymq_topic_appended",
            "Messages ever appended to a topic (the sum of its queues' latest offsets).",
            labels=["namespace", "topic"],
        )
        for (namespace, topic), n in sorted(self._taken.appended.items()):
            appended.add_metric([namespace, topic], n)
        yield appended
        lag = GaugeMetricFamily(
            "polymq_group_lag",
            "Messages a consumer group has not committed yet, per topic (offset groups).",
            labels=["namespace", "group", "topic"],
        )
        for (namespace, group, topic), n in sorted(self._taken.lag.items()):
            lag.add_metric([namespace, group, topic], n)
        yield lag
        yield histogram_family(
            "polymq_append_latency_seconds",
            "From a publish reaching storage to storage's acknowledgement (fsync included "
            "with sync durability), per protocol.",
            "protocol",
            self._processor.append_latency.snapshot(),
        )
        yield histogram_family(
            "polymq_delivery_age_seconds",
            "How long the oldest message of each delivery had been stored, per protocol.",
            "protocol",
            self._processor.delivery_age.snapshot(),
        )


class OperatorMetrics:
    def __init__(self, processor: Processor) -> None:
        self._processor = processor
        self._taken = _Taken()
        self.collector: Collector = _Collector(processor, self._taken)

    async def refresh(self) -> None:
        processor = self._processor
        appended: dict[tuple[str, str], int] = {}
        lag: dict[tuple[str, str, str], int] = {}
        scraper = Caller(principal=_SCRAPER, namespace="default", protocol="http")
        for namespace in await processor.list_namespaces(scraper):
            caller = Caller(principal=_SCRAPER, namespace=namespace, protocol="http")
            latest: dict[tuple[str, int], int] = {}
            for info in (await processor.list_topics(caller))[:_MAX_PER_NAMESPACE]:
                appended[(namespace, info.name)] = sum(q.latest for q in info.queues)
                for i, q in enumerate(info.queues):
                    latest[(info.name, i)] = q.latest
            for group in (await processor.list_groups(caller))[:_MAX_PER_NAMESPACE]:
                try:
                    offsets = await processor.list_group_offsets(caller, group)
                except (TopicNotFound, QueueNotFound):
                    continue
                for ref, committed in offsets.items():
                    end = latest.get((ref.topic, ref.queue_id))
                    if end is None:
                        continue  # a deleted topic, or one past the listing's bound
                    key = (namespace, group, ref.topic)
                    lag[key] = lag.get(key, 0) + max(0, end - committed.offset)
        self._taken.appended = appended
        self._taken.lag = lag
