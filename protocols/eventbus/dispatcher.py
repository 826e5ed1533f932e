"""Delivery: each bus's events (its storage topic, and its source topics) to the
targets of the rules they match, at least once.

Every gateway serving HTTP runs one dispatcher per (namespace, bus), found and
dropped as buses come and go (looked at every :data:`REFRESH_S`, as the MNS topic
feeds are). A dispatcher pops the bus's topic and its source topics with the bus's
own group (:func:`dispatch_group`): the group is shared by all gateways, so each event
is handled by one of them, and storage tracks it like any other consumer's message.
An event is acked only once every target of every matching rule accepted it (an HTTP
target that gave up counts when the rule's dead-letter target took it); anything
else gives it back (:data:`RETRY_DELAY_MS`), and a gateway that dies holding it lets
it become visible again after :data:`INVISIBLE_MS`. A long delivery keeps it
invisible by renewing (:data:`RENEW_S`). So a target may see an event twice, never
zero times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import httpx

from polymq.gateway.accounts import Principal
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.eventbus.cloudevent import STRUCTURED_TYPE, CloudEvent, EventError
from polymq.protocols.eventbus.mapping import event_to_message, message_to_event
from polymq.protocols.eventbus.model import Bus, Rule, Target, bus_topic
from polymq.protocols.eventbus.rule_index import RuleIndex
from polymq.protocols.eventbus.store import BUS_KIND, BusStore
from polymq.storage.errors import StorageClosed, StorageError, TopicNotFound
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import AppendRequest, GroupConfig, QueueRef, StoredMessage

__all__ = ["Dispatchers", "dispatch_group"]

log = logging.getLogger(__name__)

REFRESH_S: Final = 1.0
POP_MAX: Final = 64
INVISIBLE_MS: Final = 30_000
RENEW_S: Final = 10.0
WAIT_MS: Final = 1_000
RETRY_DELAY_MS: Final = 1_000
POST_TIMEOUT_S: Final = 5.0
_GROUP: Final = GroupConfig(max_delivery_attempts=None, dead_letter=False)
# Internal identity of the dispatchers: they act in each bus's namespace.
_DISPATCHER: Final = Principal(
    name="eventbus", namespaces=frozenset(), default_namespace="default", admin=True
)


def dispatch_group(bus: str) -> str:
    """The consumer group a bus's dispatchers share ("/" is in no bus name)."""
    return f"eventbus.dispatch/{bus}"


def dispatcher_caller(namespace: str) -> Caller:
    return Caller(principal=_DISPATCHER, namespace=namespace, protocol="eventbus")


@dataclass(slots=True)
class _Held:
    """A popped message and its latest receipt (renewals replace it)."""

    stored: StoredMessage
    receipt: str
    done: bool = field(default=False)


class Dispatchers:
    """Runs the dispatchers of every bus of every namespace, until cancelled."""

    def __init__(self, store: BusStore) -> None:
        self._store = store
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._client: httpx.AsyncClient | None = None

    async def run(self) -> None:
        tasks = TaskSet("eventbus dispatchers")
        self._client = httpx.AsyncClient(timeout=POST_TIMEOUT_S)
        try:
            while True:
                try:
                    await self._refresh(tasks)
                except StorageError as e:
                    log.debug("eventbus: dispatchers not refreshed: %s", e)
                await asyncio.sleep(REFRESH_S)
        finally:
            self._running.clear()
            await tasks.close()
            await self._client.aclose()

    async def _refresh(self, tasks: TaskSet) -> None:
        processor = self._store.processor
        wanted: set[tuple[str, str]] = set()
        for namespace in await processor.list_namespaces(dispatcher_caller("default")):
            for bus in await processor.meta_list(dispatcher_caller(namespace), BUS_KIND):
                wanted.add((namespace, bus))
        for gone in [k for k in self._running if k not in wanted]:
            self._running.pop(gone).cancel()
        for namespace, bus in wanted - self._running.keys():
            assert self._client is not None
            dispatcher = _BusDispatcher(self._store, namespace, bus, self._client)
            self._running[(namespace, bus)] = tasks.spawn(dispatcher.run())


class _BusDispatcher:
    def __init__(
        self, store: BusStore, namespace: str, bus: str, client: httpx.AsyncClient
    ) -> None:
        self._store = store
        self._processor: Processor = store.processor
        self._caller = dispatcher_caller(namespace)
        self._namespace = namespace
        self._bus = bus
        self._group = dispatch_group(bus)
        self._client = client
        self._index: RuleIndex[Rule] = RuleIndex([])
        self._refs: tuple[QueueRef, ...] = ()
        self._loaded_at = float("-inf")
        self._loaded_ms = 0  # the storage clock when the rules in use were read

    async def run(self) -> None:
        await self._processor.set_group_config(self._caller, self._group, _GROUP)
        while True:
            try:
                if time.monotonic() - self._loaded_at >= REFRESH_S:
                    await self._load()
                if not self._refs:
                    await asyncio.sleep(REFRESH_S)
                    continue
                popped = await self._processor.pop(
                    self._caller,
                    self._group,
                    self._refs,
                    max_messages=POP_MAX,
                    invisible_ms=INVISIBLE_MS,
                    wait_ms=WAIT_MS,
                )
                if popped:
                    if max(m.store_timestamp_ms for m in popped) >= self._loaded_ms:
                        # Stored after the rules were read: a rule made just before
                        # the event must see it.
                        await self._load()
                    await self._handle_all([_Held(m, m.receipt or "") for m in popped])
            except TopicNotFound:
                self._loaded_at = float("-inf")
                await asyncio.sleep(REFRESH_S)
            except StorageClosed:
                return
            except StorageError as e:
                log.debug("eventbus %s/%s waits: %s", self._namespace, self._bus, e)
                self._loaded_at = float("-inf")
                await asyncio.sleep(REFRESH_S)
            except Exception:  # our bug: what was popped is given back; go on
                log.exception("eventbus %s/%s: dispatch failed", self._namespace, self._bus)
                self._loaded_at = float("-inf")
                await asyncio.sleep(REFRESH_S)

    async def _load(self) -> None:
        """The bus's rules (indexed) and the queues to pop, read again every
        :data:`REFRESH_S`: rules changed on any gateway apply within it."""
        loading_ms = self._processor.clock.now_ms()
        raw = await self._processor.meta_get(self._caller, BUS_KIND, self._bus)
        if raw is None:
            self._refs = ()
            return
        bus = Bus.parse(self._bus, raw)
        rules = await self._store.rules(self._caller, self._bus)
        self._index = RuleIndex((rule.pattern, rule) for rule in rules)
        refs: list[QueueRef] = []
        for topic in (bus_topic(bus.name), *bus.sources):
            try:
                info = await self._processor.describe_topic(self._caller, topic)
            except TopicNotFound:
                continue  # a source not created yet
            refs.extend(QueueRef(self._namespace, topic, i) for i in range(len(info.queues)))
        self._refs = tuple(refs)
        self._loaded_at = time.monotonic()
        self._loaded_ms = loading_ms

    async def _handle_all(self, held: Sequence[_Held]) -> None:
        renewer = asyncio.create_task(self._renew(held))
        try:
            outcomes = await asyncio.gather(
                *(self._handle(h) for h in held), return_exceptions=True
            )
            for h, outcome in zip(held, outcomes, strict=True):
                if isinstance(outcome, StorageError):
                    log.info("eventbus %s/%s: %s", self._namespace, self._bus, outcome)
                elif isinstance(outcome, BaseException):  # our bug: log it, go on
                    log.error(
                        "eventbus %s/%s: event %s failed",
                        self._namespace,
                        self._bus,
                        h.stored.message_id,
                        exc_info=outcome,
                    )
        finally:
            renewer.cancel()
            # What is not done (stopping, or a failure above) is given back at once,
            # so another gateway (or this one restarted) takes it without waiting.
            for h in held:
                if not h.done:
                    with contextlib.suppress(StorageError, asyncio.CancelledError):
                        await asyncio.shield(
                            self._processor.nack(self._caller, self._group, h.receipt)
                        )

    async def _renew(self, held: Sequence[_Held]) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            for h in held:
                if h.done:
                    continue
                try:
                    renewed = await self._processor.change_invisibility(
                        self._caller, self._group, h.receipt, INVISIBLE_MS
                    )
                except StorageError as e:
                    log.info("eventbus: could not keep event invisible: %s", e)
                    continue
                if not h.done and renewed.receipt is not None:
                    h.receipt = renewed.receipt

    async def _handle(self, held: _Held) -> None:
        try:
            event = message_to_event(held.stored)
        except EventError as e:
            log.warning(
                "eventbus %s/%s: message %s is not a valid CloudEvent, dropped: %s",
                self._namespace,
                self._bus,
                held.stored.message_id,
                e,
            )
            await self._ack(held)
            return
        rules = self._index.match(event.view())
        results = await asyncio.gather(
            *(self._deliver(rule, target, event) for rule in rules for target in rule.targets)
        )
        if all(results):
            await self._ack(held)
        else:
            held.done = True
            await self._processor.nack(
                self._caller, self._group, held.receipt, delay_ms=RETRY_DELAY_MS
            )

    async def _ack(self, held: _Held) -> None:
        held.done = True
        await self._processor.ack(self._caller, self._group, held.receipt)

    async def _deliver(self, rule: Rule, target: Target, event: CloudEvent) -> bool:
        """Whether the target took the event (or, for an HTTP target that gave up,
        the rule's dead-letter target did; or there is none and it was dropped)."""
        out = _transformed(event, target)
        if target.type != "http":
            return await self._append(target, out)
        error = await self._post(target, out)
        if error is None:
            return True
        if rule.dead_letter is None:
            log.warning(
                "eventbus %s/%s rule %s: target %s gave up on event %s (%s); no dead-letter "
                "target, dropped",
                self._namespace,
                self._bus,
                rule.name,
                target.id,
                event.id,
                error,
            )
            return True
        dead = CloudEvent(
            attributes={
                **event.attributes,
                "deadletterrule": rule.name,
                "deadlettertarget": target.id,
                "deadletterreason": error[:200],
            },
            data=event.data,
            data_json=event.data_json,
            has_json=event.has_json,
        )
        return await self._append(rule.dead_letter, dead)

    async def _append(self, target: Target, event: CloudEvent) -> bool:
        assert target.name is not None
        request = AppendRequest(
            entry=event_to_message(event), queues=(QueueRef(self._namespace, target.name),)
        )
        try:
            await self._processor.append(self._caller, [request])
        except StorageError as e:
            log.info("eventbus: target %s (%s) refused: %s", target.id, target.name, e)
            return False
        return True

    async def _post(self, target: Target, event: CloudEvent) -> str | None:
        """POST with the target's retries; ``None`` once accepted (2xx), else why not."""
        assert target.endpoint is not None
        content, headers = _http_request(event, target.mode)
        error = "not tried"
        for attempt in range(1, target.retry.maximum_attempts + 1):
            if attempt > 1:
                await asyncio.sleep(target.retry.delay_ms(attempt - 1) / 1000)
            try:
                response = await self._client.post(
                    target.endpoint, content=content, headers=headers
                )
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
                continue
            if 200 <= response.status_code < 300:
                return None
            error = f"HTTP {response.status_code}"
        return error


def _transformed(event: CloudEvent, target: Target) -> CloudEvent:
    if target.input is None:
        return event
    data, content_type = target.input.apply(event.to_json())
    attributes = {**event.attributes, "datacontenttype": content_type}
    if content_type != "application/json":
        return CloudEvent(attributes=attributes, data=data)
    return CloudEvent(attributes=attributes, data=data, data_json=json.loads(data), has_json=True)


def _http_request(event: CloudEvent, mode: str) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a webhook POST (http-protocol-binding.md 3.1, 3.2)."""
    if mode == "structured":
        body = json.dumps(event.to_json(), separators=(",", ":"), ensure_ascii=False).encode()
        return body, {"content-type": f"{STRUCTURED_TYPE}; charset=utf-8"}
    headers = {}
    for name, value in event.attributes.items():
        if name == "datacontenttype":
            headers["content-type"] = str(value)
            continue
        text = "true" if value is True else "false" if value is False else str(value)
        # 3.1.3.2: percent-encode what a header value cannot carry, and '%' itself.
        headers[f"ce-{name}"] = urllib.parse.quote(text, safe=" !#$&'()*+,/:;=?@[]^_`{|}~-.")
    return event.data or b"", headers
