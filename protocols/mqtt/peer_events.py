"""MQTT over several gateways, the events side: following what the other gateways
announce on ``$mqtt.events`` into this gateway's view of the namespace, and taking a
session over from the gateway serving it (protocols/mqtt/peers.py has the records).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from polymq.protocols.mqtt.core import BrokerCore, cancel_and_wait
from polymq.protocols.mqtt.model import (
    SESSION_KIND,
    Session,
    SubOptions,
    cancel_timers,
    expiry_left_ms,
)
from polymq.protocols.mqtt.peers import EVENTS_TOPIC, Event, decode_event
from polymq.protocols.mqtt.sessions import Sessions
from polymq.protocols.mqtt.subscriptions import Subscriptions
from polymq.storage.errors import OffsetOutOfRange, StorageError, StorageUnavailable

__all__ = ["PeerEvents"]

log = logging.getLogger(__name__)

_EVENTS_WAIT_MS = 5_000
_RELEASE_WAIT_S = 5.0  # for the gateway serving a client that connected here to let go
_UNREAD: dict[str, Any] = {}  # a session record that could not be read (claim)


class PeerEvents:
    """This gateway's follower of ``$mqtt.events`` for one namespace."""

    def __init__(self, core: BrokerCore, sessions: Sessions, subscriptions: Subscriptions) -> None:
        self.core = core
        self.sessions = sessions
        self.subscriptions = subscriptions
        self.task: asyncio.Task[None] | None = None  # following the events
        self._releases: dict[str, asyncio.Future[None]] = {}  # attach nonce -> answer

    async def start(self) -> int:
        """Where this gateway starts following ``$mqtt.events``: taken before the
        session listing, so a change made meanwhile is both listed and followed (its
        record says it all: applying it twice is harmless)."""
        await self.core.ensure_topic(EVENTS_TOPIC)
        return await self.core.queue_latest(self.core.events_queue)

    async def _follow(self, offset: int) -> None:
        assert self.core.peers is not None
        me = self.core.peers.self_id
        while True:
            try:
                result = await self.core.processor.read(
                    self.core.caller,
                    self.core.events_queue,
                    offset,
                    max_messages=256,
                    wait_ms=_EVENTS_WAIT_MS,
                    metered=False,
                )
            except OffsetOutOfRange as e:
                offset = e.earliest if offset < e.earliest else e.latest
                continue
            except StorageError as e:
                log.warning("mqtt: following the events of %s: %s", self.core.namespace, e)
                await asyncio.sleep(1.0)
                continue
            offset = result.next_offset
            for stored in result.messages:
                event = decode_event(stored.message)
                # Before applying: what _apply changes in the index, it changes before
                # its first await (a publish meanwhile is routed by it).
                self.core.applied = stored.offset + 1
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
            session = self.core.sessions.get(event.client)
            if (
                session is not None
                and session.owner is None
                and session.incarnation == event.incarnation
            ):
                self.sessions.forget(session)
        elif event.kind == "attach":
            # closing a connection must not hold the others up
            self.core.tasks.spawn(self._let_go(event))
        elif event.kind == "released":
            waiting = self._releases.pop(event.nonce, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    async def _let_go(self, event: Event) -> None:
        """A client connected to another gateway: close its connection here (taken
        over; ending it saves the session), then answer if asked to."""
        assert self.core.peers is not None
        session = self.core.sessions.get(event.client)
        if session is not None and session.owner is not None:
            await session.owner.take_over()
        if event.host == self.core.peers.self_id:
            await self.core.emit("released", client=event.client, nonce=event.nonce)

    async def claim(self, client_id: str, *, clean: bool = False) -> None:
        """Take the session over from the gateway serving it (v5 0x8E there): tell
        every gateway, wait (a while: it may be dead) for the one named in the record
        to save and let go, then read the session as storage has it.

        ``clean``: a session that keeps nothing (clean start, no expiry). While the
        namespace's home node or the node of ``$mqtt.events`` is down, such a client
        still connects if this gateway knows no session of its client id: without the
        record, or without telling the others (a connection with the same client id
        on another gateway is then not taken over). Anything else needs both."""
        assert self.core.peers is not None
        me = self.core.peers.self_id
        try:
            record = await self.core.processor.meta_get(self.core.caller, SESSION_KIND, client_id)
        except StorageUnavailable as e:
            if not clean or client_id in self.core.sessions:
                raise
            log.warning("mqtt %s: connecting without its session record: %s", client_id, e)
            record = _UNREAD
        host = record.get("gateway") if record else None
        nonce = ""
        waiting: asyncio.Future[None] | None = None
        if host is not None and host != me and host in self.core.peers.alive():
            nonce = uuid.uuid4().hex
            waiting = self._releases[nonce] = asyncio.get_running_loop().create_future()
        try:
            await self.core.emit("attach", client=client_id, host=host, nonce=nonce)
        except StorageUnavailable as e:
            if waiting is not None or not clean:
                self._releases.pop(nonce, None)
                raise
            log.warning("mqtt %s: connecting without telling the other gateways: %s", client_id, e)
        if record is _UNREAD:
            return
        if waiting is not None:
            try:
                async with asyncio.timeout(_RELEASE_WAIT_S):
                    await waiting
            except TimeoutError:
                log.warning("mqtt %s: gateway %s did not let the session go", client_id, host)
            finally:
                self._releases.pop(nonce, None)
            record = await self.core.processor.meta_get(self.core.caller, SESSION_KIND, client_id)
        await self._adopt(client_id, record)

    async def _adopt(self, client_id: str, record: dict[str, Any] | None) -> None:
        """Make this gateway's view of a session it does not serve the record's: its
        subscriptions route publishes made here into its queue."""
        session = self.core.sessions.get(client_id)
        if session is not None and session.owner is not None:
            return  # served here: the record is this gateway's own
        if session is not None and (
            record is None or session.incarnation != record.get("incarnation")
        ):
            self.sessions.forget(session)
            session = None
        if record is None:
            return
        fresh = self.sessions.session_from(client_id, record)
        if session is None:
            session = self.core.sessions[client_id] = fresh
        else:
            session.expiry_s = fresh.expiry_s
            session.queue = fresh.queue
            session.inbound_qos2 = fresh.inbound_qos2
            session.outbound_pubrel = fresh.outbound_pubrel
            session.release_epoch = fresh.release_epoch
        cancel_timers(session)  # resumed elsewhere: no expiry, no will here
        # The index changes at once, with no await in between: a publish stamped with
        # this event as applied must have been routed by it (see _route_peer).
        wanted = {f: SubOptions.from_json(o) for f, o in record["subs"].items()}
        for topic_filter in list(session.subscriptions):
            if topic_filter not in wanted:
                self.subscriptions.remove(session, topic_filter, drop_group=False)
        to_tail = []
        for topic_filter, options in wanted.items():
            if session.subscriptions.get(topic_filter) != options:
                to_tail.append(self.subscriptions.put(session, topic_filter, options))
        for inner, new in to_tail:
            if new:
                await self.subscriptions.tails.count(inner)
        gone_ms = record.get("disconnected_ms")
        if gone_ms is not None and session.queue is not None:
            now = self.core.processor.clock.now_ms()
            self.sessions.schedule_expiry(session, expiry_left_ms(session.expiry_s, gone_ms, now))

    async def expire(self, session: Session) -> None:
        """Several gateways: expire a session only if storage agrees it is still the
        same one, offline, and past its expiry (another gateway may have resumed it)."""
        core = self.core
        record = await core.processor.meta_get(core.caller, SESSION_KIND, session.client_id)
        if self.core.sessions.get(session.client_id) is not session or session.owner is not None:
            return
        gone_ms = record.get("disconnected_ms") if record else None
        if record is None or record.get("incarnation") != session.incarnation or gone_ms is None:
            await self._adopt(session.client_id, record)
            return
        left_ms = expiry_left_ms(session.expiry_s, gone_ms, self.core.processor.clock.now_ms())
        if left_ms is not None and left_ms > 0:
            self.sessions.schedule_expiry(session, left_ms)
            return
        await self.sessions.discard(session)

    def follow(self, offset: int) -> None:
        """Follow the events from ``offset`` in the background."""
        self.task = self.core.tasks.spawn(self._follow(offset))

    async def close(self) -> None:
        """Stop following (server stop)."""
        task, self.task = self.task, None
        await cancel_and_wait(task)
