"""The sessions of one namespace: bound to connections, kept in storage while they
persist, expired, and their QoS 2 state (exactly once across crashes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polymq.protocols.mqtt.core import BrokerCore
from polymq.protocols.mqtt.model import (
    SESSION_KIND,
    SESSION_PREFIX,
    Session,
    SessionOwner,
    SubOptions,
    cancel_timers,
    expiry_left_ms,
    inbound_from_json,
    queue_topic,
)
from polymq.protocols.mqtt.subscriptions import Subscriptions
from polymq.storage.errors import StorageError, StorageUnavailable
from polymq.storage.model import QueueRef

if TYPE_CHECKING:  # the events make sessions of other gateways' records (one layer)
    from polymq.protocols.mqtt.peer_events import PeerEvents

__all__ = ["Sessions"]

log = logging.getLogger(__name__)


class Sessions:
    """The namespace's sessions; with several gateways, ``peer_events`` (set by the
    broker) claims a session from the gateway serving it and checks an expiry."""

    def __init__(self, core: BrokerCore, subscriptions: Subscriptions) -> None:
        self.core = core
        self.subscriptions = subscriptions
        self.peer_events: PeerEvents | None = None
        self._ending: dict[str, asyncio.Future[None]] = {}  # sessions being removed

    async def restore(self) -> None:
        """The namespace's persistent sessions as storage has them; those that
        expired while the server was down are removed."""
        core = self.core
        now = core.processor.clock.now_ms()
        saved = await core.processor.meta_list(core.caller, SESSION_KIND)
        for client_id, raw in saved.items():
            session = self.session_from(client_id, raw)
            gone_ms = raw.get("disconnected_ms") or now
            left_ms = expiry_left_ms(session.expiry_s, gone_ms, now)
            if left_ms is not None and left_ms <= 0:
                await self.discard(session)
                continue
            core.sessions[client_id] = session
            for topic_filter, options in raw["subs"].items():
                await self.subscriptions.add(session, topic_filter, SubOptions.from_json(options))
            self.schedule_expiry(session, left_ms)

    def session_from(self, client_id: str, raw: dict[str, Any]) -> Session:
        """A session as its saved record describes it, without its subscriptions."""
        queue = raw.get("queue")
        session = Session(
            client_id=client_id,
            expiry_s=raw["expiry_s"],
            queue=QueueRef(self.core.namespace, queue) if queue else None,
            inbound_qos2=inbound_from_json(raw.get("qos2_in", ())) or None,
            outbound_pubrel=dict.fromkeys(raw.get("qos2_out", ())) or None,
            release_epoch=raw.get("release_epoch", 0),
        )
        if "incarnation" in raw:
            session.incarnation = raw["incarnation"]
        return session

    async def attach(
        self, owner: SessionOwner, client_id: str, *, clean_start: bool, expiry_s: int
    ) -> tuple[Session, bool]:
        """Bind ``client_id``'s session to a new connection, taking it over from an
        old one; returns the session and whether it existed (CONNACK session present)."""
        ending = self._ending.get(client_id)
        if ending is not None:
            await ending  # the client's expired session is still being removed
        old = self.core.sessions.get(client_id)
        if old is not None and old.owner is not None:
            await old.owner.take_over()
            old = self.core.sessions.get(client_id)  # the old connection may have ended it
        if self.peer_events is not None:  # from whichever gateway serves it now
            await self.peer_events.claim(client_id, clean=clean_start and expiry_s == 0)
            old = self.core.sessions.get(client_id)
        if old is not None:
            cancel_timers(old)
            if clean_start:
                await self.discard(old)
                old = None
        if old is None:
            session = Session(client_id=client_id, expiry_s=expiry_s)
            if expiry_s > 0:
                session.queue = QueueRef(
                    self.core.namespace, queue_topic(SESSION_PREFIX, client_id), 0
                )
                await self.core.ensure_topic(session.queue.topic)
            self.core.sessions[client_id] = session
            present = False
        else:
            session, present = old, True
            session.expiry_s = expiry_s
        session.owner = owner
        if session.queue is not None:
            await self.save(session, disconnected_ms=None)
        return session, present

    async def detach(self, session: Session, owner: SessionOwner) -> None:
        """The connection ended: keep the session until it expires, or end it now."""
        if session.owner is not owner:
            return  # taken over: the session belongs to the new connection
        session.owner = None
        for group in self.core.shared.values():
            if session.client_id in group.members:
                for other in group.members.values():
                    if other.owner is not None:
                        other.owner.wake()  # what this member held is visible again
        if session.expiry_s == 0 or session.queue is None:
            await self.discard(session)
            return
        await self.save(session, disconnected_ms=self.core.processor.clock.now_ms())
        if session.owner is None:  # not resumed by a new connection meanwhile
            self.schedule_expiry(session, expiry_left_ms(session.expiry_s, 0, 0))

    def schedule(self, session: Session, delay_s: float, action: Callable[[], object]) -> None:
        """Run ``action`` after ``delay_s`` unless the session is resumed first."""
        if session.timers is None:
            session.timers = []
        session.timers.append(asyncio.get_running_loop().call_later(delay_s, action))

    def schedule_expiry(self, session: Session, left_ms: int | None) -> None:
        if left_ms is None:
            return

        def expire() -> None:
            if session.owner is None and self.core.sessions.get(session.client_id) is session:
                events = self.peer_events
                self.core.tasks.spawn(
                    self.discard(session) if events is None else events.expire(session)
                )

        self.schedule(session, left_ms / 1000, expire)

    async def discard(self, session: Session) -> None:
        core = self.core
        self.forget(session, drop_groups=True)
        if core.peers is not None and session.announced:
            with contextlib.suppress(StorageError):  # the others check storage too
                await core.emit("gone", client=session.client_id, incarnation=session.incarnation)
        if session.queue is not None:
            # A new session of the same client id waits for this (its queue has the
            # same name): see attach.
            done = asyncio.get_running_loop().create_future()
            self._ending[session.client_id] = done
            try:
                core.topics.discard(session.queue.topic)
                await core.processor.meta_delete(core.caller, SESSION_KIND, session.client_id)
                await core.delete_topic(session.queue.topic)
            finally:
                if self._ending.get(session.client_id) is done:
                    del self._ending[session.client_id]
                done.set_result(None)

    def forget(self, session: Session, *, drop_groups: bool = False) -> None:
        """Drop the session from this gateway's view (storage is the caller's). Only
        the gateway ending a session deletes the shared queues it leaves empty."""
        cancel_timers(session)
        if self.core.sessions.get(session.client_id) is session:
            del self.core.sessions[session.client_id]
        for topic_filter in list(session.subscriptions):
            self.subscriptions.remove(session, topic_filter, drop_group=drop_groups)
        session.clear_subscriptions()

    def record(self, session: Session, disconnected_ms: int | None) -> dict[str, Any]:
        peers = self.core.peers
        serving = peers.self_id if peers is not None and disconnected_ms is None else None
        return {
            "expiry_s": session.expiry_s,
            "queue": session.queue.topic if session.queue is not None else None,
            "subs": {f: o.to_json() for f, o in session.subscriptions.items()},
            "disconnected_ms": disconnected_ms,
            # QoS 2 flows in progress. The release epoch is saved before every
            # PUBCOMP (see qos2_dedup_key); the rest when the client leaves.
            "qos2_in": sorted((session.inbound_qos2 or {}).items()),
            "qos2_out": sorted(session.outbound_pubrel or ()),
            "release_epoch": session.release_epoch,
            "incarnation": session.incarnation,
            "gateway": serving,  # several gateways: the one serving it, if any
        }

    async def save(
        self, session: Session, *, disconnected_ms: int | None, announce: bool = True
    ) -> None:
        assert session.queue is not None
        record = self.record(session, disconnected_ms)
        core = self.core
        await core.processor.meta_put(core.caller, SESSION_KIND, session.client_id, record)
        if announce and core.peers is not None:
            await self.announce(session, record)

    async def announce(self, session: Session, record: dict[str, Any]) -> None:
        assert self.core.peers is not None
        session.announced = True
        fresh, session.fresh = session.fresh, None
        offset = await self.core.emit("session", client=session.client_id, record=record)
        for topic_filter in fresh or ():
            if topic_filter in session.subscriptions:
                if session.announced_at is None:
                    session.announced_at = {}
                session.announced_at[topic_filter] = offset

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
        inbound = session.inbound_qos2
        epoch = inbound.get(packet_id, session.release_epoch) if inbound else session.release_epoch
        return f"mqtt.qos2/{session.client_id}/{session.incarnation}/{packet_id}/{epoch}"

    async def release_qos2(self, session: Session, packet_ids: list[int]) -> list[bool]:
        """PUBRELs: forget their packet ids and move to the next release epoch, saved
        (for persistent sessions) before the PUBCOMPs go out. Returns, per packet id,
        whether it was known (v5 3.7.2.1)."""
        known = [session.qos2_released(pid) for pid in packet_ids]
        session.release_epoch += 1
        if session.queue is not None:  # the others read it from storage when they need it
            await self.save(session, disconnected_ms=None, announce=False)
        return known

    async def save_subscriptions(self, session: Session) -> None:
        """Store a persistent session's subscriptions: once per SUBSCRIBE or
        UNSUBSCRIBE packet, however many filters it names."""
        if session.queue is not None:
            await self.save(session, disconnected_ms=None)
        elif self.core.peers is not None:  # shared groups must be known where it is published
            try:
                await self.announce(session, self.record(session, None))
            except StorageUnavailable as e:
                if self.subscriptions.shared_queues(session):
                    raise
                # Its plain subscriptions are served by this gateway's tails: the
                # others learn of it from its next event.
                log.warning("mqtt %s: subscriptions not announced: %s", session.client_id, e)

    def close(self) -> None:
        """Stop the sessions' timers (server stop)."""
        for session in self.core.sessions.values():
            cancel_timers(session)
