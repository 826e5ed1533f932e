"""Delivery of topic messages to HTTP endpoints, with MNS's retry strategies.

Each HTTP subscription has a storage queue of its own (the publish dispatches into it)
consumed in pop mode by one background task: a message is POSTed, acked on a 2xx, and
on failure given back with the strategy's delay, until the strategy gives up. One
task per subscription, one message in flight per task, so a slow endpoint holds up
only its own subscription and the number of open requests stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from polymq.gateway.accounts import Principal
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mns.attributes import SubscriptionAttributes
from polymq.protocols.mns.messages import notification_body
from polymq.storage.errors import StorageClosed, StorageUnavailable, TopicNotFound
from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["Notifier", "push_group", "push_topic", "retry_delay_ms"]

log = logging.getLogger(__name__)

# Internal identity of the delivery tasks: they act in the subscription's namespace.
_PUSHER = Principal(
    name="mns-notifier", namespaces=frozenset(), default_namespace="default", admin=True
)
_POP_WAIT_MS = 5_000
_INVISIBLE_MS = 60_000
_POST_TIMEOUT_S = 5.0
_BACKOFF_RETRIES = 3
_DECAY_RETRIES = 176
_DECAY_MAX_GAP_S = 512


def push_topic(topic: str, subscription: str) -> str:
    """The storage topic holding an HTTP subscription's undelivered messages."""
    return f"%MNS-PUSH%{topic}/{subscription}"


def push_group(topic: str, subscription: str) -> str:
    return f"mns.push.{topic}/{subscription}"


def retry_delay_ms(
    strategy: str, attempt: int, *, unit_ms: int, rng: Callable[[], float] = random.random
) -> int | None:
    """How long after failed delivery ``attempt`` (1 = the first try) to try again;
    ``None`` once the strategy gives up. BACKOFF_RETRY: 3 retries 10 to 20 s apart;
    EXPONENTIAL_DECAY_RETRY: 176 retries, the gap doubling from 2 s up to 512 s
    (NOTES.md, MNS "NotifyStrategy"). ``unit_ms`` is one second (tests shrink it)."""
    if strategy == "EXPONENTIAL_DECAY_RETRY":
        if attempt > _DECAY_RETRIES:
            return None
        return int(min(2**attempt, _DECAY_MAX_GAP_S)) * unit_ms
    if attempt > _BACKOFF_RETRIES:
        return None
    return int((10 + 10 * rng()) * unit_ms)


@dataclass(slots=True)
class _Subscription:
    namespace: str
    topic: str
    name: str
    attrs: SubscriptionAttributes
    task: asyncio.Task[None] | None = None


class Notifier:
    def __init__(self, processor: Processor, *, retry_unit_ms: int = 1000) -> None:
        self._processor = processor
        self._retry_unit_ms = retry_unit_ms
        self._subscriptions: dict[tuple[str, str, str], _Subscription] = {}
        self._client: httpx.AsyncClient | None = None
        self._companions: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._companion_tasks: list[asyncio.Task[None]] = []

    def also_run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Background work with the notifier's lifetime (the topic feeds): started by
        :meth:`start`, cancelled by :meth:`stop`."""
        self._companions.append(work)

    def caller(self, namespace: str) -> Caller:
        return Caller(principal=_PUSHER, namespace=namespace, protocol="http")

    async def start(
        self, subscriptions: list[tuple[str, str, str, SubscriptionAttributes]]
    ) -> None:
        self._client = httpx.AsyncClient(timeout=_POST_TIMEOUT_S)
        for namespace, topic, name, attrs in subscriptions:
            self.watch(namespace, topic, name, attrs)
        for sub in self._subscriptions.values():  # subscribed while we were starting
            if sub.task is None:
                sub.task = self._spawn(sub)
        self._companion_tasks = [asyncio.create_task(work()) for work in self._companions]

    async def start_from(
        self, load: Callable[[], Awaitable[list[tuple[str, str, str, SubscriptionAttributes]]]]
    ) -> None:
        """:meth:`start` with the subscriptions ``load`` finds. Storage that does not
        answer yet (a gateway started before any storage node) starts it with none,
        and they are loaded in the background once it answers: the gateway serves
        meanwhile instead of failing its start."""
        try:
            found = await load()
        except StorageUnavailable as exc:
            log.warning("mns push: subscriptions loaded once storage answers (%s)", exc)
            found = []
            self.also_run(lambda: self._load_later(load))
        await self.start(found)

    async def _load_later(
        self, load: Callable[[], Awaitable[list[tuple[str, str, str, SubscriptionAttributes]]]]
    ) -> None:
        delay_s = 0.1
        while True:
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)
            try:
                found = await load()
            except StorageUnavailable:
                continue
            for namespace, topic, name, attrs in found:
                self.watch(namespace, topic, name, attrs)
            return

    async def stop(self) -> None:
        tasks = [s.task for s in self._subscriptions.values() if s.task is not None]
        tasks += self._companion_tasks
        self._companion_tasks = []
        self._subscriptions.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def watch(self, namespace: str, topic: str, name: str, attrs: SubscriptionAttributes) -> None:
        """Start delivering an HTTP subscription, or take its changed attributes."""
        key = (namespace, topic, name)
        current = self._subscriptions.get(key)
        if current is not None:
            current.attrs = attrs
            return
        sub = _Subscription(namespace, topic, name, attrs)
        self._subscriptions[key] = sub
        if self._client is not None:
            sub.task = self._spawn(sub)

    def _spawn(self, sub: _Subscription) -> asyncio.Task[None]:
        name = f"mns-push {sub.namespace}/{sub.topic}/{sub.name}"
        return asyncio.create_task(self._deliver(sub), name=name)

    async def unwatch(self, namespace: str, topic: str, name: str) -> None:
        sub = self._subscriptions.pop((namespace, topic, name), None)
        if sub is not None and sub.task is not None:
            sub.task.cancel()
            await asyncio.gather(sub.task, return_exceptions=True)

    async def _deliver(self, sub: _Subscription) -> None:
        caller = self.caller(sub.namespace)
        ref = QueueRef(sub.namespace, push_topic(sub.topic, sub.name))
        group = push_group(sub.topic, sub.name)
        while True:
            try:
                messages = await self._processor.pop(
                    caller,
                    group,
                    [ref],
                    max_messages=1,
                    invisible_ms=_INVISIBLE_MS,
                    wait_ms=_POP_WAIT_MS,
                )
                for stored in messages:
                    await self._deliver_one(sub, caller, group, stored)
            except (TopicNotFound, StorageClosed):
                return  # unsubscribed or shutting down
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("mns push to %s failed; retrying", sub.attrs.endpoint)
                await asyncio.sleep(1.0)

    async def _deliver_one(
        self, sub: _Subscription, caller: Caller, group: str, stored: StoredMessage
    ) -> None:
        assert stored.receipt is not None
        if await self._post(sub, stored):
            await self._processor.ack(caller, group, stored.receipt)
            return
        delay = retry_delay_ms(
            sub.attrs.notify_strategy, stored.delivery_attempt, unit_ms=self._retry_unit_ms
        )
        if delay is None:
            log.warning(
                "mns push: %s gave up on message %s after %d attempts",
                sub.attrs.endpoint,
                stored.message_id,
                stored.delivery_attempt,
            )
            await self._processor.ack(caller, group, stored.receipt)
        else:
            await self._processor.nack(caller, group, stored.receipt, delay_ms=delay)

    async def _post(self, sub: _Subscription, stored: StoredMessage) -> bool:
        assert self._client is not None
        content, content_type = notification_body(
            stored,
            sub.attrs.notify_content_format,
            topic_owner=sub.namespace,
            topic=sub.topic,
            subscription=sub.name,
        )
        headers = {
            "x-mns-request-id": uuid.uuid4().hex.upper(),
            "x-mns-version": "2015-06-06",
            "content-type": content_type,
        }
        try:
            response = await self._client.post(sub.attrs.endpoint, content=content, headers=headers)
        except httpx.HTTPError as e:
            log.info("mns push to %s failed: %s", sub.attrs.endpoint, e)
            return False
        return 200 <= response.status_code < 300
