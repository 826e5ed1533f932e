"""Namespaces and topics: creating, altering and deleting them, and the bounds of
their queues (start, end, trimming, the offset for a time).

Each change is one metadata record, applied by the same function a replay uses.
"""

from __future__ import annotations

from polymq.storage.engine.core import EnginePart
from polymq.storage.engine.maintenance import apply_topic_retention
from polymq.storage.engine.state import config_to_json
from polymq.storage.errors import (
    InvalidArgument,
    NamespaceAlreadyExists,
    OffsetOutOfRange,
    TopicAlreadyExists,
)
from polymq.storage.model import UNLIMITED, QueueOffsets, QueueRef, TopicConfig, TopicInfo
from polymq.storage.names import check_name

__all__ = ["Topics"]

_MAX_QUEUES = 65_536


class Topics(EnginePart):
    """The namespaces and topics of one engine."""

    # ------------------------------------------------------------------ namespaces

    async def create_namespace(self, namespace: str) -> None:
        check_name("namespace", namespace)
        await self._core.writable()
        if namespace in self._state.namespaces:
            raise NamespaceAlreadyExists(f"namespace {namespace!r} already exists")
        end = self._core.meta(op="ns_create", ns=namespace, ms=self._core.now())
        await self._log.wait_durable(end)

    async def delete_namespace(self, namespace: str) -> None:
        await self._core.writable()
        self._state.namespace(namespace)
        if any(ns == namespace for ns, _ in self._state.topics):
            raise InvalidArgument(f"namespace {namespace!r} still has topics")
        await self._log.wait_durable(self._core.meta(op="ns_delete", ns=namespace))

    def list_namespaces(self) -> list[str]:
        self._core.check_open()
        return sorted(self._state.namespaces)

    # ------------------------------------------------------------------ topics

    async def create_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        check_name("topic", topic)
        _check_topic_config(config)
        await self._core.writable()
        self._state.namespace(namespace)
        if (namespace, topic) in self._state.topics:
            raise TopicAlreadyExists(f"topic {topic!r} already exists in namespace {namespace!r}")
        created = self._core.create_topic_now(namespace, topic, config)
        await self._log.wait_durable()
        return self._state.topic_info(created)

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        _check_topic_config(config)
        await self._core.writable()
        current = self._state.topic(namespace, topic)
        if config.queue_count < len(current.queues):
            raise InvalidArgument(
                f"queue_count can only grow: topic {topic!r} has {len(current.queues)} queues"
            )
        end = self._core.meta(
            op="topic_alter", id=current.id, config=config_to_json(config), ms=self._core.now()
        )
        await self._log.wait_durable(end)
        apply_topic_retention(self._core)
        return self._state.topic_info(current)

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._core.writable()
        current = self._state.topic(namespace, topic)
        await self._log.wait_durable(self._core.meta(op="topic_delete", id=current.id))

    def list_topics(self, namespace: str, include_internal: bool) -> list[TopicInfo]:
        self._core.check_open()
        self._state.namespace(namespace)
        return [
            self._state.topic_info(t)
            for (ns, _), t in sorted(self._state.topics.items())
            if ns == namespace and (include_internal or not t.config.internal)
        ]

    def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        self._core.check_open()
        return self._state.topic_info(self._state.topic(namespace, topic))

    # ------------------------------------------------------------------ queue bounds

    def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        self._core.check_open()
        _, index = self._state.queue(queue)
        return QueueOffsets(index.earliest, index.end)

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        await self._core.writable()
        topic, index = self._state.queue(queue)
        if not 0 <= before_offset <= index.end:
            raise OffsetOutOfRange(
                f"offset {before_offset} is outside [0, {index.end}] of {queue}",
                earliest=index.earliest,
                latest=index.end,
            )
        if before_offset > index.earliest:
            end = self._core.meta(
                op="trim", id=topic.id, queue=queue.queue_id, offset=before_offset
            )
            await self._log.wait_durable(end)
        return QueueOffsets(index.earliest, index.end)

    def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        self._core.check_open()
        _, index = self._state.queue(queue)
        return max(index.earliest, index.first_offset_where("store_ms", timestamp_ms))


def _check_topic_config(config: TopicConfig) -> None:
    if not 1 <= config.queue_count <= _MAX_QUEUES:
        raise InvalidArgument(f"queue_count must be 1..{_MAX_QUEUES}, got {config.queue_count}")
    for name in ("retention_ms", "retention_bytes"):
        value = getattr(config, name)
        if value is not None and value <= 0 and value != UNLIMITED:
            raise InvalidArgument(f"{name} must be positive or {UNLIMITED}, got {value}")
    if config.max_message_bytes is not None and config.max_message_bytes <= 0:
        raise InvalidArgument(f"max_message_bytes must be positive, got {config.max_message_bytes}")
