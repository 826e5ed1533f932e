"""MNS queues over the processor.

An MNS queue is a storage topic of one queue with unlimited retention (messages stay
until deleted), consumed in pop mode by one fixed group per queue: ReceiveMessage is a
pop with the queue's visibility timeout, the receipt handle is the storage receipt,
DeleteMessage an ack. The same storage topic is what Kafka, AMQP or RocketMQ clients
see under the queue's name, so messages interoperate. Queue attributes live in the
metadata store (kind ``mns.queue``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from polymq.gateway.fairness import cooperatively
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mns.attributes import QueueAttributes
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import Outgoing, parse_message
from polymq.protocols.mns.priority import (
    DEFAULT_PRIORITY,
    LEVELS,
    levels_of,
    priority_of,
    queue_id_for,
    refs_in_pop_order,
)
from polymq.protocols.mns.reclaim import RECLAIM_EVERY, Reclaimer
from polymq.storage.errors import StorageError, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import (
    UNLIMITED,
    AppendRequest,
    AppendResult,
    GroupConfig,
    QueueRef,
    StoredMessage,
    TopicConfig,
)

__all__ = [
    "QUEUE_KIND",
    "TOPIC_KIND",
    "QueueCounts",
    "QueueService",
    "Sent",
    "check_name",
    "group_of",
    "queue_counts",
    "storage_queues",
]

QUEUE_KIND = "mns.queue"
TOPIC_KIND = "mns.topic"
# MNS: a letter or digit first, then letters, digits and hyphens, up to 256 characters;
# we also take ``_`` and ``.`` so that Kafka and RocketMQ topic names can be queues.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}")
_MAX_BATCH = 16
DEDUP_PREFIX = "mns:"
_ATTRIBUTES_CACHED = 10_000  # parsed queue attributes kept (a bound, not a tuning knob)


def group_of(queue: str) -> str:
    """The pop group that consumes an MNS queue."""
    return f"mns.{queue}"


def check_name(kind: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        code = "InvalidQueueName" if kind == "queue" else "InvalidTopicName"
        raise MnsError(code, f"The {kind} name {name[:60]!r} is invalid.", 400)
    return name


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """Active: visible now; inactive: received and not yet deleted."""

    active: int
    inactive: int
    delayed: int


def _group_config(attrs: QueueAttributes) -> GroupConfig:
    """Storage never dead-letters for an MNS queue: the receive does (see
    :meth:`Queues._divert_dead`), so the target queue may be on any storage node."""
    return GroupConfig(max_delivery_attempts=None, fifo=attrs.fifo, dead_letter=False)


async def storage_queues(processor: Processor, caller: Caller, name: str) -> tuple[QueueRef, ...]:
    """The storage queues of an MNS queue, highest priority first."""
    info = await processor.describe_topic(caller, name)
    return refs_in_pop_order(caller.namespace, name, levels_of(info))


async def queue_counts(processor: Processor, caller: Caller, name: str) -> QueueCounts:
    """An MNS queue's counts summed over its priority levels: for GetQueueAttributes,
    admin and metrics."""
    active = inactive = delayed = 0
    for ref in await storage_queues(processor, caller, name):
        pending = await processor.pending_count(caller, group_of(name), ref)
        inflight = await processor.inflight_count(caller, group_of(name), ref)
        active += max(0, pending - inflight)
        inactive += inflight
        delayed += await processor.delayed_count(caller, ref)
    return QueueCounts(active=active, inactive=inactive, delayed=delayed)


Sent = tuple[Outgoing, AppendResult]


class QueueService:
    def __init__(
        self, processor: Processor, *, max_message_bytes: int, reclaim_every: int = RECLAIM_EVERY
    ) -> None:
        self._processor = processor
        self._max_message_bytes = max_message_bytes
        self._reclaimer = Reclaimer(processor, every=reclaim_every)
        self._attributes: dict[tuple[str, str], tuple[Any, QueueAttributes]] = {}
        # The long polls on an unprioritised queue's one storage queue, cancelled when
        # it grows its levels: they start over on all of them.
        self._growth: dict[tuple[str, str], set[asyncio.Future[list[StoredMessage]]]] = {}

    def _now(self) -> int:
        return self._processor.clock.now_ms()

    @property
    def processor(self) -> Processor:
        return self._processor

    def _parsed(self, namespace: str, name: str, raw: Any) -> QueueAttributes:
        """Every message call reads its queue's attributes: parse each stored value
        once, and again only when the stored value changed."""
        key = (namespace, name)
        cached = self._attributes.get(key)
        if cached is not None and (cached[0] is raw or cached[0] == raw):
            return cached[1]
        attrs = QueueAttributes.from_json(raw)
        if len(self._attributes) >= _ATTRIBUTES_CACHED:
            self._attributes.clear()
        self._attributes[key] = (raw, attrs)
        return attrs

    async def attributes(self, caller: Caller, name: str) -> QueueAttributes:
        """A queue's attributes. A storage topic made by another protocol becomes a
        queue with the default attributes on first use (so MNS clients can consume a
        Kafka topic): its group gets MNS's policy (no delivery limit) before the first
        receive, not the storage default."""
        raw = await self._processor.meta_get(caller, QUEUE_KIND, name)
        if raw is not None:
            return self._parsed(caller.namespace, name, raw)
        check_name("queue", name)
        try:
            info = await self._processor.describe_topic(caller, name)
        except TopicNotFound:
            raise MnsError.queue_not_exist(name) from None
        if await self._processor.meta_get(caller, TOPIC_KIND, name) is not None:
            raise MnsError.queue_not_exist(name)  # an MNS topic, not a queue
        attrs = QueueAttributes(create_time=info.created_ms, last_modify_time=info.modified_ms)
        await self._processor.set_group_config(caller, group_of(name), _group_config(attrs))
        await self._processor.meta_put(caller, QUEUE_KIND, name, attrs.to_json())
        return attrs

    # -- queue management ----------------------------------------------------------

    async def create(self, caller: Caller, name: str, document: Any) -> bool:
        """True if created; False if it existed with the same attributes (MNS answers
        204 then, and QueueAlreadyExist if they differ)."""
        check_name("queue", name)
        now = self._now()
        attrs = QueueAttributes(create_time=now, last_modify_time=now).updated(
            document, creating=True
        )
        existing = await self._processor.meta_get(caller, QUEUE_KIND, name)
        if existing is not None:
            if QueueAttributes.from_json(existing).same_settings(attrs):
                return False
            raise MnsError("QueueAlreadyExist", f"The queue {name} already exists.", 409)
        if await self._processor.meta_get(caller, TOPIC_KIND, name) is not None:
            raise MnsError("QueueAlreadyExist", f"A topic is named {name} already.", 409)
        await self._check_dead_letter_queue(caller, attrs)
        # An existing storage topic is adopted: another protocol's topic, or a queue
        # half-created before a crash.
        with contextlib.suppress(TopicAlreadyExists):
            await self._processor.create_topic(
                caller, name, TopicConfig(queue_count=1, retention_ms=UNLIMITED)
            )
        await self._processor.set_group_config(caller, group_of(name), _group_config(attrs))
        await self._processor.meta_put(caller, QUEUE_KIND, name, attrs.to_json())
        return True

    async def set_attributes(self, caller: Caller, name: str, document: Any) -> None:
        old = await self.attributes(caller, name)
        new = replace(old.updated(document, creating=False), last_modify_time=self._now())
        await self._check_dead_letter_queue(caller, new)
        if _group_config(new) != _group_config(old):
            await self._processor.set_group_config(caller, group_of(name), _group_config(new))
        await self._processor.meta_put(caller, QUEUE_KIND, name, new.to_json())

    async def _check_dead_letter_queue(self, caller: Caller, attrs: QueueAttributes) -> None:
        """The dead-letter target must be a queue already: the engine would otherwise
        create a plain topic of that name, with the default retention."""
        target = attrs.dead_letter_queue
        if (
            target is not None
            and await self._processor.meta_get(caller, QUEUE_KIND, target) is None
        ):
            raise MnsError.queue_not_exist(target)

    async def counts(self, caller: Caller, name: str) -> QueueCounts:
        """From the group's pop state, summed over the priority levels; delayed
        messages (no offset until they are due) from storage's count of those held."""
        await self.attributes(caller, name)
        return await queue_counts(self._processor, caller, name)

    async def delete(self, caller: Caller, name: str) -> None:
        self._reclaimer.forget(caller, name)
        self._growth.pop((caller.namespace, name), None)
        await self._processor.meta_delete(caller, QUEUE_KIND, name)
        with contextlib.suppress(TopicNotFound):
            await self._processor.delete_topic(caller, name)

    async def names(self, caller: Caller) -> list[str]:
        return sorted(await self._processor.meta_list(caller, QUEUE_KIND))

    # -- messages ------------------------------------------------------------------

    async def send(
        self, caller: Caller, name: str, documents: Sequence[Any]
    ) -> list[Sent | MnsError]:
        """Store one message or a batch (at most 16) with one append call: a batch
        shares one group commit. Per document: what was stored, or why that message
        was refused (the others are stored all the same, as MNS does)."""
        if not documents:
            raise MnsError.invalid_argument("no message to send.")
        if len(documents) > _MAX_BATCH:
            raise MnsError.invalid_argument(f"a batch holds at most {_MAX_BATCH} messages.")
        attrs = await self.attributes(caller, name)
        checked = [self._check_message(attrs, d) async for d in cooperatively(documents)]
        outgoing = [o for o in checked if isinstance(o, Outgoing)]
        if len(documents) > 1:
            total = sum(len(o.message.body) for o in outgoing)
            if total > self._max_message_bytes:  # MNS: a batch is at most 64 KB in all
                raise MnsError(
                    "MessageBodyTooLong",
                    f"The messages of a batch total {total} bytes, more than "
                    f"{self._max_message_bytes}.",
                )
        levels = await self._levels_for(caller, name, attrs, outgoing)
        requests = [
            AppendRequest(
                entry=o.message,
                queues=(
                    QueueRef(
                        caller.namespace,
                        name,
                        queue_id_for(priority_of(o.message), levels),
                    ),
                ),
                dedup_key=f"{DEDUP_PREFIX}{name}:{o.dedup_id}" if o.dedup_id else None,
            )
            for o in outgoing
        ]
        results = iter(await self._processor.append(caller, requests) if requests else [])
        return [(o, next(results)) if isinstance(o, Outgoing) else o for o in checked]

    async def _levels_for(
        self, caller: Caller, name: str, attrs: QueueAttributes, outgoing: Sequence[Outgoing]
    ) -> int:
        """The queue's priority levels, grown from 1 to 16 storage queues by its first
        message of another priority than the default (never for a FIFO queue, whose
        groups keep their order, nor for another protocol's topic of several queues)."""
        info = await self._processor.describe_topic(caller, name)
        levels = levels_of(info)
        if (
            levels == 1
            and not attrs.fifo
            and len(info.queues) == 1
            and any(priority_of(o.message) != DEFAULT_PRIORITY for o in outgoing)
        ):
            config = replace(info.config, queue_count=LEVELS)
            levels = levels_of(await self._processor.alter_topic(caller, name, config))
            for waiting in self._growth.pop((caller.namespace, name), ()):
                waiting.cancel()
        return levels

    def _check_message(self, attrs: QueueAttributes, document: Any) -> Outgoing | MnsError:
        try:
            outgoing = parse_message(
                document,
                now_ms=self._now(),
                default_delay_s=attrs.delay_seconds,
                max_body_bytes=min(attrs.maximum_message_size, self._max_message_bytes),
                retention_s=attrs.message_retention_period,
            )
        except MnsError as e:
            return e
        if attrs.fifo and outgoing.message.message_group is None:
            return MnsError.invalid_argument("a FIFO queue needs a MessageGroupId.")
        return outgoing

    async def receive(
        self, caller: Caller, name: str, *, count: int, wait_s: int | None
    ) -> list[StoredMessage]:
        """Long polling: wait up to ``wait_s`` (the queue's PollingWaitSeconds when
        not given) for a message; MessageNotExist if none came."""
        attrs = await self.attributes(caller, name)
        wait = attrs.polling_wait_seconds if wait_s is None else wait_s
        deadline = self._now() + wait * 1000
        invisible_ms = attrs.visibility_timeout * 1000
        while True:
            refs = await storage_queues(self._processor, caller, name)
            if len(refs) > 1:
                messages = await self._pop_by_priority(caller, name, refs, count, invisible_ms)
                if not messages:
                    # A long poll over every level takes whichever comes first.
                    messages = await self._processor.pop(
                        caller,
                        group_of(name),
                        refs,
                        invisible_ms=invisible_ms,
                        wait_ms=max(0, deadline - self._now()),
                    )
            else:
                popped = await self._pop_until_grown(caller, name, count, invisible_ms, deadline)
                if popped is None:
                    continue  # grown its levels meanwhile: wait on all of them
                messages = popped
            if not messages:
                raise MnsError.message_not_exist()
            messages = await self._divert_dead(caller, name, attrs, messages)
            if messages:
                return messages
            if self._now() >= deadline:  # all of them went to the dead-letter queue
                raise MnsError.message_not_exist()

    async def _divert_dead(
        self, caller: Caller, name: str, attrs: QueueAttributes, messages: list[StoredMessage]
    ) -> list[StoredMessage]:
        """Messages received more than MaxReceiveCount times go to the dead-letter queue
        instead of out: copied there (a dedup key makes a retry after a crash store it
        once), then deleted here. The gateway does it, not storage, because the
        target queue may live on another storage node."""
        target, limit = attrs.dead_letter_queue, attrs.max_receive_count
        if target is None or limit is None:
            return messages
        dead = [m for m in messages if m.delivery_attempt > limit]
        if not dead:
            return messages
        await self._processor.append(
            caller,
            [
                AppendRequest(
                    entry=m.message,
                    queues=(QueueRef(caller.namespace, target),),
                    dedup_key=f"{DEDUP_PREFIX}dlq:{m.message_id}:{m.delivery_attempt}",
                )
                for m in dead
            ],
        )
        receipts = [m.receipt for m in dead if m.receipt is not None]
        await self._processor.ack_many(caller, group_of(name), receipts)
        return [m for m in messages if m.delivery_attempt <= limit]

    async def _pop_until_grown(
        self, caller: Caller, name: str, count: int, invisible_ms: int, deadline: int
    ) -> list[StoredMessage] | None:
        """Pop (long polling) from an unprioritised queue; ``None`` if it grew its
        priority levels meanwhile (the pop is cancelled: storage gives back what a
        cancelled pop took)."""
        wait_ms = max(0, deadline - self._now())
        popping = self._processor.pop(
            caller,
            group_of(name),
            [QueueRef(caller.namespace, name)],
            max_messages=count,
            invisible_ms=invisible_ms,
            wait_ms=wait_ms,
        )
        if wait_ms == 0:
            return await popping
        # One task, cancelled by the growth itself: not a second task waiting on an
        # event beside it and a wait over both, which every receive paid for (two
        # tasks, their cancellation and loop iterations per long poll).
        key = (caller.namespace, name)
        pop = asyncio.ensure_future(popping)
        waiting = self._growth.setdefault(key, set())
        waiting.add(pop)
        try:
            await asyncio.wait((pop,))
        except BaseException:  # our own cancellation
            pop.cancel()
            await asyncio.wait((pop,))
            raise
        finally:
            waiting.discard(pop)
            if not waiting and self._growth.get(key) is waiting:
                del self._growth[key]
        return None if pop.cancelled() else pop.result()

    async def _pop_by_priority(
        self,
        caller: Caller,
        name: str,
        refs: Sequence[QueueRef],
        count: int,
        invisible_ms: int,
    ) -> list[StoredMessage]:
        """What is visible now, highest priority first (one pop would rotate over the
        levels). A cancel gives back what the levels before it handed out."""
        got: list[StoredMessage] = []
        try:
            for ref in refs:
                got += await self._processor.pop(
                    caller,
                    group_of(name),
                    [ref],
                    max_messages=count - len(got),
                    invisible_ms=invisible_ms,
                )
                if len(got) >= count:
                    break
        except asyncio.CancelledError:
            for message in got:
                with contextlib.suppress(StorageError):
                    if message.receipt is not None:
                        await self._processor.change_invisibility(
                            caller, group_of(name), message.receipt, 0
                        )
            raise
        return got

    async def peek(self, caller: Caller, name: str, *, count: int) -> list[StoredMessage]:
        """Messages from the head of the queue (the first one not deleted) on, without
        changing their state, and not metered: a peek delivers nothing. Messages
        deleted out of order past the head are still shown until the head passes them
        (storage keeps no cheap per-offset view of them)."""
        await self.attributes(caller, name)
        found: list[StoredMessage] = []
        for ref in await storage_queues(self._processor, caller, name):
            start = await self._processor.consumed_below(caller, group_of(name), ref)
            result = await self._processor.read(
                caller, ref, start, max_messages=count - len(found), metered=False
            )
            found += result.messages
            if len(found) >= count:
                break
        if not found:
            raise MnsError.message_not_exist()
        return found

    async def delete_message(self, caller: Caller, name: str, receipt: str) -> None:
        await self.attributes(caller, name)
        await self._processor.ack(caller, group_of(name), receipt)
        await self._reclaimer.deleted(caller, name, group_of(name), 1)

    async def delete_messages(
        self, caller: Caller, name: str, receipts: Sequence[str]
    ) -> list[str | None]:
        """Per receipt: ``None`` when deleted, else why not (a storage error code)."""
        if not receipts or len(receipts) > _MAX_BATCH:
            raise MnsError.invalid_argument(f"give 1 to {_MAX_BATCH} receipt handles.")
        await self.attributes(caller, name)
        outcomes = await self._processor.ack_many(caller, group_of(name), receipts)
        deleted = sum(1 for outcome in outcomes if outcome is None)
        await self._reclaimer.deleted(caller, name, group_of(name), deleted)
        return outcomes

    async def change_visibility(
        self, caller: Caller, name: str, receipt: str, timeout_s: int
    ) -> StoredMessage:
        await self.attributes(caller, name)
        return await self._processor.change_invisibility(
            caller, group_of(name), receipt, timeout_s * 1000
        )
