"""The topic feeds: what other protocols store in storage topic ``T`` reaches MNS
topic ``T``'s subscriptions (docs/interop.md, natural names).

An MNS PublishMessage dispatches into the topic and its subscriptions in one append
(:mod:`protocols.mns.topics`); a Kafka record, an MQTT, AMQP or RocketMQ message
stored in ``T`` is dispatched by a feed: every gateway serving MNS pops each
subscribed topic with the topic's own group (:func:`feed_group`), forwards what it
took, then acks. The group is shared, so each message is forwarded by one gateway:
once per subscription (at least once if a gateway dies between the forward and the
ack). A subscription gets what was stored after it was made, as for publishes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from polymq.protocols.mns.notify import Notifier
from polymq.protocols.mns.topics import SUBSCRIPTION_KIND, TopicService
from polymq.storage.errors import StorageError, TopicNotFound
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import GroupConfig, QueueRef

__all__ = ["TopicFeeds", "feed_group"]

log = logging.getLogger(__name__)

_REFRESH_S: Final = 1.0
_POP_MAX: Final = 256
_INVISIBLE_MS: Final = 30_000
_WAIT_MS: Final = 1_000
_RETRY_S: Final = 1.0
_CONFIG: Final = GroupConfig(max_delivery_attempts=None, dead_letter=False)


def feed_group(topic: str) -> str:
    """A topic's feed group ("/" is in no MNS queue name, so no queue's group)."""
    return f"mns.feed/{topic}"


class TopicFeeds:
    """One feed per (namespace, subscribed topic), started and stopped as
    subscriptions come and go (looked at every :data:`_REFRESH_S`)."""

    def __init__(self, topics: TopicService, notifier: Notifier) -> None:
        self._topics = topics
        self._notifier = notifier
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._tasks: TaskSet | None = None

    async def run(self) -> None:
        """Until cancelled (the notifier's stop)."""
        self._tasks = TaskSet("mns topic feeds")
        try:
            while True:
                try:
                    await self._refresh()
                except StorageError as e:
                    log.debug("mns: topic feeds not refreshed: %s", e)
                await asyncio.sleep(_REFRESH_S)
        finally:
            self._running.clear()
            await self._tasks.close()

    async def _refresh(self) -> None:
        assert self._tasks is not None
        processor = self._topics.processor
        wanted: set[tuple[str, str]] = set()
        for namespace in await processor.list_namespaces(self._notifier.caller("default")):
            caller = self._notifier.caller(namespace)
            for subscription in await processor.meta_list(caller, SUBSCRIPTION_KIND):
                wanted.add((namespace, subscription.partition("/")[0]))
        for gone in [k for k in self._running if k not in wanted]:
            self._running.pop(gone).cancel()
        for new in wanted - self._running.keys():
            self._running[new] = self._tasks.spawn(self._feed(*new))

    async def _feed(self, namespace: str, topic: str) -> None:
        processor, caller = self._topics.processor, self._notifier.caller(namespace)
        group = feed_group(topic)
        try:
            await processor.set_group_config(caller, group, _CONFIG)
            refs: tuple[QueueRef, ...] = ()
            while True:
                try:
                    if not refs:
                        info = await processor.describe_topic(caller, topic)
                        refs = tuple(QueueRef(namespace, topic, i) for i in range(len(info.queues)))
                    popped = await processor.pop(
                        caller,
                        group,
                        refs,
                        max_messages=_POP_MAX,
                        invisible_ms=_INVISIBLE_MS,
                        wait_ms=_WAIT_MS,
                    )
                    if not popped:
                        refs = ()  # look at the queue count again
                        continue
                    await self._topics.forward(caller, topic, popped)
                    await processor.ack_many(caller, group, [m.receipt or "" for m in popped])
                except TopicNotFound:
                    refs = ()
                    await asyncio.sleep(_RETRY_S)
                except StorageError as e:
                    log.debug("mns: feed of topic %s waits: %s", topic, e)
                    refs = ()
                    await asyncio.sleep(_RETRY_S)
        finally:
            if self._running.get((namespace, topic)) is asyncio.current_task():
                del self._running[(namespace, topic)]
