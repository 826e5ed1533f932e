"""What the MQTT broker of a namespace keeps and hands out: sessions, subscription
options, shared groups, deliveries, and the storage names of their queues.

Kept apart from the broker's parts (sessions, subscriptions, routing, tails, peer
events) so that each of them, the connection and its outbound side name the same
records without importing one another.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from polymq.protocols.mqtt.peers import EVENTS_TOPIC
from polymq.storage.model import Message, QueueRef, TopicConfig

__all__ = [
    "INTERNAL_PREFIXES",
    "NEVER_EXPIRES",
    "POP_GROUP",
    "SESSION_KIND",
    "SESSION_PREFIX",
    "SHARED_PREFIX",
    "Delivery",
    "Outgoing",
    "Session",
    "SessionOwner",
    "SharedGroup",
    "SubOptions",
    "cancel_timers",
    "expiry_left_ms",
    "inbound_from_json",
    "queue_topic",
    "topic_config",
]

POP_GROUP = "mqtt"  # the consumer group every session and shared queue is popped by
SESSION_KIND = "mqtt.session"
SESSION_PREFIX = "$mqtt.session."
SHARED_PREFIX = "$mqtt.share."
INTERNAL_PREFIXES = (SESSION_PREFIX, SHARED_PREFIX, EVENTS_TOPIC)
NEVER_EXPIRES = 0xFFFFFFFF
_INTERNAL_TOPIC = TopicConfig(internal=True)
_PUBLIC_TOPIC = TopicConfig()


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


_NO_SUBSCRIPTIONS: Mapping[str, SubOptions] = MappingProxyType({})


@dataclass(slots=True, kw_only=True)
class Session:
    client_id: str
    expiry_s: int
    queue: QueueRef | None = None  # persistent sessions only
    # Filter -> options, read through :attr:`subscriptions`: made on the first
    # subscribe (None until then), since a fleet of idle connections is mostly
    # sessions that never subscribe (docs/mqtt.md, "Memory per connection").
    _subscriptions: dict[str, SubOptions] | None = field(default=None, repr=False)
    owner: SessionOwner | None = None
    # QoS 2 in (v5 4.3.3): packet id -> the release epoch it arrived in, for PUBLISHes
    # answered with PUBREC whose PUBREL has not come yet. See :meth:`qos2_dedup_key`.
    # None while empty, as ``outbound_pubrel``: nearly always, and every session has
    # them (docs/mqtt.md, "Memory per connection").
    inbound_qos2: dict[int, int] | None = None
    release_epoch: int = 0  # PUBRELs handled: a packet id reused after PUBCOMP is new
    # Which session of its client id this is (see :attr:`incarnation`): made on first
    # use, since most sessions (clean ones, on one gateway) never need one.
    _incarnation: str = field(default="", repr=False)
    # PUBREL sent, PUBCOMP awaited: packet ids as a dict's keys (values None), since
    # a dict of a few weighs less than a set.
    outbound_pubrel: dict[int, None] | None = None
    # Made on first use (None until then), as are ``fresh`` (filter -> None) and
    # ``announced_at`` below: nearly always empty, and every session would have them.
    timers: list[asyncio.TimerHandle] | None = None
    # Several gateways: the others know it (tell them it ended); filters subscribed
    # here not yet announced, and the events offset at which each one was.
    announced: bool = False
    fresh: dict[str, None] | None = None
    announced_at: dict[str, int] | None = None

    @property
    def subscriptions(self) -> Mapping[str, SubOptions]:
        """Filter -> options (read-only: :meth:`set_subscription`,
        :meth:`pop_subscription` and :meth:`clear_subscriptions` change it)."""
        subscriptions = self._subscriptions
        return _NO_SUBSCRIPTIONS if subscriptions is None else subscriptions

    def set_subscription(self, topic_filter: str, options: SubOptions) -> None:
        if self._subscriptions is None:
            self._subscriptions = {}
        self._subscriptions[topic_filter] = options

    def pop_subscription(self, topic_filter: str) -> SubOptions | None:
        """The filter's options, removed (the dict too, once empty); ``None`` if it
        was not subscribed."""
        subscriptions = self._subscriptions
        if subscriptions is None:
            return None
        options = subscriptions.pop(topic_filter, None)
        if not subscriptions:
            self._subscriptions = None
        return options

    def clear_subscriptions(self) -> None:
        self._subscriptions = None

    @property
    def incarnation(self) -> str:
        if not self._incarnation:
            self._incarnation = uuid.uuid4().hex[:12]
        return self._incarnation

    @incarnation.setter
    def incarnation(self, value: str) -> None:
        self._incarnation = value

    def qos2_arrived(self, packet_id: int) -> None:
        """A QoS 2 PUBLISH stored and answered with PUBREC (kept until its PUBREL)."""
        if self.inbound_qos2 is None:
            self.inbound_qos2 = {}
        self.inbound_qos2.setdefault(packet_id, self.release_epoch)

    def qos2_known(self, packet_id: int) -> bool:
        return self.inbound_qos2 is not None and packet_id in self.inbound_qos2

    def qos2_released(self, packet_id: int) -> bool:
        """Its PUBREL came: forgotten. Whether it was known."""
        inbound = self.inbound_qos2
        if inbound is None or inbound.pop(packet_id, None) is None:
            return False
        if not inbound:
            self.inbound_qos2 = None
        return True

    def pubrel_sent(self, packet_id: int) -> None:
        if self.outbound_pubrel is None:
            self.outbound_pubrel = {}
        self.outbound_pubrel[packet_id] = None

    def pubcomp_received(self, packet_id: int) -> None:
        outbound = self.outbound_pubrel
        if outbound is not None:
            outbound.pop(packet_id, None)
            if not outbound:
                self.outbound_pubrel = None


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
    dedup_key: str | None = None  # QoS 2 in: see MqttBroker.qos2_dedup_key


def queue_topic(prefix: str, name: str) -> str:
    """A storage topic name for a session or shared queue: readable when it fits,
    else a digest (storage names stop at 255 bytes)."""
    topic = prefix + name
    if len(topic.encode()) <= 200 and all(c >= " " and c != "\x7f" for c in topic):
        return topic
    return prefix + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def topic_config(topic: str) -> TopicConfig:
    """Session and shared-group queues are internal: other protocols' topic listings
    leave them out."""
    return _INTERNAL_TOPIC if topic.startswith(INTERNAL_PREFIXES) else _PUBLIC_TOPIC


def expiry_left_ms(expiry_s: int, gone_ms: int, now_ms: int) -> int | None:
    if expiry_s == NEVER_EXPIRES:
        return None
    return expiry_s * 1000 - (now_ms - gone_ms)


def inbound_from_json(raw: Any) -> dict[int, int]:
    """Saved ``[packet id, epoch]`` pairs (plain packet ids before epochs existed)."""
    pairs = (p if isinstance(p, list) else (p, 0) for p in raw)
    return {packet_id: epoch for packet_id, epoch in pairs}


def cancel_timers(session: Session) -> None:
    timers, session.timers = session.timers, None
    for timer in timers or ():
        timer.cancel()
