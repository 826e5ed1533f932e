"""One namespace's MQTT world: sessions, the subscription index, retained messages and
the routing of a publish to storage and to subscribers.

Routing (docs/mqtt.md): every publish is one storage append, indexed into the storage
topic (the topic name's first level, so other protocols see it), into the session
queue of every persistent session it reaches at QoS 1 or 2, and into the queue of
every shared-subscription group it matches (multi-dispatch). Those sessions read
their queue in pop mode, so an acknowledged publish survives their disconnect and a
server restart. Clean sessions, and QoS 0, are served from memory as EMQX does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.accounts import Principal
from gateway.processor import Caller, Processor
from protocols import interop
from protocols.mqtt.mapping import MQTT_RETAIN, mqtt_topic_of, published_qos, storage_topic
from protocols.mqtt.peers import (
    EVENTS_TOPIC,
    Event,
    Peers,
    decode_event,
    encode_event,
    stamp_of,
    stamped,
)
from protocols.mqtt.topic_filter_index import TopicFilterIndex, filter_matches, split_shared
from protocols.mqtt.topic_tail import TAIL_GROUP, TopicTail, from_mqtt
from storage.errors import OffsetOutOfRange, StorageError, TopicAlreadyExists, TopicNotFound
from storage.model import (
    AppendRequest,
    GroupConfig,
    Message,
    QueueRef,
    StoredMessage,
    TopicConfig,
)

__all__ = [
    "POP_GROUP",
    "Broker",
    "Delivery",
    "Outgoing",
    "Session",
    "SessionOwner",
    "SharedGroup",
    "SubOptions",
    "spawn",
]

log = logging.getLogger(__name__)

POP_GROUP = "mqtt"  # the consumer group every session and shared queue is popped by
_SESSION_KIND = "mqtt.session"
_SESSION_PREFIX = "$mqtt.session."
_SHARED_PREFIX = "$mqtt.share."
_INTERNAL_PREFIXES = (_SESSION_PREFIX, _SHARED_PREFIX, EVENTS_TOPIC)
_INTERNAL_TOPIC = TopicConfig(internal=True)
_PUBLIC_TOPIC = TopicConfig()
_NEVER_EXPIRES = 0xFFFFFFFF
_DISCOVER_S = 2.0  # how often wildcard filters look for new storage topics
_EVENTS_WAIT_MS = 5_000
# The separated form learns of a topic another gateway (or a concurrent create) just
# made from the storage nodes' next heartbeat: a few hundred milliseconds.
_ROUTE_RETRIES = 50
_ROUTE_RETRY_S = 0.2
_RELEASE_WAIT_S = 5.0  # for the gateway serving a client that connected here to let go


@dataclass(slots=True, kw_only=True)
class SubOptions:
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None

    def to_json(self) -> list[Any]:
        return [
            self.qos,
            self.no_local,
            self.retain_as_published,
            self.retain_handling,
            self.subscription_id,
        ]

    @classmethod
    def from_json(cls, raw: list[Any]) -> SubOptions:
        return cls(
            qos=raw[0],
            no_local=raw[1],
            retain_as_published=raw[2],
            retain_handling=raw[3],
            subscription_id=raw[4],
        )


@dataclass(slots=True, kw_only=True)
class Delivery:
    """A message on its way to one online subscriber from memory."""

    message: Message
    topic: str
    qos: int
    retain: bool
    subscription_ids: list[int]


class SessionOwner(Protocol):
    """The connection serving a session (protocols/mqtt/connection.py)."""

    def deliver(self, delivery: Delivery) -> None: ...

    def wake(self) -> None:
        """New messages may wait in the session's or a shared group's queue."""
        ...

    async def take_over(self) -> None:
        """Close because the same client id connected again (v5 reason 0x8E)."""
        ...


@dataclass(slots=True, kw_only=True)
class Session:
    client_id: str
    expiry_s: int
    queue: QueueRef | None = None  # persistent sessions only
    subscriptions: dict[str, SubOptions] = field(default_factory=dict)
    owner: SessionOwner | None = None
    # QoS 2 in (v5 4.3.3): packet id -> the release epoch it arrived in, for PUBLISHes
    # answered with PUBREC whose PUBREL has not come yet. See :meth:`qos2_dedup_key`.
    inbound_qos2: dict[int, int] = field(default_factory=dict)
    release_epoch: int = 0  # PUBRELs handled: a packet id reused after PUBCOMP is new
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    outbound_pubrel: set[int] = field(default_factory=set)  # PUBREL sent, PUBCOMP awaited
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    # Several gateways: the others know it (tell them it ended); filters subscribed
    # here not yet announced, and the events offset at which each one was.
    announced: bool = False
    fresh: set[str] = field(default_factory=set)
    announced_at: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class SharedGroup:
    """``$share/{group}/{filter}``: one queue popped by the members (v5 4.8.2)."""

    name: str
    filter: str
    queue: QueueRef
    members: dict[str, Session] = field(default_factory=dict)
    turn: int = 0

    def next_owner(self) -> SessionOwner | None:
        """The online member to wake for the next message, in turn."""
        online = [m.owner for m in self.members.values() if m.owner is not None]
        if not online:
            return None
        self.turn += 1
        return online[self.turn % len(online)]


@dataclass(slots=True, kw_only=True)
class Outgoing:
    """One message to route: already mapped to the model."""

    message: Message
    topic: str
    qos: int
    retain: bool
    publisher: str | None = None
    dedup_key: str | None = None  # QoS 2 in: see Broker.qos2_dedup_key


def _queue_topic(prefix: str, name: str) -> str:
    """A storage topic name for a session or shared queue: readable when it fits,
    else a digest (storage names stop at 255 bytes)."""
    topic = prefix + name
    if len(topic.encode()) <= 200 and all(c >= " " and c != "\x7f" for c in topic):
        return topic
    return prefix + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


class Broker:
    """Sessions and routing for one namespace. Build with :meth:`load`."""

    def __init__(self, processor: Processor, namespace: str, peers: Peers | None = None) -> None:
        self.namespace = namespace
        self.processor = processor
        self.caller = Caller(
            principal=Principal(
                name="mqtt-broker",
                namespaces=frozenset({namespace}),
                default_namespace=namespace,
            ),
            namespace=namespace,
            protocol="mqtt",
        )
        self.sessions: dict[str, Session] = {}
        self.index: TopicFilterIndex[tuple[Session, SubOptions] | SharedGroup] = TopicFilterIndex()
        self.shared: dict[tuple[str, str], SharedGroup] = {}
        self._topics: set[str] = set()
        self._tails: dict[str, TopicTail] = {}
        self._ending: dict[str, asyncio.Future[None]] = {}  # sessions being removed
        self._tail_refs: dict[str, int] = {}  # storage topic -> filters reaching it
        self._wild_refs = 0  # filters whose first level is a wildcard: they reach all
        self._discovery: asyncio.Task[None] | None = None
        self._discovered = asyncio.Event()
        self._dropping: dict[str, asyncio.Task[None]] = {}  # shared queues being deleted
        self.messages_in = 0
        # Several gateways (None in the merged form): see protocols/mqtt/peers.py.
        self.peers = peers
        self._stamp = peers.self_id.encode() if peers is not None else b""
        self._events_queue = QueueRef(namespace, EVENTS_TOPIC, 0)
        self._events_task: asyncio.Task[None] | None = None
        self._releases: dict[str, asyncio.Future[None]] = {}  # attach nonce -> answer
        self._applied = 0  # events offset: those below it are in this gateway's index

    @classmethod
    async def load(cls, processor: Processor, namespace: str, peers: Peers | None = None) -> Broker:
        """The broker with the namespace's persistent sessions restored from storage;
        those that expired while the server was down are removed. With ``peers``, it
        then follows what the other gateways announce from the point it listed."""
        broker = cls(processor, namespace, peers)
        await processor.set_group_config(
            broker.caller, POP_GROUP, GroupConfig(max_delivery_attempts=None, dead_letter=False)
        )
        events_from = await broker._events_start() if peers is not None else 0
        broker._applied = events_from
        now = processor.clock.now_ms()
        saved = await processor.meta_list(broker.caller, _SESSION_KIND)
        for client_id, raw in saved.items():
            session = broker._session_from(client_id, raw)
            gone_ms = raw.get("disconnected_ms") or now
            left_ms = _expiry_left_ms(session.expiry_s, gone_ms, now)
            if left_ms is not None and left_ms <= 0:
                await broker._discard(session)
                continue
            broker.sessions[client_id] = session
            for topic_filter, options in raw["subs"].items():
                await broker._index_add(session, topic_filter, SubOptions.from_json(options))
            broker._schedule_expiry(session, left_ms)
        if peers is None:
            await broker._drop_orphan_groups()
        else:  # a shared queue may have members that only another gateway knows
            broker._events_task = asyncio.get_running_loop().create_task(
                broker._follow_events(events_from)
            )
        return broker

    def _session_from(self, client_id: str, raw: dict[str, Any]) -> Session:
        """A session as its saved record describes it, without its subscriptions."""
        queue = raw.get("queue")
        session = Session(
            client_id=client_id,
            expiry_s=raw["expiry_s"],
            queue=QueueRef(self.namespace, queue) if queue else None,
            inbound_qos2=_inbound_from_json(raw.get("qos2_in", ())),
            outbound_pubrel=set(raw.get("qos2_out", ())),
            release_epoch=raw.get("release_epoch", 0),
        )
        if "incarnation" in raw:
            session.incarnation = raw["incarnation"]
        return session

    # -- sessions ------------------------------------------------------------------

    async def attach(
        self, owner: SessionOwner, client_id: str, *, clean_start: bool, expiry_s: int
    ) -> tuple[Session, bool]:
        """Bind ``client_id``'s session to a new connection, taking it over from an
        old one; returns the session and whether it existed (CONNACK session present)."""
        ending = self._ending.get(client_id)
        if ending is not None:
            await ending  # the client's expired session is still being removed
        old = self.sessions.get(client_id)
        if old is not None and old.owner is not None:
            await old.owner.take_over()
            old = self.sessions.get(client_id)  # the old connection may have ended it
        if self.peers is not None:
            await self._claim(client_id)  # from whichever gateway serves it now
            old = self.sessions.get(client_id)
        if old is not None:
            _cancel_timers(old)
            if clean_start:
                await self._discard(old)
                old = None
        if old is None:
            session = Session(client_id=client_id, expiry_s=expiry_s)
            if expiry_s > 0:
                session.queue = QueueRef(
                    self.namespace, _queue_topic(_SESSION_PREFIX, client_id), 0
                )
                await self.ensure_topic(session.queue.topic)
            self.sessions[client_id] = session
            present = False
        else:
            session, present = old, True
            session.expiry_s = expiry_s
        session.owner = owner
        if session.queue is not None:
            await self._save(session, disconnected_ms=None)
        return session, present

    async def detach(self, session: Session, owner: SessionOwner) -> None:
        """The connection ended: keep the session until it expires, or end it now."""
        if session.owner is not owner:
            return  # taken over: the session belongs to the new connection
        session.owner = None
        for group in self.shared.values():
            if session.client_id in group.members:
                for other in group.members.values():
                    if other.owner is not None:
                        other.owner.wake()  # what this member held is visible again
        if session.expiry_s == 0 or session.queue is None:
            await self._discard(session)
            return
        await self._save(session, disconnected_ms=self.processor.clock.now_ms())
        if session.owner is None:  # not resumed by a new connection meanwhile
            self._schedule_expiry(session, _expiry_left_ms(session.expiry_s, 0, 0))

    def schedule(self, session: Session, delay_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` after ``delay_s`` unless the session is resumed first."""
        session.timers.append(asyncio.get_running_loop().call_later(delay_s, action))

    def _schedule_expiry(self, session: Session, left_ms: int | None) -> None:
        if left_ms is None:
            return

        def expire() -> None:
            if session.owner is None and self.sessions.get(session.client_id) is session:
                spawn(self._discard(session) if self.peers is None else self._expire(session))

        self.schedule(session, left_ms / 1000, expire)

    async def _discard(self, session: Session) -> None:
        self._forget(session, drop_groups=True)
        if self.peers is not None and session.announced:
            with contextlib.suppress(StorageError):  # the others check storage too
                await self._emit("gone", client=session.client_id, incarnation=session.incarnation)
        if session.queue is not None:
            # A new session of the same client id waits for this (its queue has the
            # same name): see attach.
            done = asyncio.get_running_loop().create_future()
            self._ending[session.client_id] = done
            try:
                self._topics.discard(session.queue.topic)
                await self.processor.meta_delete(self.caller, _SESSION_KIND, session.client_id)
                with contextlib.suppress(TopicNotFound):
                    await self.processor.delete_topic(self.caller, session.queue.topic)
            finally:
                if self._ending.get(session.client_id) is done:
                    del self._ending[session.client_id]
                done.set_result(None)

    def _forget(self, session: Session, *, drop_groups: bool = False) -> None:
        """Drop the session from this gateway's view (storage is the caller's). Only
        the gateway ending a session deletes the shared queues it leaves empty."""
        _cancel_timers(session)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        for topic_filter in list(session.subscriptions):
            self._index_remove(session, topic_filter, drop_group=drop_groups)
        session.subscriptions.clear()

    def _record(self, session: Session, disconnected_ms: int | None) -> dict[str, Any]:
        serving = self.peers.self_id if self.peers is not None and disconnected_ms is None else None
        return {
            "expiry_s": session.expiry_s,
            "queue": session.queue.topic if session.queue is not None else None,
            "subs": {f: o.to_json() for f, o in session.subscriptions.items()},
            "disconnected_ms": disconnected_ms,
            # QoS 2 flows in progress. The release epoch is saved before every
            # PUBCOMP (see qos2_dedup_key); the rest when the client leaves.
            "qos2_in": sorted(session.inbound_qos2.items()),
            "qos2_out": sorted(session.outbound_pubrel),
            "release_epoch": session.release_epoch,
            "incarnation": session.incarnation,
            "gateway": serving,  # several gateways: the one serving it, if any
        }

    async def _save(
        self, session: Session, *, disconnected_ms: int | None, announce: bool = True
    ) -> None:
        assert session.queue is not None
        record = self._record(session, disconnected_ms)
        await self.processor.meta_put(self.caller, _SESSION_KIND, session.client_id, record)
        if announce and self.peers is not None:
            await self._announce(session, record)

    async def _announce(self, session: Session, record: dict[str, Any]) -> None:
        assert self.peers is not None
        session.announced = True
        fresh, session.fresh = session.fresh, set()
        offset = await self._emit("session", client=session.client_id, record=record)
        for topic_filter in fresh:
            if topic_filter in session.subscriptions:
                session.announced_at[topic_filter] = offset

    # -- several gateways: see protocols/mqtt/peers.py ------------------------------

    async def _events_start(self) -> int:
        """Where this gateway starts following ``$mqtt.events``: taken before the
        session listing, so a change made meanwhile is both listed and followed (its
        record says it all: applying it twice is harmless)."""
        await self.ensure_topic(EVENTS_TOPIC)
        for _ in range(_ROUTE_RETRIES):
            try:
                offsets = await self.processor.queue_offsets(self.caller, self._events_queue)
                return offsets.latest
            except TopicNotFound:  # created by another gateway, not yet in our routes
                await asyncio.sleep(_ROUTE_RETRY_S)
        offsets = await self.processor.queue_offsets(self.caller, self._events_queue)
        return offsets.latest

    async def _emit(self, kind: str, **fields: Any) -> int:
        """Tell the other gateways: an :class:`Event` from this one appended to
        ``$mqtt.events``; returns its offset there."""
        assert self.peers is not None
        event = Event(kind=kind, origin=self.peers.self_id, **fields)
        message = encode_event(event, self.processor.clock.now_ms())
        request = AppendRequest(entry=message, queues=(self._events_queue,))
        (result,) = await self.processor.append(self.caller, [request], metered=False)
        return result.placements[0].offset if result.placements else 0

    async def _follow_events(self, offset: int) -> None:
        assert self.peers is not None
        me = self.peers.self_id
        while True:
            try:
                result = await self.processor.read(
                    self.caller,
                    self._events_queue,
                    offset,
                    max_messages=256,
                    wait_ms=_EVENTS_WAIT_MS,
                    metered=False,
                )
            except OffsetOutOfRange as e:
                offset = e.earliest if offset < e.earliest else e.latest
                continue
            except StorageError as e:
                log.warning("mqtt: following the events of %s: %s", self.namespace, e)
                await asyncio.sleep(1.0)
                continue
            offset = result.next_offset
            for stored in result.messages:
                event = decode_event(stored.message)
                # Before applying: what _apply changes in the index, it changes before
                # its first await (a publish meanwhile is routed by it).
                self._applied = stored.offset + 1
                if event is not None and event.origin != me:
                    try:
                        await self._apply(event)
                    except StorageError as e:
                        log.warning("mqtt: applying %s of %s: %s", event.kind, event.client, e)
                    except Exception:  # one bad record must not stop the gateway following
                        log.exception("mqtt: applying %s of %s failed", event.kind, event.client)

    async def _apply(self, event: Event) -> None:
        if event.kind == "session":
            await self._adopt(event.client, event.record)
        elif event.kind == "gone":
            session = self.sessions.get(event.client)
            if (
                session is not None
                and session.owner is None
                and session.incarnation == event.incarnation
            ):
                self._forget(session)
        elif event.kind == "attach":
            spawn(self._let_go(event))  # closing a connection must not hold the others up
        elif event.kind == "released":
            waiting = self._releases.pop(event.nonce, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    async def _let_go(self, event: Event) -> None:
        """A client connected to another gateway: close its connection here (taken
        over; ending it saves the session), then answer if asked to."""
        assert self.peers is not None
        session = self.sessions.get(event.client)
        if session is not None and session.owner is not None:
            await session.owner.take_over()
        if event.host == self.peers.self_id:
            await self._emit("released", client=event.client, nonce=event.nonce)

    async def _claim(self, client_id: str) -> None:
        """Take the session over from the gateway serving it (v5 0x8E there): tell
        every gateway, wait (a while: it may be dead) for the one named in the record
        to save and let go, then read the session as storage has it."""
        assert self.peers is not None
        me = self.peers.self_id
        record = await self.processor.meta_get(self.caller, _SESSION_KIND, client_id)
        host = record.get("gateway") if record else None
        nonce = ""
        waiting: asyncio.Future[None] | None = None
        if host is not None and host != me and host in self.peers.alive():
            nonce = uuid.uuid4().hex
            waiting = self._releases[nonce] = asyncio.get_running_loop().create_future()
        await self._emit("attach", client=client_id, host=host, nonce=nonce)
        if waiting is not None:
            try:
                async with asyncio.timeout(_RELEASE_WAIT_S):
                    await waiting
            except TimeoutError:
                log.warning("mqtt %s: gateway %s did not let the session go", client_id, host)
            finally:
                self._releases.pop(nonce, None)
            record = await self.processor.meta_get(self.caller, _SESSION_KIND, client_id)
        await self._adopt(client_id, record)

    async def _adopt(self, client_id: str, record: dict[str, Any] | None) -> None:
        """Make this gateway's view of a session it does not serve the record's: its
        subscriptions route publishes made here into its queue."""
        session = self.sessions.get(client_id)
        if session is not None and session.owner is not None:
            return  # served here: the record is this gateway's own
        if session is not None and (
            record is None or session.incarnation != record.get("incarnation")
        ):
            self._forget(session)
            session = None
        if record is None:
            return
        fresh = self._session_from(client_id, record)
        if session is None:
            session = self.sessions[client_id] = fresh
        else:
            session.expiry_s = fresh.expiry_s
            session.queue = fresh.queue
            session.inbound_qos2 = fresh.inbound_qos2
            session.outbound_pubrel = fresh.outbound_pubrel
            session.release_epoch = fresh.release_epoch
        _cancel_timers(session)  # resumed elsewhere: no expiry, no will here
        # The index changes at once, with no await in between: a publish stamped with
        # this event as applied must have been routed by it (see _route_peer).
        wanted = {f: SubOptions.from_json(o) for f, o in record["subs"].items()}
        for topic_filter in list(session.subscriptions):
            if topic_filter not in wanted:
                self._index_remove(session, topic_filter, drop_group=False)
        to_tail = []
        for topic_filter, options in wanted.items():
            if session.subscriptions.get(topic_filter) != options:
                to_tail.append(self._index_put(session, topic_filter, options))
        for inner, new in to_tail:
            if new:
                await self._count_tail(inner)
        gone_ms = record.get("disconnected_ms")
        if gone_ms is not None and session.queue is not None:
            now = self.processor.clock.now_ms()
            self._schedule_expiry(session, _expiry_left_ms(session.expiry_s, gone_ms, now))

    async def _expire(self, session: Session) -> None:
        """Several gateways: expire a session only if storage agrees it is still the
        same one, offline, and past its expiry (another gateway may have resumed it)."""
        record = await self.processor.meta_get(self.caller, _SESSION_KIND, session.client_id)
        if self.sessions.get(session.client_id) is not session or session.owner is not None:
            return
        gone_ms = record.get("disconnected_ms") if record else None
        if record is None or record.get("incarnation") != session.incarnation or gone_ms is None:
            await self._adopt(session.client_id, record)
            return
        left_ms = _expiry_left_ms(session.expiry_s, gone_ms, self.processor.clock.now_ms())
        if left_ms is not None and left_ms > 0:
            self._schedule_expiry(session, left_ms)
            return
        await self._discard(session)

    # -- QoS 2 in: exactly once across crashes ------------------------------------

    @staticmethod
    def qos2_dedup_key(session: Session, packet_id: int) -> str:
        """The storage dedup key of a QoS 2 PUBLISH (the engine's dedup window
        survives a crash, so a resend after one is not stored again).

        The key names the session's incarnation (a new session of the same client id
        is a new one), the packet id, and the release epoch the packet id arrived in:
        the count of PUBRELs handled, which is saved before each PUBCOMP. A resend
        gets the same key: either its packet id is still known with its epoch, or
        (after a crash) no PUBREL was answered since it arrived, so the saved epoch is
        the one it arrived in. A packet id reused after PUBCOMP gets a later epoch."""
        epoch = session.inbound_qos2.get(packet_id, session.release_epoch)
        return f"mqtt.qos2/{session.client_id}/{session.incarnation}/{packet_id}/{epoch}"

    async def release_qos2(self, session: Session, packet_ids: list[int]) -> list[bool]:
        """PUBRELs: forget their packet ids and move to the next release epoch, saved
        (for persistent sessions) before the PUBCOMPs go out. Returns, per packet id,
        whether it was known (v5 3.7.2.1)."""
        known = [session.inbound_qos2.pop(pid, None) is not None for pid in packet_ids]
        session.release_epoch += 1
        if session.queue is not None:  # the others read it from storage when they need it
            await self._save(session, disconnected_ms=None, announce=False)
        return known

    # -- subscriptions -------------------------------------------------------------

    async def subscribe(self, session: Session, topic_filter: str, options: SubOptions) -> bool:
        """Add or replace a subscription; True if it is new (retain handling 1). A
        persistent session keeps it once :meth:`save_subscriptions` ran."""
        new = topic_filter not in session.subscriptions
        if not new and split_shared(topic_filter) is not None:
            session.subscriptions[topic_filter] = options  # stays a member: keep the queue
            return False
        if not new:
            self._index_remove(session, topic_filter)
        await self._index_add(session, topic_filter, options)
        if self.peers is not None and new:
            session.fresh.add(topic_filter)
        return new

    def unsubscribe(self, session: Session, topic_filter: str) -> bool:
        if topic_filter not in session.subscriptions:
            return False
        self._index_remove(session, topic_filter)
        return True

    async def save_subscriptions(self, session: Session) -> None:
        """Store a persistent session's subscriptions: once per SUBSCRIBE or
        UNSUBSCRIBE packet, however many filters it names."""
        if session.queue is not None:
            await self._save(session, disconnected_ms=None)
        elif self.peers is not None:  # shared groups must be known where it is published
            await self._announce(session, self._record(session, None))

    async def _index_add(self, session: Session, topic_filter: str, options: SubOptions) -> None:
        session.subscriptions[topic_filter] = options
        shared = split_shared(topic_filter)
        if shared is None:
            self.index.add(topic_filter, session.client_id, (session, options))
        else:
            group = self.shared.get(shared) or await self._new_group(*shared)
            group.members[session.client_id] = session
        # Only now: the tail routes as soon as it starts, and must find this entry.
        await self._count_tail(shared[1] if shared else topic_filter)

    def _index_put(
        self, session: Session, topic_filter: str, options: SubOptions
    ) -> tuple[str, bool]:
        """Another gateway's subscription into the index, at once (its shared queue
        exists: that gateway made it). Returns the filter to tail, and whether it is
        new here (its tail is to be counted)."""
        new = topic_filter not in session.subscriptions
        session.subscriptions[topic_filter] = options
        shared = split_shared(topic_filter)
        if shared is None:
            self.index.add(topic_filter, session.client_id, (session, options))
            return topic_filter, new
        group = self.shared.get(shared) or self._put_group(*shared)
        group.members[session.client_id] = session
        return shared[1], new

    def _index_remove(
        self, session: Session, topic_filter: str, *, drop_group: bool = True
    ) -> None:
        if session.subscriptions.pop(topic_filter, None) is None:
            return
        session.announced_at.pop(topic_filter, None)
        shared = split_shared(topic_filter)
        self._uncount_tail(shared[1] if shared else topic_filter)
        if shared is None:
            self.index.remove(topic_filter, session.client_id)
            return
        group = self.shared.get(shared)
        if group is not None:
            group.members.pop(session.client_id, None)
            if not group.members:
                self._drop_group(shared, group, drop_queue=drop_group)

    async def _new_group(self, name: str, inner: str) -> SharedGroup:
        queue = QueueRef(self.namespace, _queue_topic(_SHARED_PREFIX, f"{name}/{inner}"), 0)
        dropping = self._dropping.get(queue.topic)
        if dropping is not None:  # the group's last member just left: a new queue
            await asyncio.shield(dropping)
        await self.ensure_topic(queue.topic)
        # another member may have made it meanwhile
        return self.shared.get((name, inner)) or self._put_group(name, inner)

    def _put_group(self, name: str, inner: str) -> SharedGroup:
        queue = QueueRef(self.namespace, _queue_topic(_SHARED_PREFIX, f"{name}/{inner}"), 0)
        group = self.shared[(name, inner)] = SharedGroup(name=name, filter=inner, queue=queue)
        self.index.add(inner, ("$share", name), group)
        return group

    def _drop_group(
        self, key: tuple[str, str], group: SharedGroup, *, drop_queue: bool = True
    ) -> None:
        """The last member left (unsubscribed, or its session ended): the group is
        gone, and its queue with what waited in it (no subscription, no message).
        Members of a persistent session that is only offline stay members."""
        del self.shared[key]
        self.index.remove(group.filter, ("$share", group.name))
        topic = group.queue.topic
        self._topics.discard(topic)
        if not drop_queue:
            return

        async def delete() -> None:
            try:
                with contextlib.suppress(TopicNotFound):
                    await self.processor.delete_topic(self.caller, topic)
            except StorageError as e:
                log.warning("mqtt: deleting shared queue %s: %s", topic, e)
            finally:
                if self._dropping.get(topic) is task:
                    del self._dropping[topic]

        task = asyncio.get_running_loop().create_task(delete())
        self._dropping[topic] = task

    async def _drop_orphan_groups(self) -> None:
        """Shared queues no restored session is a member of (left behind by a crash
        or an older version) are deleted when the broker loads."""
        used = {group.queue.topic for group in self.shared.values()}
        try:
            for info in await self.processor.list_topics(self.caller, include_internal=True):
                if info.name.startswith(_SHARED_PREFIX) and info.name not in used:
                    with contextlib.suppress(TopicNotFound):
                        await self.processor.delete_topic(self.caller, info.name)
        except StorageError as e:  # not worth refusing connections for: next load
            log.warning("mqtt: removing unused shared queues of %s: %s", self.namespace, e)

    # -- messages from other protocols -------------------------------------------

    async def _count_tail(self, topic_filter: str) -> None:
        """Keep a tail on the storage topic a filter's literal first level names, or
        on every storage topic of the namespace for a filter starting with a
        wildcard."""
        first = topic_filter.split("/", 1)[0]
        if first in ("+", "#"):
            self._wild_refs += 1
            if self._discovery is None or self._discovery.done():
                self._discovered.clear()
                self._discovery = asyncio.get_running_loop().create_task(self._discover())
            await self._discovered.wait()
            return
        topic = storage_topic(topic_filter)
        self._tail_refs[topic] = self._tail_refs.get(topic, 0) + 1
        await self._tail(topic).ready()

    def _tail(self, topic: str, *, from_start: bool = False) -> TopicTail:
        tail = self._tails.get(topic)
        if tail is None or tail.done():

            def wanted() -> bool:
                return topic in self._tail_refs or (self._wild_refs > 0 and _public(topic))

            async def route(stored: list[StoredMessage], live: bool) -> None:
                if self.peers is None:
                    await self._route_foreign(topic, stored, live=live)
                else:
                    await self._route_tailed(topic, stored, live=live)

            peers = self.peers
            tail = TopicTail(
                self.processor,
                self.caller,
                topic,
                route,
                wanted,
                from_start=from_start,
                # Several gateways: each follows for its own clients, at its own position.
                group=TAIL_GROUP if peers is None else f"{TAIL_GROUP}.{peers.self_id}",
                keep=None if peers is None else self._not_ours,
            )
            self._tails[topic] = tail
            tail.start()
        return tail

    async def _discover(self) -> None:
        """While some filter starts with a wildcard, tail every storage topic of the
        namespace (not ``$`` ones, which wildcards do not match, v5 4.7.2): listed
        every few seconds, so an append costs nothing more. A topic found after the
        first listing is new, and is tailed from its start."""
        first = True
        try:
            while self._wild_refs > 0:
                try:
                    names = [t.name for t in await self.processor.list_topics(self.caller)]
                except StorageError as e:
                    log.warning("mqtt: listing the topics of %s: %s", self.namespace, e)
                    names = []
                tails = [self._tail(n, from_start=not first) for n in names if _public(n)]
                for tail in tails:
                    await tail.ready()
                first = False
                self._discovered.set()
                await asyncio.sleep(_DISCOVER_S)
        finally:
            self._discovered.set()  # a subscriber never waits for a discovery that ended

    def _uncount_tail(self, topic_filter: str) -> None:
        if topic_filter.split("/", 1)[0] in ("+", "#"):
            self._wild_refs -= 1
            return
        topic = storage_topic(topic_filter)
        refs = self._tail_refs.get(topic, 0) - 1
        if refs > 0:
            self._tail_refs[topic] = refs
        else:
            self._tail_refs.pop(topic, None)

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
        copy = self.peers is None or self.peers.owns(topic)
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
        if requests:  # copies of what its producer was metered for already
            await self.processor.append(self.caller, requests, metered=False)
        if live:
            for owner, delivery in memory:
                owner.deliver(delivery)
        if copy:
            for owner in woken:
                owner.wake()

    def _not_ours(self, stored: StoredMessage) -> bool:
        """What a gateway's tail routes: other protocols' messages, and MQTT publishes
        another gateway stored (for this gateway's online clients)."""
        assert self.peers is not None
        if not from_mqtt(stored):
            return True
        stamp = stamp_of(stored)
        return stamp is None or stamp[0] != self.peers.self_id

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
        for owner, delivery in memory:
            owner.deliver(delivery)
        if requests:
            await self.processor.append(self.caller, requests, metered=False)

    def _missed(self, item: Outgoing, applied: int) -> list[QueueRef]:
        """Queues of persistent sessions the publishing gateway did not route ``item``
        to: every filter of theirs matching it was subscribed here and announced at or
        after the events offset that gateway had applied when it stored the item
        (``applied``, from its stamp). Only the gateway that announced those filters
        knows that, so it alone makes the copy: exactly once."""
        if item.qos == 0:
            return []
        missed: list[QueueRef] = []
        for _, value in self.index.match(item.topic):
            if isinstance(value, SharedGroup):
                continue
            session, options = value
            queue = session.queue
            if queue is None or not session.announced_at:
                continue
            if queue in missed or (options.no_local and session.client_id == item.publisher):
                continue
            matching = [
                (f, o.qos)
                for f, o in session.subscriptions.items()
                if split_shared(f) is None and filter_matches(f, item.topic)
            ]
            unknown = all(session.announced_at.get(f, -1) >= applied for f, _ in matching)
            if matching and unknown and any(qos > 0 for _, qos in matching):
                missed.append(queue)
        return missed

    async def close(self) -> None:
        """Stop timers and tails (server stop): storage closes next."""
        for session in self.sessions.values():
            _cancel_timers(session)
        events, self._events_task = self._events_task, None
        if events is not None:
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await events
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await discovery
        for task in list(self._dropping.values()):
            with contextlib.suppress(BaseException):
                await task
        tails = list(self._tails.values())
        self._tails.clear()
        for tail in tails:
            await tail.stop()

    def follows(self, client_id: str, topic_filter: str) -> bool:
        """Whether this gateway routes what is published to ``topic_filter`` for
        ``client_id``'s subscription, its tail included (the admin view, tests)."""
        session = self.sessions.get(client_id)
        if session is None or topic_filter not in session.subscriptions:
            return False
        shared = split_shared(topic_filter)
        inner = shared[1] if shared else topic_filter
        if inner.split("/", 1)[0] in ("+", "#"):
            return self._discovered.is_set()
        tail = self._tails.get(storage_topic(inner))
        return tail is not None and tail.is_ready()

    def shared_queues(self, session: Session) -> list[tuple[QueueRef, SubOptions]]:
        found = []
        for topic_filter, options in session.subscriptions.items():
            shared = split_shared(topic_filter)
            if shared is not None and shared in self.shared:
                found.append((self.shared[shared].queue, options))
        return found

    def session_grant(self, session: Session, topic: str) -> tuple[int, list[int], bool] | None:
        """For a message from the session's queue: the best QoS, the subscription ids
        and retain-as-published of its plain subscriptions matching ``topic``, or
        ``None`` if none still does."""
        qos = -1
        ids: list[int] = []
        rap = False
        for topic_filter, options in session.subscriptions.items():
            if split_shared(topic_filter) is None and filter_matches(topic_filter, topic):
                qos = max(qos, options.qos)
                rap = rap or options.retain_as_published
                if options.subscription_id:
                    ids.append(options.subscription_id)
        return None if qos < 0 else (qos, ids, rap)

    # -- publishing ----------------------------------------------------------------

    async def ensure_topic(self, topic: str) -> None:
        """Create a storage topic on first use; ``InvalidName`` if none can be named so.
        Session and shared-group queues are internal: other protocols' topic listings
        leave them out."""
        if topic in self._topics:
            return
        config = _INTERNAL_TOPIC if topic.startswith(_INTERNAL_PREFIXES) else _PUBLIC_TOPIC
        with contextlib.suppress(TopicAlreadyExists):
            await self.processor.create_topic(self.caller, topic, config)
        self._topics.add(topic)

    async def publish(self, items: list[Outgoing]) -> None:
        """Hand the in-memory deliveries out, then store every item with one append
        (each dispatched to its storage topic and to every queue it reaches).

        Online clean-session subscribers do not wait for the disk: as with EMQX, what
        they get from memory is not kept for them anyway, and the publisher's ack still
        waits for the append."""
        requests = []
        memory: list[tuple[SessionOwner, Delivery]] = []
        woken: list[SessionOwner] = []
        for item in items:
            topic = storage_topic(item.topic)
            await self.ensure_topic(topic)
            if self.peers is not None:  # with no await before _route: see _route_peer
                item.message = stamped(item.message, b"%d:%s" % (self._applied, self._stamp))
            queues = [QueueRef(self.namespace, topic, 0)]
            self._route(item, queues, memory, woken)
            requests.append(
                AppendRequest(entry=item.message, queues=tuple(queues), dedup_key=item.dedup_key)
            )
        for owner, delivery in memory:
            owner.deliver(delivery)
        try:
            await self.processor.append(self.caller, requests)
        except TopicNotFound:
            await self._append_again(requests)
        self.messages_in += len(items)
        for item in items:
            if item.retain:
                await self.processor.put_latest(
                    self.caller,
                    storage_topic(item.topic),
                    item.topic.encode(),
                    item.message if item.message.body else None,
                )
        for owner in woken:
            owner.wake()

    async def _append_again(self, requests: list[AppendRequest]) -> None:
        """A topic of the append was deleted behind our back: create it again and
        retry. In the separated form a topic just created (by another gateway, or by
        a concurrent create here) may also be unknown to the routes for a moment,
        until the storage nodes' next heartbeat reaches the nameservers: a few
        retries then."""
        for attempt in range(_ROUTE_RETRIES):
            self._topics.clear()
            for request in requests:
                for queue in request.queues:
                    await self.ensure_topic(queue.topic)
            try:
                await self.processor.append(self.caller, requests)
                return
            except TopicNotFound:
                if attempt == _ROUTE_RETRIES - 1:
                    raise
                await asyncio.sleep(_ROUTE_RETRY_S)

    def _route(
        self,
        item: Outgoing,
        queues: list[QueueRef],
        memory: list[tuple[SessionOwner, Delivery]],
        woken: list[SessionOwner],
    ) -> None:
        per_session: dict[str, tuple[Session, int, list[int], bool]] = {}
        for _, value in self.index.match(item.topic):
            if isinstance(value, SharedGroup):
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
                memory.append(
                    (
                        session.owner,
                        Delivery(
                            message=item.message,
                            topic=item.topic,
                            qos=granted,
                            retain=item.retain and rap,
                            subscription_ids=ids,
                        ),
                    )
                )

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
            names = [t.name for t in await self.processor.list_topics(self.caller)]
            names = [n for n in names if not n.startswith("$")]
        else:
            names = [storage_topic(topic_filter)]
        now = self.processor.clock.now_ms()
        found = []
        for name in names:
            try:
                values = await self.processor.list_latest(self.caller, name)
            except StorageError:
                continue
            for key, message in values:
                topic = key.decode("utf-8", "replace")
                if message.expiry_ms is not None and message.expiry_ms <= now:
                    continue
                if filter_matches(topic_filter, topic):
                    found.append((topic, message))
        return found

    def stored_qos(self, message: Message) -> int:
        return published_qos(message)


def _public(topic: str) -> bool:
    """A storage topic wildcard filters reach (not ``$SYS``-like or ours)."""
    return not topic.startswith("$")


def _expiry_left_ms(expiry_s: int, gone_ms: int, now_ms: int) -> int | None:
    if expiry_s == _NEVER_EXPIRES:
        return None
    return expiry_s * 1000 - (now_ms - gone_ms)


def _inbound_from_json(raw: Any) -> dict[int, int]:
    """Saved ``[packet id, epoch]`` pairs (plain packet ids before epochs existed)."""
    pairs = (p if isinstance(p, list) else (p, 0) for p in raw)
    return {packet_id: epoch for packet_id, epoch in pairs}


def _cancel_timers(session: Session) -> None:
    for timer in session.timers:
        timer.cancel()
    session.timers.clear()


_background: set[asyncio.Task[None]] = set()


def spawn(coro: Any) -> None:
    """Run a coroutine to completion in the background, logging its failure."""
    task: asyncio.Task[None] = asyncio.ensure_future(coro)
    _background.add(task)

    def done(t: asyncio.Task[None]) -> None:
        _background.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("mqtt background task failed", exc_info=t.exception())

    task.add_done_callback(done)
