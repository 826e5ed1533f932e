"""Routing a publish: one storage append into the storage topic and every queue it
reaches, and deliveries from memory to online subscribers.

Every publish is indexed into the storage topic (the topic name's first level, so
other protocols see it), into the session queue of every persistent session it
reaches at QoS 1 or 2, and into the queue of every shared-subscription group it
matches (multi-dispatch). Those sessions read their queue in pop mode, so an
acknowledged publish survives their disconnect and a server restart. Clean
sessions, and QoS 0, are served from memory as EMQX does (docs/mqtt.md).

What other protocols store under a storage topic, and what other gateways stored,
reaches this gateway through the tails (protocols/mqtt/tails.py) and is routed here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from polymq.protocols import interop
from polymq.protocols.mqtt.core import ROUTE_RETRIES, ROUTE_RETRY_S, BrokerCore
from polymq.protocols.mqtt.mapping import MQTT_RETAIN, mqtt_topic_of, published_qos, storage_topic
from polymq.protocols.mqtt.model import Delivery, Outgoing, Session, SessionOwner, SharedGroup
from polymq.protocols.mqtt.own_appends import OwnAppends
from polymq.protocols.mqtt.peers import stamp_of, stamped
from polymq.protocols.mqtt.repairs import Repairs, owed_targets, without_owed
from polymq.protocols.mqtt.repairs import owing as owing_copies
from polymq.protocols.mqtt.topic_filter_index import filter_matches, split_shared
from polymq.protocols.mqtt.topic_tail import from_mqtt
from polymq.storage.errors import (
    StorageClosed,
    StorageError,
    StorageFailed,
    StorageUnavailable,
    TopicNotFound,
)
from polymq.storage.model import AppendRequest, AppendResult, Message, QueueRef, StoredMessage

__all__ = ["Routed", "Router"]

log = logging.getLogger(__name__)

_OWING_LOG_EVERY_S = 10.0


@dataclass(slots=True)
class _Plan:
    """Where one publish goes (:meth:`Router._plan`); ``repeatable``: the same for
    the next publish to the same topic with the same QoS, retain flag and publisher
    (no shared group's turn taken)."""

    queues: tuple[QueueRef, ...]
    sends: list[tuple[SessionOwner, int, bool, list[int]]]
    woken: list[SessionOwner]
    repeatable: bool


@dataclass(slots=True)
class Routed:
    """Publishes handed out from memory, to be stored: ``requests[i]`` stores
    ``items[i]``; ``woken`` are the persistent sessions to wake once stored."""

    items: list[Outgoing]
    requests: list[AppendRequest]
    woken: list[SessionOwner]

    @staticmethod
    def join(parts: list[Routed]) -> Routed:
        """Several in order as one (one append): item indices run on across parts."""
        if len(parts) == 1:
            return parts[0]
        return Routed(
            [item for part in parts for item in part.items],
            [request for part in parts for request in part.requests],
            [owner for part in parts for owner in part.woken],
        )


class Router:
    """Where a message goes, from the subscription index of one namespace."""

    def __init__(self, core: BrokerCore, repairs: Repairs) -> None:
        self.core = core
        self.repairs = repairs
        self.messages_in = 0
        # Where this router's publishes landed in followed storage topics: their tails
        # skip them instead of reading them back to drop them (own_appends.py).
        self.own = OwnAppends()
        self._owing_logged = -_OWING_LOG_EVERY_S

    async def publish(self, items: list[Outgoing]) -> dict[int, StorageError]:
        """Hand the in-memory deliveries out, then store every item with one append
        (each dispatched to its storage topic and to every queue it reaches). Returns
        the items that could not be stored (by index), with why: their storage topic's
        node is down (:meth:`_store`)."""
        return await self.store(await self.route(items))

    async def route(self, items: list[Outgoing]) -> Routed:
        """Hand the in-memory deliveries out and say what :meth:`store` is to append.

        Online clean-session subscribers do not wait for the disk: as with EMQX, what
        they get from memory is not kept for them anyway, and the publisher's ack still
        waits for the append. A connection routes its publishes in order as they
        arrive and stores them in order behind (protocols/mqtt/store_queue.py)."""
        requests = []
        memory: list[tuple[SessionOwner, Delivery]] = []
        woken: list[SessionOwner] = []
        # A burst repeats a few topics: each one's storage queue and route (when no
        # shared group takes turns in it) worked out once per batch, anew after any
        # await (subscriptions may have changed meanwhile).
        stored: dict[str, QueueRef] = {}
        plans: dict[tuple[str, int, bool, str | None], _Plan] = {}
        for item in items:
            queue = stored.get(item.topic)
            if queue is None:
                topic = storage_topic(item.topic)
                if topic not in self.core.topics:
                    await self.core.ensure_topic(topic)
                    plans.clear()
                queue = stored[item.topic] = QueueRef(self.core.namespace, topic, 0)
            if self.core.peers is not None:  # with no await before _route: see _route_peer
                stamp = b"%d:%s" % (self.core.applied, self.core.stamp)
                item.message = stamped(item.message, stamp)
            key = (item.topic, item.qos, item.retain, item.publisher)
            plan = plans.get(key)
            if plan is None:
                plan = self._plan(item)
                if plan.repeatable:
                    plans[key] = plan
            if plan.sends:
                message = item.message
                for owner, qos, retain, ids in plan.sends:
                    memory.append(
                        (
                            owner,
                            Delivery(
                                message=message,
                                topic=item.topic,
                                qos=qos,
                                retain=retain,
                                subscription_ids=ids,
                            ),
                        )
                    )
            if plan.woken:
                woken.extend(plan.woken)
            # QoS 0 asked for no durability: written, fsynced within the flush interval.
            requests.append(
                AppendRequest(
                    entry=item.message,
                    queues=(queue, *plan.queues) if plan.queues else (queue,),
                    dedup_key=item.dedup_key,
                    durable=item.qos > 0,
                )
            )
        for owner, delivery in memory:
            owner.deliver(delivery)
        return Routed(items, requests, woken)

    async def store(self, routed: Routed) -> dict[int, StorageError]:
        """Append what :meth:`route` planned (one append for all, as a rule), keep
        the retained ones, wake the persistent sessions reached; returns the items
        not stored, by index."""
        items, woken = routed.items, routed.woken
        failed = await self._store(routed.requests)
        self.messages_in += len(items) - len(failed)
        for i, item in enumerate(items):
            if item.retain and i not in failed:
                try:
                    await self.core.processor.put_latest(
                        self.core.caller,
                        storage_topic(item.topic),
                        item.topic.encode(),
                        item.message if item.message.body else None,
                    )
                except StorageError as e:
                    failed[i] = e
        for owner in woken:
            owner.wake()
        return failed

    async def _store(self, requests: list[AppendRequest]) -> dict[int, StorageError]:
        """One append for all, as a rule. When a node some queue is on is away, that
        append fails; then each request is stored in its own storage topic alone,
        marked with the queues it owes a copy to, which this gateway and the topic's
        tail hand to :class:`Repairs` (so only a publish whose own topic is on the
        dead node fails).

        A request reaching a queue still owed copies by this gateway, or one of a
        failed append that has not answered since (``Repairs.busy``), goes that way
        at once: the queue keeps publish order, and no append spanning a dead node
        is tried again (until storage knows the node is down, such an append writes
        the live nodes' shares before failing, and the request stored again owing
        would be there twice)."""
        repairs = self.repairs
        owing = (
            []
            if repairs.idle
            else [
                i
                for i, r in enumerate(requests)
                if any(repairs.busy(q.topic) for q in r.queues[1:])
            ]
        )
        direct = [r for i, r in enumerate(requests) if i not in owing] if owing else requests
        if direct:
            own = self.own
            ticket = own.begin()
            placed: list[tuple[QueueRef, int]] = []
            try:
                results = await self._append(direct)
                for request, result in zip(direct, results, strict=True):
                    # The storage topic's queue comes first; a duplicate (a QoS 2
                    # resend) may have been stored by another gateway: not skipped.
                    if result.placements and not result.duplicate:
                        first = result.placements[0]
                        if first.queue == request.queues[0]:
                            placed.append((first.queue, first.offset))
            except StorageUnavailable as e:
                repairs.suspect([q.topic for r in direct for q in r.queues[1:]])
                now = time.monotonic()
                if now - self._owing_logged > _OWING_LOG_EVERY_S:  # once in a while
                    self._owing_logged = now
                    log.info("mqtt: publishes stored owing their queue copies: %s", e)
                owing = list(range(len(requests)))
            finally:
                own.end(ticket, placed)
        return await self._store_owing(requests, owing) if owing else {}

    async def _store_owing(
        self, requests: list[AppendRequest], owing: list[int]
    ) -> dict[int, StorageError]:
        """Store ``requests[i]`` for each ``i`` in ``owing`` in its storage topic only
        (one append per storage topic, so a dead node fails only its topics' items),
        marked with the queues it owes (repairs.py)."""
        by_topic: dict[str, list[int]] = {}
        for i in owing:
            by_topic.setdefault(requests[i].queues[0].topic, []).append(i)

        def marked(request: AppendRequest) -> AppendRequest:
            targets = [q.topic for q in request.queues[1:]]
            entry = request.entry
            assert isinstance(entry, Message)
            return AppendRequest(
                entry=owing_copies(entry, targets) if targets else entry,
                queues=request.queues[:1],
                dedup_key=request.dedup_key,
                durable=request.durable,
            )

        groups = list(by_topic.values())
        answers = await asyncio.gather(
            *(self._append([marked(requests[i]) for i in group]) for group in groups),
            return_exceptions=True,
        )
        failed: dict[int, StorageError] = {}
        for group, answer in zip(groups, answers, strict=True):
            if isinstance(answer, StorageError):
                failed.update((i, answer) for i in group)
                continue
            if isinstance(answer, BaseException):
                raise answer
            for i, result in zip(group, answer, strict=True):
                request = requests[i]
                if len(request.queues) == 1:
                    continue
                # This gateway makes the copies too, from memory: until they are
                # made its later publishes to those queues are stored owing, so the
                # queues get them in order (the owner's tail may be another
                # gateway's, or not have read this yet). A QoS 2 resend, or one whose
                # first attempt was stored unmarked before the node failed
                # (``duplicate``), has its first append's place.
                entry = request.entry
                assert isinstance(entry, Message)
                targets = [q.topic for q in request.queues[1:]]
                if result.placements:
                    placed = result.placements[0]
                    self.repairs.owe(placed.queue, placed.offset, entry, targets, held=False)
                else:
                    self.repairs.owe(None, 0, entry, targets)
        return failed

    async def _append(self, requests: list[AppendRequest]) -> list[AppendResult]:
        try:
            return await self.core.processor.append(self.core.caller, requests)
        except TopicNotFound:
            return await self._append_again(requests)

    async def _append_again(self, requests: list[AppendRequest]) -> list[AppendResult]:
        """A topic of the append was deleted behind our back: create it again and
        retry. In the separated form a topic just created (by another gateway, or by
        a concurrent create here) may also be unknown to the routes for a moment,
        until the storage nodes' next heartbeat reaches the nameservers: a few
        retries then."""
        for attempt in range(ROUTE_RETRIES):
            self.core.topics.clear()
            for request in requests:
                self.own.forget(request.queues[0])  # offsets start again
                for queue in request.queues:
                    await self.core.ensure_topic(queue.topic)
            try:
                return await self.core.processor.append(self.core.caller, requests)
            except TopicNotFound:
                if attempt == ROUTE_RETRIES - 1:
                    raise
                await asyncio.sleep(ROUTE_RETRY_S)
        raise AssertionError("unreachable")

    def _route(
        self,
        item: Outgoing,
        queues: list[QueueRef],
        memory: list[tuple[SessionOwner, Delivery]],
        woken: list[SessionOwner],
    ) -> None:
        plan = self._plan(item)
        queues.extend(plan.queues)
        woken.extend(plan.woken)
        for owner, qos, retain, ids in plan.sends:
            memory.append(
                (
                    owner,
                    Delivery(
                        message=item.message,
                        topic=item.topic,
                        qos=qos,
                        retain=retain,
                        subscription_ids=ids,
                    ),
                )
            )

    def _plan(self, item: Outgoing) -> _Plan:
        """Where ``item`` goes: the queues it is copied into (persistent sessions at
        QoS 1 or 2, shared groups), the online owners it is handed from memory (with
        QoS, retain flag and subscription ids) and the owners to wake."""
        queues: list[QueueRef] = []
        sends: list[tuple[SessionOwner, int, bool, list[int]]] = []
        woken: list[SessionOwner] = []
        repeatable = True
        per_session: dict[str, tuple[Session, int, list[int], bool]] = {}
        for _, value in self.core.index.match(item.topic):
            if isinstance(value, SharedGroup):
                repeatable = False  # its members take turns
                queues.append(value.queue)
                owner = value.next_owner()
                if owner is not None:
                    woken.append(owner)
                continue
            session, options = value
            if options.no_local and session.client_id == item.publisher:
                continue
            seen = per_session.get(session.client_id)
            ids = [options.subscription_id] if options.subscription_id else []
            if seen is None:
                per_session[session.client_id] = (
                    session,
                    options.qos,
                    ids,
                    options.retain_as_published,
                )
            else:
                per_session[session.client_id] = (
                    session,
                    max(seen[1], options.qos),
                    seen[2] + ids,
                    seen[3] or options.retain_as_published,
                )
        for session, qos, ids, rap in per_session.values():
            granted = min(qos, item.qos)
            if session.queue is not None and granted > 0:
                queues.append(session.queue)
                if session.owner is not None:
                    woken.append(session.owner)
            elif session.owner is not None:
                sends.append((session.owner, granted, item.retain and rap, ids))
        return _Plan(tuple(queues), sends, woken, repeatable)

    def deliver_transient(self, topic: str, message: Message) -> None:
        """Hand a QoS 0 message to online subscribers without storing it (``$SYS``)."""
        memory: list[tuple[SessionOwner, Delivery]] = []
        item = Outgoing(message=message, topic=topic, qos=0, retain=False)
        self._route(item, [], memory, [])
        for owner, delivery in memory:
            owner.deliver(delivery)

    async def retained(self, topic_filter: str) -> list[tuple[str, Message]]:
        """Retained messages matching a (plain) filter, from the keyed latest values
        of the storage topics the filter can reach."""
        first = topic_filter.split("/", 1)[0]
        if first in ("+", "#"):
            names = [t.name for t in await self.core.processor.list_topics(self.core.caller)]
            names = [n for n in names if not n.startswith("$")]
        else:
            names = [storage_topic(topic_filter)]
        now = self.core.processor.clock.now_ms()
        found = []
        for name in names:
            try:
                values = await self.core.processor.list_latest(self.core.caller, name)
            except StorageError:
                continue
            for key, message in values:
                topic = key.decode("utf-8", "replace")
                if message.expiry_ms is not None and message.expiry_ms <= now:
                    continue
                if filter_matches(topic_filter, topic):
                    found.append((topic, message))
        return found

    # -- messages from the tails: other protocols', other gateways' ----------------

    async def route_tail(self, topic: str, stored: list[StoredMessage], live: bool) -> None:
        """What a tail of ``topic`` read (``live``: not a catch-up on a topic found
        late, whose messages go to queues only). Publishes stored owing queue copies
        are handed to the repairs by one gateway (the topic's owner, as other
        protocols' copies); the others treat them as any publish."""
        peers = self.core.peers
        if any(owed_targets(m.message) for m in stored):
            if peers is None or peers.owns(topic):
                for m in stored:
                    targets = owed_targets(m.message)
                    if targets:
                        self.repairs.owe(m.queue, m.offset, without_owed(m.message), targets)
            stored = [m for m in stored if not self._ours(m)]
        if peers is None:
            await self._route_foreign(topic, stored, live=live)
        else:
            await self._route_tailed(topic, stored, live=live)

    def tailed(self, stored: StoredMessage) -> bool:
        """What a tail hands :meth:`route_tail`: other protocols' messages, with
        several gateways the other gateways' publishes, and publishes stored owing
        queue copies."""
        return not self._ours(stored) or bool(owed_targets(stored.message))

    def _ours(self, stored: StoredMessage) -> bool:
        """An MQTT publish this gateway routed when it arrived."""
        if self.core.peers is None:
            return from_mqtt(stored)
        return not self.not_ours(stored)

    async def _route_foreign(
        self, topic: str, stored: list[StoredMessage], *, live: bool = True
    ) -> None:
        """Route messages produced by other protocols under the storage topic's name:
        copied into the queues they reach, and when ``live`` from memory to online
        subscribers."""
        requests = []
        memory: list[tuple[SessionOwner, Delivery]] = []
        woken: list[SessionOwner] = []
        # Several gateways: every one hands its own online clients what they get from
        # memory, and one (by the topic's hash) copies into queues (the pumps of
        # sessions served elsewhere wait on their queue, see Outbound._pump).
        copy = self.core.peers is None or self.core.peers.owns(topic)
        sources = []
        for record in stored:
            message = replace(
                record.message,
                properties=((interop.MQTT_TOPIC, topic.encode()), *record.message.properties),
            )
            item = Outgoing(message=message, topic=topic, qos=1, retain=False)
            queues: list[QueueRef] = []
            self._route(item, queues, memory, woken)
            if queues and copy:
                requests.append(AppendRequest(entry=message, queues=tuple(queues)))
                sources.append(record)
        if requests:  # copies of what its producer was metered for already
            await self._copy_or_owe(sources, requests)
        if live:
            for owner, delivery in memory:
                owner.deliver(delivery)
        if copy:
            for owner in woken:
                owner.wake()

    def not_ours(self, stored: StoredMessage) -> bool:
        """What a gateway's tail routes: other protocols' messages, and MQTT publishes
        another gateway stored (for this gateway's online clients)."""
        assert self.core.peers is not None
        if not from_mqtt(stored):
            return True
        stamp = stamp_of(stored)
        return stamp is None or stamp[0] != self.core.peers.self_id

    async def _route_tailed(
        self, topic: str, stored: list[StoredMessage], *, live: bool = True
    ) -> None:
        foreign = [m for m in stored if not from_mqtt(m)]
        if foreign:
            await self._route_foreign(topic, foreign, live=live)
        if live and len(foreign) < len(stored):
            await self._route_peer(topic, [m for m in stored if from_mqtt(m)])

    async def _route_peer(self, topic: str, stored: list[StoredMessage]) -> None:
        """MQTT publishes another gateway stored: it put them into every queue it knew
        they reach (session or shared) with the same append, so here they go to this
        gateway's online clients from memory, and to the queues of subscriptions made
        here that it did not know yet (:meth:`_missed`). The pumps of the queues need
        no wake: they wait on the queues themselves (a queue's copy may be on another
        storage node, and land after the topic's)."""
        memory: list[tuple[SessionOwner, Delivery]] = []
        woken: list[SessionOwner] = []  # ignored, as are the queues
        requests = []
        sources = []
        for record in stored:
            message = record.message
            item = Outgoing(
                message=message,
                topic=mqtt_topic_of(message, topic),
                qos=published_qos(message),
                retain=message.property(MQTT_RETAIN) == b"1",
                publisher=message.producer,
            )
            self._route(item, [], memory, woken)
            stamp = stamp_of(record)
            missed = self._missed(item, stamp[1]) if stamp is not None else []
            if missed:
                requests.append(AppendRequest(entry=message, queues=tuple(missed)))
                sources.append(record)
        for owner, delivery in memory:
            owner.deliver(delivery)
        if requests:
            await self._copy_or_owe(sources, requests)

    async def _copy_or_owe(
        self, sources: list[StoredMessage], requests: list[AppendRequest]
    ) -> None:
        """Copies a tail makes (of ``sources[i]``, as ``requests[i]``): one append, or,
        when a queue's node is away, owed (repairs.py), the tail held below them."""
        try:  # copies of what was metered when it was stored
            await self.core.processor.append(self.core.caller, requests, metered=False)
        except (StorageUnavailable, StorageFailed, StorageClosed) as e:  # as Repairs retries
            log.info("mqtt: %d tail copies owed: %s", len(requests), e)
            for record, request in zip(sources, requests, strict=True):
                entry = request.entry
                assert isinstance(entry, Message)
                targets = [q.topic for q in request.queues]
                self.repairs.owe(record.queue, record.offset, entry, targets)

    def _missed(self, item: Outgoing, applied: int) -> list[QueueRef]:
        """Queues of persistent sessions the publishing gateway did not route ``item``
        to: every filter of theirs matching it was subscribed here and announced at or
        after the events offset that gateway had applied when it stored the item
        (``applied``, from its stamp). Only the gateway that announced those filters
        knows that, so it alone makes the copy: exactly once."""
        if item.qos == 0:
            return []
        missed: list[QueueRef] = []
        for _, value in self.core.index.match(item.topic):
            if isinstance(value, SharedGroup):
                continue
            session, options = value
            queue = session.queue
            announced_at = session.announced_at
            if queue is None or not announced_at:
                continue
            if queue in missed or (options.no_local and session.client_id == item.publisher):
                continue
            matching = [
                (f, o.qos)
                for f, o in session.subscriptions.items()
                if split_shared(f) is None and filter_matches(f, item.topic)
            ]
            unknown = all(announced_at.get(f, -1) >= applied for f, _ in matching)
            if matching and unknown and any(qos > 0 for _, qos in matching):
                missed.append(queue)
        return missed
