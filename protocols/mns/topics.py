"""MNS topics and subscriptions over the processor.

A topic is a storage topic of one queue (so other protocols can read what was
published), with attributes in the metadata store (kind ``mns.topic``) and its
subscriptions beside them (kind ``mns.subscription``, named ``topic/subscription``).
PublishMessage is ONE append dispatched into the topic's own queue, every subscribed
queue whose filter tag matches, and the delivery queue of every matching HTTP
subscription: the body is stored once however many subscribers there are.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mns.attributes import SubscriptionAttributes, TopicAttributes
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import Outgoing, notification_body, parse_message
from polymq.protocols.mns.notify import Notifier, push_group, push_topic
from polymq.protocols.mns.queues import QUEUE_KIND, TOPIC_KIND, check_name
from polymq.storage.errors import QueueNotFound, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import (
    UNLIMITED,
    AppendRequest,
    AppendResult,
    GroupConfig,
    QueueRef,
    StoredMessage,
    TopicConfig,
)

__all__ = ["PUBLISHED_TO", "SUBSCRIPTION_KIND", "TopicService"]

SUBSCRIPTION_KIND = "mns.subscription"
# The property marking an MNS PublishMessage (private: no consumer sees it).
PUBLISHED_TO = "mns.published-to"


def _key(topic: str, subscription: str) -> str:
    return f"{topic}/{subscription}"


class TopicService:
    def __init__(self, processor: Processor, notifier: Notifier, *, max_message_bytes: int) -> None:
        self._processor = processor
        self._notifier = notifier
        self._max_message_bytes = max_message_bytes

    @property
    def processor(self) -> Processor:
        return self._processor

    def _now(self) -> int:
        return self._processor.clock.now_ms()

    async def attributes(self, caller: Caller, name: str) -> TopicAttributes:
        raw = await self._processor.meta_get(caller, TOPIC_KIND, name)
        if raw is None:
            raise MnsError.topic_not_exist(name)
        return TopicAttributes.from_json(raw)

    async def create(self, caller: Caller, name: str, document: Any) -> bool:
        check_name("topic", name)
        now = self._now()
        attrs = TopicAttributes(create_time=now, last_modify_time=now).updated(document)
        existing = await self._processor.meta_get(caller, TOPIC_KIND, name)
        if existing is not None:
            old = TopicAttributes.from_json(existing)
            if replace(old, create_time=now, last_modify_time=now) == attrs:
                return False
            raise MnsError("TopicAlreadyExist", f"The topic {name} already exists.", 409)
        if await self._processor.meta_get(caller, QUEUE_KIND, name) is not None:
            raise MnsError("TopicAlreadyExist", f"A queue is named {name} already.", 409)
        try:
            await self._processor.create_topic(caller, name, attrs.topic_config)
        except TopicAlreadyExists:  # a topic half-created before a crash
            await self._set_retention(caller, name, attrs)
        await self._processor.meta_put(caller, TOPIC_KIND, name, attrs.to_json())
        return True

    async def set_attributes(self, caller: Caller, name: str, document: Any) -> None:
        old = await self.attributes(caller, name)
        new = replace(old.updated(document), last_modify_time=self._now())
        if new.message_retention_period != old.message_retention_period:
            await self._set_retention(caller, name, new)
        await self._processor.meta_put(caller, TOPIC_KIND, name, new.to_json())

    async def _set_retention(self, caller: Caller, name: str, attrs: TopicAttributes) -> None:
        info = await self._processor.describe_topic(caller, name)
        config = replace(info.config, retention_ms=attrs.topic_config.retention_ms)
        await self._processor.alter_topic(caller, name, config)

    async def message_count(self, caller: Caller, name: str) -> int:
        offsets = await self._processor.queue_offsets(caller, QueueRef(caller.namespace, name))
        return offsets.latest - offsets.earliest

    async def delete(self, caller: Caller, name: str) -> None:
        for sub in await self.subscriptions(caller, name):
            await self.unsubscribe(caller, name, sub)
        await self._processor.meta_delete(caller, TOPIC_KIND, name)
        with contextlib.suppress(TopicNotFound):
            await self._processor.delete_topic(caller, name)

    async def names(self, caller: Caller) -> list[str]:
        return sorted(await self._processor.meta_list(caller, TOPIC_KIND))

    # -- subscriptions ---------------------------------------------------------------

    async def subscription(self, caller: Caller, topic: str, name: str) -> SubscriptionAttributes:
        raw = await self._processor.meta_get(caller, SUBSCRIPTION_KIND, _key(topic, name))
        if raw is None:
            raise MnsError.subscription_not_exist(name)
        return SubscriptionAttributes.from_json(raw)

    async def subscriptions(self, caller: Caller, topic: str) -> list[str]:
        await self.attributes(caller, topic)
        prefix = f"{topic}/"
        return sorted(
            key[len(prefix) :]
            for key in await self._processor.meta_list(caller, SUBSCRIPTION_KIND)
            if key.startswith(prefix)
        )

    async def subscribe(self, caller: Caller, topic: str, name: str, document: Any) -> bool:
        check_name("subscription", name)
        await self.attributes(caller, topic)
        attrs = SubscriptionAttributes.parse(document, now_ms=self._now())
        raw = await self._processor.meta_get(caller, SUBSCRIPTION_KIND, _key(topic, name))
        if raw is not None:
            old = SubscriptionAttributes.from_json(raw)
            same = replace(attrs, create_time=0, last_modify_time=0) == replace(
                old, create_time=0, last_modify_time=0
            )
            if same:
                return False
            raise MnsError(
                "SubscriptionAlreadyExist", f"The subscription {name} already exists.", 409
            )
        if attrs.queue is not None:
            if await self._processor.meta_get(caller, QUEUE_KIND, attrs.queue) is None:
                raise MnsError.queue_not_exist(attrs.queue)
        else:
            with contextlib.suppress(TopicAlreadyExists):
                await self._processor.create_topic(
                    caller,
                    push_topic(topic, name),
                    TopicConfig(queue_count=1, retention_ms=UNLIMITED),
                )
            # The notifier's strategy decides when to give up, not an attempt limit.
            await self._processor.set_group_config(
                caller, push_group(topic, name), GroupConfig(max_delivery_attempts=None)
            )
        await self._processor.meta_put(
            caller, SUBSCRIPTION_KIND, _key(topic, name), attrs.to_json()
        )
        if attrs.queue is None:
            self._notifier.watch(caller.namespace, topic, name, attrs)
        return True

    async def set_subscription(self, caller: Caller, topic: str, name: str, document: Any) -> None:
        old = await self.subscription(caller, topic, name)
        new = old.updated(document, now_ms=self._now())
        await self._processor.meta_put(caller, SUBSCRIPTION_KIND, _key(topic, name), new.to_json())
        if new.queue is None:
            self._notifier.watch(caller.namespace, topic, name, new)

    async def unsubscribe(self, caller: Caller, topic: str, name: str) -> None:
        raw = await self._processor.meta_get(caller, SUBSCRIPTION_KIND, _key(topic, name))
        await self._processor.meta_delete(caller, SUBSCRIPTION_KIND, _key(topic, name))
        if raw is not None and SubscriptionAttributes.from_json(raw).queue is None:
            await self._notifier.unwatch(caller.namespace, topic, name)
            with contextlib.suppress(TopicNotFound):
                await self._processor.delete_topic(caller, push_topic(topic, name))

    async def http_subscriptions(self) -> list[tuple[str, str, str, SubscriptionAttributes]]:
        """Every HTTP subscription of every namespace, for the notifier at start-up."""
        found: list[tuple[str, str, str, SubscriptionAttributes]] = []
        for namespace in await self._processor.list_namespaces(self._notifier.caller("default")):
            caller = self._notifier.caller(namespace)
            for key, raw in (await self._processor.meta_list(caller, SUBSCRIPTION_KIND)).items():
                attrs = SubscriptionAttributes.from_json(raw)
                if attrs.queue is None:
                    topic, _, name = key.partition("/")
                    found.append((namespace, topic, name, attrs))
        return found

    # -- publishing --------------------------------------------------------------------

    async def publish(
        self, caller: Caller, topic: str, document: Any
    ) -> tuple[Outgoing, AppendResult]:
        attrs = await self.attributes(caller, topic)
        outgoing = parse_message(
            document,
            now_ms=self._now(),
            default_delay_s=0,
            max_body_bytes=min(attrs.maximum_message_size, self._max_message_bytes),
            retention_s=None,
            allow_delay=False,
        )
        # Marked as an MNS publish: the topic's feed leaves it to this dispatch.
        message = replace(
            outgoing.message,
            properties=(*outgoing.message.properties, (PUBLISHED_TO, topic.encode())),
        )
        outgoing = replace(outgoing, message=message)
        own = QueueRef(caller.namespace, topic)
        subs = await self.subscribed(caller, topic)
        direct, formatted = self._targets(caller, topic, subs, message.tag, None)
        targets = [own, *direct]
        request = AppendRequest(entry=message, queues=tuple(dict.fromkeys(targets)))
        results = await self._append_alive(caller, [request])
        if not results:  # the topic itself was deleted meanwhile
            raise MnsError.topic_not_exist(topic)
        result = results[0]
        if formatted:
            stored = StoredMessage(
                message=outgoing.message,
                queue=own,
                offset=0,
                message_id=result.message_id,
                store_timestamp_ms=result.store_timestamp_ms,
            )
            await self._append_alive(
                caller,
                [self._notification(caller, topic, name, sub, stored) for name, sub in formatted],
            )
        return outgoing, result

    async def subscribed(
        self, caller: Caller, topic: str
    ) -> list[tuple[str, SubscriptionAttributes]]:
        """The topic's subscriptions: (name, attributes)."""
        prefix = f"{topic}/"
        return [
            (key[len(prefix) :], SubscriptionAttributes.from_json(raw))
            for key, raw in (await self._processor.meta_list(caller, SUBSCRIPTION_KIND)).items()
            if key.startswith(prefix)
        ]

    @staticmethod
    def _targets(
        caller: Caller,
        topic: str,
        subs: list[tuple[str, SubscriptionAttributes]],
        tag: str | None,
        stored_ms: int | None,
    ) -> tuple[list[QueueRef], list[tuple[str, SubscriptionAttributes]]]:
        """Where a message goes: the queues taking it as it is (SIMPLIFIED queue
        subscriptions, HTTP subscriptions' delivery queues), and the subscriptions
        getting a formatted copy. ``stored_ms``: a message stored then by another
        protocol reaches only the subscriptions made by then."""
        direct: list[QueueRef] = []
        formatted: list[tuple[str, SubscriptionAttributes]] = []
        for name, sub in subs:
            if not sub.accepts(tag):
                continue
            if stored_ms is not None and sub.create_time > stored_ms:
                continue
            if sub.queue is not None and sub.notify_content_format != "SIMPLIFIED":
                formatted.append((name, sub))  # its body differs: a copy of its own
            else:
                direct.append(QueueRef(caller.namespace, sub.queue or push_topic(topic, name)))
        return direct, formatted

    async def forward(self, caller: Caller, topic: str, popped: list[StoredMessage]) -> None:
        """What other protocols stored in ``topic`` (read by the topic's feed,
        :mod:`protocols.mns.topic_feed`) to its subscriptions, as a publish would
        dispatch it; MNS's own publishes were dispatched when published."""
        subs = await self.subscribed(caller, topic)
        if not subs:
            return
        requests: list[AppendRequest] = []
        for stored in popped:
            if stored.message.property(PUBLISHED_TO) is not None:
                continue
            direct, formatted = self._targets(
                caller, topic, subs, stored.message.tag, stored.store_timestamp_ms
            )
            if direct:
                requests.append(
                    AppendRequest(entry=stored.message, queues=tuple(dict.fromkeys(direct)))
                )
            requests.extend(
                self._notification(caller, topic, name, sub, stored) for name, sub in formatted
            )
        if requests:
            await self._append_alive(caller, requests, metered=False)

    @staticmethod
    def _notification(
        caller: Caller, topic: str, name: str, sub: SubscriptionAttributes, stored: StoredMessage
    ) -> AppendRequest:
        """The copy an XML- or JSON-format queue subscription gets: the published
        message with the ``<Notification>`` document (naming its MessageId) as body."""
        body, content_type = notification_body(
            stored,
            sub.notify_content_format,
            topic_owner=caller.namespace,
            topic=topic,
            subscription=name,
        )
        assert sub.queue is not None
        copy = replace(stored.message, body=body, content_type=content_type)
        return AppendRequest(entry=copy, queues=(QueueRef(caller.namespace, sub.queue),))

    async def _append_alive(
        self, caller: Caller, requests: list[AppendRequest], *, metered: bool = True
    ) -> list[AppendResult]:
        """Append; if a subscribed queue was deleted meanwhile, deliver to those left."""
        try:
            return await self._processor.append(caller, requests, metered=metered)
        except (TopicNotFound, QueueNotFound):
            pass
        alive: dict[str, bool] = {}
        kept: list[AppendRequest] = []
        for request in requests:
            queues = []
            for ref in request.queues:
                if ref.topic not in alive:
                    try:
                        await self._processor.describe_topic(caller, ref.topic)
                        alive[ref.topic] = True
                    except TopicNotFound:
                        alive[ref.topic] = False
                if alive[ref.topic]:
                    queues.append(ref)
            if queues:
                kept.append(replace(request, queues=tuple(queues)))
        return await self._processor.append(caller, kept, metered=metered) if kept else []
