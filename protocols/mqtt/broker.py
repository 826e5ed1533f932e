"""One namespace's MQTT world: sessions, the subscription index, retained messages and
the routing of a publish to storage and to subscribers.

:class:`MqttBroker` is what connections use; it delegates to the parts, each in its
own module and each holding the shared :class:`~protocols.mqtt.core.BrokerCore`:
sessions (protocols/mqtt/sessions.py), subscriptions and shared groups
(subscriptions.py), routing (routing.py), the tails of storage topics (tails.py) and,
with several gateways, the events the gateways tell each other (peer_events.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mqtt.core import BrokerCore, IndexEntry
from polymq.protocols.mqtt.mapping import published_qos
from polymq.protocols.mqtt.model import (
    POP_GROUP,
    Delivery,
    Outgoing,
    Session,
    SessionOwner,
    SharedGroup,
    SubOptions,
)
from polymq.protocols.mqtt.peer_events import PeerEvents
from polymq.protocols.mqtt.peers import Peers
from polymq.protocols.mqtt.repairs import Repairs
from polymq.protocols.mqtt.routing import Routed, Router
from polymq.protocols.mqtt.sessions import Sessions
from polymq.protocols.mqtt.subscriptions import Subscriptions
from polymq.protocols.mqtt.tails import Tails
from polymq.protocols.mqtt.topic_filter_index import TopicFilterIndex
from polymq.storage.errors import StorageError
from polymq.storage.model import GroupConfig, Message, QueueRef

__all__ = [
    "POP_GROUP",
    "Delivery",
    "MqttBroker",
    "Outgoing",
    "Session",
    "SessionOwner",
    "SharedGroup",
    "SubOptions",
]

_T = TypeVar("_T")


class MqttBroker:
    """Sessions and routing for one namespace. Build with :meth:`load`; :meth:`close`
    stops every timer, tail and background task it started."""

    def __init__(self, processor: Processor, namespace: str, peers: Peers | None = None) -> None:
        self.core = BrokerCore(processor, namespace, peers)
        self._repairs = Repairs(self.core)
        self._router = Router(self.core, self._repairs)
        self._tails = Tails(self.core, self._router)
        self._subscriptions = Subscriptions(self.core, self._tails)
        self._sessions = Sessions(self.core, self._subscriptions)
        # Several gateways (None in the merged form): see protocols/mqtt/peers.py.
        self.peer_events: PeerEvents | None = None
        if peers is not None:
            self.peer_events = PeerEvents(self.core, self._sessions, self._subscriptions)
            self._sessions.peer_events = self.peer_events

    @classmethod
    async def load(
        cls, processor: Processor, namespace: str, peers: Peers | None = None
    ) -> MqttBroker:
        """The broker with the namespace's persistent sessions restored from storage;
        those that expired while the server was down are removed. With ``peers``, it
        then follows what the other gateways announce from the point it listed."""
        broker = cls(processor, namespace, peers)
        await processor.set_group_config(
            broker.caller, POP_GROUP, GroupConfig(max_delivery_attempts=None, dead_letter=False)
        )
        events = broker.peer_events
        events_from = await events.start() if events is not None else 0
        broker.core.applied = events_from
        await broker._sessions.restore()
        if events is None:
            await broker._subscriptions.drop_orphan_groups()
        else:  # a shared queue may have members that only another gateway knows
            events.follow(events_from)
        return broker

    async def close(self) -> None:
        """Stop timers, tails and background tasks (server stop): storage closes next."""
        self._sessions.close()
        if self.peer_events is not None:
            await self.peer_events.close()
        await self._subscriptions.close()
        await self._tails.close()
        await self._repairs.close()
        await self.core.tasks.close()

    # -- the shared state ----------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.core.namespace

    @property
    def processor(self) -> Processor:
        return self.core.processor

    @property
    def caller(self) -> Caller:
        return self.core.caller

    @property
    def peers(self) -> Peers | None:
        return self.core.peers

    @property
    def sessions(self) -> dict[str, Session]:
        return self.core.sessions

    @property
    def index(self) -> TopicFilterIndex[IndexEntry]:
        return self.core.index

    @property
    def shared(self) -> dict[tuple[str, str], SharedGroup]:
        return self.core.shared

    @property
    def messages_in(self) -> int:
        return self._router.messages_in

    def spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Run ``coro`` in the background until it ends or the broker closes."""
        return self.core.tasks.spawn(coro)

    # -- sessions ------------------------------------------------------------------

    async def attach(
        self, owner: SessionOwner, client_id: str, *, clean_start: bool, expiry_s: int
    ) -> tuple[Session, bool]:
        """Bind ``client_id``'s session to a new connection, taking it over from an
        old one; returns the session and whether it existed (CONNACK session present)."""
        return await self._sessions.attach(
            owner, client_id, clean_start=clean_start, expiry_s=expiry_s
        )

    async def detach(self, session: Session, owner: SessionOwner) -> None:
        """The connection ended: keep the session until it expires, or end it now."""
        await self._sessions.detach(session, owner)

    def schedule(self, session: Session, delay_s: float, action: Callable[[], object]) -> None:
        """Run ``action`` after ``delay_s`` unless the session is resumed first."""
        self._sessions.schedule(session, delay_s, action)

    qos2_dedup_key = staticmethod(Sessions.qos2_dedup_key)

    async def release_qos2(self, session: Session, packet_ids: list[int]) -> list[bool]:
        """PUBRELs: which packet ids were known (v5 3.7.2.1); see
        :meth:`Sessions.release_qos2`."""
        return await self._sessions.release_qos2(session, packet_ids)

    # -- subscriptions -------------------------------------------------------------

    async def subscribe(self, session: Session, topic_filter: str, options: SubOptions) -> bool:
        """Add or replace a subscription; True if it is new (retain handling 1). A
        persistent session keeps it once :meth:`save_subscriptions` ran."""
        return await self._subscriptions.subscribe(session, topic_filter, options)

    def unsubscribe(self, session: Session, topic_filter: str) -> bool:
        return self._subscriptions.unsubscribe(session, topic_filter)

    async def save_subscriptions(self, session: Session) -> None:
        """Store a persistent session's subscriptions: once per SUBSCRIBE or
        UNSUBSCRIBE packet, however many filters it names."""
        await self._sessions.save_subscriptions(session)

    def shared_queues(self, session: Session) -> list[tuple[QueueRef, SubOptions]]:
        return self._subscriptions.shared_queues(session)

    def session_grant(self, session: Session, topic: str) -> tuple[int, list[int], bool] | None:
        """For a message from the session's queue: the best QoS, the subscription ids
        and retain-as-published of its plain subscriptions matching ``topic``, or
        ``None`` if none still does."""
        return self._subscriptions.session_grant(session, topic)

    def follows(self, client_id: str, topic_filter: str) -> bool:
        """Whether this gateway routes what is published to ``topic_filter`` for
        ``client_id``'s subscription, its tail included (the admin view, tests)."""
        return self._tails.follows(client_id, topic_filter)

    # -- publishing ----------------------------------------------------------------

    def tail_messages_read(self, topic: str) -> int:
        """What the tail of a storage topic read so far (tests, admin)."""
        return self._tails.messages_read(topic)

    async def ensure_topic(self, topic: str) -> None:
        """Create a storage topic on first use; ``InvalidName`` if none can be named so."""
        await self.core.ensure_topic(topic)

    async def publish(self, items: list[Outgoing]) -> dict[int, StorageError]:
        """Deliver from memory and store every item with one append (routing.py);
        returns the items whose storage is unavailable, by index."""
        return await self._router.publish(items)

    async def route(self, items: list[Outgoing]) -> Routed:
        """:meth:`publish`'s first half: deliver from memory, plan the append."""
        return await self._router.route(items)

    async def store(self, routed: Routed) -> dict[int, StorageError]:
        """:meth:`publish`'s second half (several routed runs may be joined)."""
        return await self._router.store(routed)

    def deliver_transient(self, topic: str, message: Message) -> None:
        """Hand a QoS 0 message to online subscribers without storing it (``$SYS``)."""
        self._router.deliver_transient(topic, message)

    async def retained(self, topic_filter: str) -> list[tuple[str, Message]]:
        """Retained messages matching a (plain) filter."""
        return await self._router.retained(topic_filter)

    def stored_qos(self, message: Message) -> int:
        return published_qos(message)
