"""What a connection sends: PUBLISH packets to the client with their packet ids,
in-flight window, topic aliases and acks, from memory or from the session's queues.

Queue-based deliveries (persistent sessions, shared subscriptions) come from a pump
that pops the queues while the in-flight window has room; PUBACK (or PUBREC) acks
them in storage; what is in flight when the connection ends is given back at once.
Writes are buffered and flushed once per loop turn, so a burst of deliveries costs
one system call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from polymq.gateway.processor import Caller
from polymq.gateway.quotas import AccountQuota
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.broker import MqttBroker
from polymq.protocols.mqtt.mapping import (
    MQTT_RETAIN,
    mqtt_topic_of,
    publish_from_message,
    published_qos,
)
from polymq.protocols.mqtt.model import POP_GROUP, Delivery, Session, SubOptions
from polymq.protocols.mqtt.options import MqttOptions
from polymq.protocols.mqtt.quota import PROTOCOL
from polymq.protocols.mqtt.services import MqttServices
from polymq.protocols.mqtt.topic_filter_index import SHARE_PREFIX
from polymq.protocols.mqtt.transport import Transport
from polymq.storage.errors import StorageError, StorageUnavailable
from polymq.storage.model import Message, QueueRef, StoredMessage

__all__ = ["Outbound"]

log = logging.getLogger(__name__)

_INVISIBLE_MS = 30_000  # a popped message not acked in this time is handed out again
_STOP_WAIT_S = 10.0  # for the pump's storage call in progress when the connection ends
_REPOLL_S = 30.0  # = the invisibility: popped messages never acked show up again
_RETRY_S = 0.5  # after a failed pop
_LONG_POLL_MS = 10_000  # several gateways: how long one waiting pop waits
_SHARED_BATCH = 4
_BACKLOG_LIMIT = 10_000  # memory deliveries waiting for window room, per connection
QOS0_DROP_BYTES = MqttOptions().qos0_drop_bytes  # the default (options.py says why)

Ack = codec.PubAck | codec.PubRec | codec.PubComp


@dataclass(slots=True)
class _InFlight:
    qos: int
    receipt: str | None
    released: bool = False  # QoS 2: PUBREC came, PUBREL sent


class Outbound:
    __slots__ = (
        "_aliases",
        "_backlog",
        "_broker",
        "_caller",
        "_clock",
        "_drop_bytes",
        "_dropping",
        "_flush_scheduled",
        "_inflight",
        "_loop",
        "_next_pid",
        "_out",
        "_pump_task",
        "_pump_wake",
        "_quota",
        "_release_task",
        "_sealed",
        "_services",
        "_session",
        "_to_ack",
        "_transport",
        "active",
        "alias_max",
        "dropped",
        "level",
        "max_packet",
        "window",
    )

    def __init__(self, services: MqttServices, transport: Transport) -> None:
        self._services = services
        self._transport = transport
        self._clock = services.clock
        # (asyncio.get_running_loop() is a system call each time: kept for the flushes)
        self._loop = asyncio.get_running_loop()
        self._drop_bytes = services.options.qos0_drop_bytes
        self._dropping = 0  # QoS 0 deliveries dropped since the last one sent
        self.dropped = 0  # all this connection dropped (for tests and the curious)
        self.level = codec.LEVEL_311
        self.active = False  # delivering: between CONNACK and the connection's end
        self.window = services.config.receive_maximum
        self.alias_max = 0  # the client's Topic Alias Maximum
        self.max_packet = 0  # the client's Maximum Packet Size (0: none)
        self._session: Session | None = None
        self._broker: MqttBroker | None = None
        self._caller: Caller | None = None
        # Created on first need and dropped once empty again: an idle connection
        # stays small (an Event or a deque costs most of a kilobyte, an empty dict,
        # list or bytearray 56-64 bytes, and servers hold tens of thousands of mostly
        # idle connections; docs/mqtt.md, "Memory per connection").
        self._inflight: dict[int, _InFlight] | None = None  # packet id -> unacked send
        self._next_pid = 1
        self._backlog: deque[Delivery] | None = None
        self._aliases: dict[str, int] | None = None  # for a client that allows them
        self._out: bytearray | None = None  # written, not yet flushed
        self._flush_scheduled = False
        self._sealed = False  # the server said goodbye: nothing more goes out
        self._to_ack: list[str] | None = None  # popped, to ack without a client's ack
        self._pump_task: asyncio.Task[None] | None = None
        self._pump_wake: asyncio.Event | None = None
        # The account's quota: over its consume rate, deliveries wait (docs/quotas.md).
        self._quota: AccountQuota | None = None
        self._release_task: asyncio.Task[None] | None = None

    def bind(self, session: Session, broker: MqttBroker, caller: Caller) -> None:
        """Start delivering for ``session``; resume its QoS 2 flows (v5 4.4)."""
        self._session, self._broker, self._caller = session, broker, caller
        self._quota = self._services.quotas.of(caller.principal)
        self.active = True
        for pid in sorted(session.outbound_pubrel or ()):
            self._fly(pid, _InFlight(2, None, released=True))
            self.write(codec.PubRel(packet_id=pid))
        self.flush()
        self.wake()

    async def stop(self) -> None:
        """Stop delivering; what was popped and not acked goes back to its queue now
        (not after the invisibility timeout), so the session's next connection, or
        another member of a shared group, gets it again, marked DUP."""
        self.active = False
        self.flush()
        if self._release_task is not None:
            self._release_task.cancel()
        task, self._pump_task = self._pump_task, None
        if task is not None:
            # Let the pump finish its storage call rather than cancel it: a pop cut
            # short after handing messages out would leave them invisible, unknown to us.
            assert self._pump_wake is not None
            self._pump_wake.set()
            _, pending = await asyncio.wait({task}, timeout=_STOP_WAIT_S)
            for late in pending:
                late.cancel()
            await asyncio.gather(task, return_exceptions=True)
        caller = self._caller
        if caller is None:
            return
        processor = self._services.processor
        to_ack, self._to_ack = self._to_ack, None
        if to_ack:
            await self._ack(caller, to_ack)
        flights, self._inflight = self._inflight, None
        for flight in (flights or {}).values():
            if flight.receipt and not flight.released:
                try:
                    await processor.nack(caller, POP_GROUP, flight.receipt)
                except StorageError as e:
                    log.debug("mqtt: giving back %s failed: %s", flight.receipt, e)

    # -- bytes out ---------------------------------------------------------------------

    def write(self, packet: codec.Packet) -> None:
        self._buffer(codec.encode(packet, self.level))

    def _buffer(self, data: bytes) -> None:
        out = self._out
        if out is None:
            self._out = bytearray(data)
        else:
            out += data

    def seal(self, last: codec.Packet | None = None) -> None:
        """Send ``last`` (the server's DISCONNECT) and nothing after it: MQTT 5 4.13
        makes DISCONNECT the server's final packet, so deliveries stop here and what
        the pump still pops is given back by ``stop`` instead of sent."""
        self.active = False
        if last is not None:
            self.write(last)
        self.flush()
        self._sealed = True

    def flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, None
        if out and not self._sealed:
            self._transport.write(out)  # (handed over: never written to again here)

    def pending_bytes(self) -> int:
        out = self._out
        return self._transport.backlog() + (len(out) if out is not None else 0)

    # -- acks from the client ------------------------------------------------------------

    async def on_acks(self, acks: list[Ack]) -> None:
        """PUBACK / PUBREC / PUBCOMP of what we sent: free the window, ack storage."""
        assert self._caller is not None
        receipts: list[str] = []
        flights = self._inflight
        if flights is not None:
            self._settle(flights, acks, receipts)
            if not flights:
                self._inflight = None
        self.flush()
        to_ack, self._to_ack = self._to_ack, None
        if to_ack:
            receipts += to_ack
        if receipts:
            await self._ack(self._caller, receipts)
        self._drain_backlog()
        self.flush()
        self.wake()

    def _settle(self, flights: dict[int, _InFlight], acks: list[Ack], receipts: list[str]) -> None:
        """End or advance the flights ``acks`` answer; ``receipts`` gets the storage
        receipts to ack."""
        assert self._session is not None
        session = self._session
        for ack in acks:
            flight = flights.get(ack.packet_id)
            if flight is None:
                continue
            if isinstance(ack, codec.PubRec) and not flight.released:
                if flight.receipt:
                    receipts.append(flight.receipt)
                if ack.reason >= 0x80:  # the client refused it: the flow ends here
                    del flights[ack.packet_id]
                    continue
                flight.released = True
                session.pubrel_sent(ack.packet_id)
                self.write(codec.PubRel(packet_id=ack.packet_id))
            elif isinstance(ack, codec.PubAck) and flight.qos == 1:
                del flights[ack.packet_id]
                if flight.receipt:
                    receipts.append(flight.receipt)
            elif isinstance(ack, codec.PubComp) and flight.released:
                del flights[ack.packet_id]
                session.pubcomp_received(ack.packet_id)

    # -- PUBLISH out ---------------------------------------------------------------------

    def wake(self) -> None:
        """Let the pump look at the queues again; start it on first need (most
        connections, clean sessions without shared subscriptions, never need one)."""
        if self._pump_task is None:
            session = self._session
            if not self.active or session is None:
                return
            if session.queue is None and not any(
                f.startswith(SHARE_PREFIX) for f in session.subscriptions
            ):
                return
            self._pump_wake = asyncio.Event()
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())
            self._pump_task.add_done_callback(self._pump_ended)
        if self._pump_wake is not None:
            self._pump_wake.set()

    def _pump_ended(self, task: asyncio.Task[None]) -> None:
        """A pump that failed (our bug, or a storage error nobody expected) is logged
        and forgotten, so a wake after a pause starts another: before, it ended
        silently and the session got nothing more until its client reconnected."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("mqtt: the pump of a session failed", exc_info=task.exception())
        if self._pump_task is task:
            self._pump_task = None
            if self.active:  # again after a pause (not in a loop, if it fails again)
                asyncio.get_running_loop().call_later(_RETRY_S, self.wake)

    def deliver(self, delivery: Delivery) -> None:
        """Send a message from memory (clean sessions, QoS 0, retained on subscribe)."""
        if not self.active:
            return
        message = delivery.message
        if message.expiry_ms is not None and message.expiry_ms <= self._clock.now_ms():
            return
        if self._owes():  # over the account's consume rate: wait in the backlog
            self._hold(delivery)
            return
        if delivery.qos == 0:
            if self.pending_bytes() > self._drop_bytes:
                self._drop()
                return
            if self._dropping:
                self._dropped_until_now()
        elif len(self._inflight or ()) >= self.window:
            if self._backlog is None:
                self._backlog = deque()
            if len(self._backlog) < _BACKLOG_LIMIT:
                self._backlog.append(delivery)
            return
        sent = self._send(
            delivery.message,
            delivery.topic,
            delivery.qos,
            delivery.retain,
            delivery.subscription_ids,
            receipt=None,
            dup=False,
        )
        if sent and self._caller is not None:  # pops are metered by the processor
            self._services.metering.record_out(
                self._caller.namespace, "mqtt", messages=1, nbytes=len(message.body)
            )

    def _drop(self) -> None:
        """A QoS 0 delivery the client is too far behind for: counted, and said once
        per run of drops (as Mosquitto's "Outgoing messages are being dropped for
        client"), so a subscriber's losses are visible, not only its slowness."""
        self.dropped += 1
        self._services.stats.dropped += 1
        if not self._dropping:
            log.warning(
                "mqtt %s: outgoing QoS 0 messages are being dropped: the client is %d "
                "bytes behind (more than %d)",
                self._client_id(),
                self.pending_bytes(),
                self._drop_bytes,
            )
        self._dropping += 1

    def _dropped_until_now(self) -> None:
        """The client caught up: say how many the run of drops lost."""
        log.warning(
            "mqtt %s: %d outgoing QoS 0 messages dropped while the client read slowly",
            self._client_id(),
            self._dropping,
        )
        self._dropping = 0

    def _client_id(self) -> str:
        return self._session.client_id if self._session is not None else "-"

    def _send(
        self,
        message: Message,
        topic: str,
        qos: int,
        retain: bool,
        subscription_ids: list[int],
        *,
        receipt: str | None,
        dup: bool,
    ) -> bool:
        if self.level != codec.LEVEL_5:  # no properties: the bytes straight from the message
            return self._send_v3(message, topic, qos, retain, receipt=receipt, dup=dup)
        packet = publish_from_message(
            message, topic=topic, qos=qos, retain=retain, now_ms=self._clock.now_ms(), v5=True
        )
        if subscription_ids:
            packet.properties[codec.SUBSCRIPTION_ID] = subscription_ids
        if self.alias_max:  # topic aliases (v5 3.3.2.3.4), first come first served
            aliases = self._aliases
            if aliases is None:
                aliases = self._aliases = {}
            alias = aliases.get(topic)
            if alias is not None:
                packet.topic = ""
                packet.properties[codec.TOPIC_ALIAS] = alias
            elif len(aliases) < self.alias_max:
                alias = aliases[topic] = len(aliases) + 1
                packet.properties[codec.TOPIC_ALIAS] = alias
        if qos:
            packet.packet_id = self._allocate_pid()
            packet.dup = dup
        data = codec.encode(packet, self.level)
        if self.max_packet and len(data) > self.max_packet:
            return False  # v5 3.1.2.11.4: discarded as if delivered
        if qos:
            self._fly(packet.packet_id, _InFlight(qos, receipt))
        self._services.stats.sent += 1
        if self._quota is not None:
            self._quota.consumed(PROTOCOL, len(message.body))
        self._buffer(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)
        return True

    def _send_v3(
        self,
        message: Message,
        topic: str,
        qos: int,
        retain: bool,
        *,
        receipt: str | None,
        dup: bool,
    ) -> bool:
        """:meth:`_send` for levels 3 and 4: the same bytes as
        ``codec.encode(publish_from_message(...))``, without the packet object."""
        pid = self._allocate_pid() if qos else 0
        data = codec.encode_publish_v3(
            topic.encode(), message.body, qos, retain, dup and qos > 0, pid
        )
        if self.max_packet and len(data) > self.max_packet:
            return False
        if qos:
            self._fly(pid, _InFlight(qos, receipt))
        self._services.stats.sent += 1
        if self._quota is not None:
            self._quota.consumed(PROTOCOL, len(message.body))
        self._buffer(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)
        return True

    def _owes(self) -> bool:
        return self._quota is not None and self._quota.wait_ms("consume") > 0

    def _hold(self, delivery: Delivery) -> None:
        """Keep a delivery until the account's consume debt is paid, in order."""
        if self._backlog is None:
            self._backlog = deque()
        if len(self._backlog) < _BACKLOG_LIMIT:
            self._backlog.append(delivery)
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        """Deliver the backlog, in order, while the window has room and the account
        owes nothing; if it owes, :meth:`_release` goes on once it does (else the next
        acks do)."""
        backlog = self._backlog
        while backlog and len(self._inflight or ()) < self.window and not self._owes():
            self.deliver(backlog.popleft())
        if backlog and self._owes() and self._release_task is None:
            self._release_task = asyncio.get_running_loop().create_task(self._release())

    async def _release(self) -> None:
        """Wait out the account's consume debt, then drain the backlog (which starts
        the next release if draining runs into new debt)."""
        assert self._quota is not None
        try:
            await self._quota.hold(PROTOCOL, "consume")
        finally:
            self._release_task = None
        if self.active:
            self._drain_backlog()

    def _allocate_pid(self) -> int:
        pid = self._next_pid
        flights = self._inflight or ()
        pubrels = (self._session.outbound_pubrel if self._session is not None else None) or ()
        while pid in flights or pid in pubrels:
            pid = pid % 65535 + 1
        self._next_pid = pid % 65535 + 1
        return pid

    def _fly(self, pid: int, flight: _InFlight) -> None:
        flights = self._inflight
        if flights is None:
            flights = self._inflight = {}
        flights[pid] = flight

    def _ack_later(self, receipt: str) -> None:
        """A popped message to ack with the next batch, not on a client's ack."""
        to_ack = self._to_ack
        if to_ack is None:
            self._to_ack = [receipt]
        else:
            to_ack.append(receipt)

    # -- the pump: queue-based deliveries ------------------------------------------------

    async def _pump(self) -> None:
        """Pop while the window has room, then sleep until woken.

        The pump does not long-poll storage: the broker wakes it after every append
        into a queue it pops (it is the only writer of those queues), and so do acks,
        new shared subscriptions and a shared-group member leaving (storage does not
        wake a waiting pop for a message given back). A storage call that the
        connection's end cancels is then never left waiting with messages it might
        still hand out. Messages whose invisibility ran out (after a crash) are found
        by the poll every ``_REPOLL_S``.

        With several gateways, other gateways write the queues too, and an append's
        copy into a queue may land on another storage node after the copy the
        waking tail saw: there the pump waits in storage (a long-poll pop), given up
        as soon as something here wakes it (a pop may be cancelled at any time
        without losing a message)."""
        assert self._broker is not None and self._session is not None
        assert self._caller is not None and self._pump_wake is not None
        broker, session, caller, wake = self._broker, self._session, self._caller, self._pump_wake
        processor = self._services.processor
        long_poll = broker.peers is not None
        while self.active:
            owed = self._quota.wait_ms("consume") if self._quota is not None else 0
            if owed and self._quota is not None:  # over the consume rate: pop nothing yet
                self._quota.throttled(PROTOCOL, owed)
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(owed / 1000):
                        await wake.wait()  # or stop() ends the pump
                continue
            room = self.window - len(self._inflight or ())
            shared = broker.shared_queues(session)
            queues = [q for q, _ in shared]
            if session.queue is not None:
                queues.append(session.queue)
            wake.clear()
            popped: list[StoredMessage] = []
            idle_s = _REPOLL_S
            waited = False
            if room > 0 and queues:
                try:
                    # Members of a shared group take a few at a time, so the group's
                    # messages spread over the members rather than go to the first.
                    pop = processor.pop(
                        caller,
                        POP_GROUP,
                        queues,
                        max_messages=min(room, _SHARED_BATCH) if shared else room,
                        invisible_ms=_INVISIBLE_MS,
                        wait_ms=_LONG_POLL_MS if long_poll else 0,
                    )
                    if long_poll:
                        popped = await _pop_until_stale(pop, wake, self._stale(queues))
                        waited = True
                    else:
                        popped = await pop
                except StorageError as e:
                    log.warning("mqtt %s: pop failed: %s", session.client_id, e)
                    idle_s = _RETRY_S  # a storage node down, a route not known yet
            options = dict(shared)
            for stored in popped:
                self._send_stored(stored, options.get(stored.queue))
            self.flush()
            receipts, self._to_ack = self._to_ack, None
            if receipts:
                await self._ack(caller, receipts)
            if not popped and not waited:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle_s):
                        await wake.wait()

    async def _ack(self, caller: Caller, receipts: list[str]) -> None:
        """Ack popped messages the client acknowledged. When their node is away
        (storage raises for a batch all from one node, and answers per receipt for a
        spread one), they come back after their invisibility, marked DUP (at least
        once): the connection goes on."""
        try:
            await self._services.processor.ack_many(caller, POP_GROUP, receipts)
        except StorageUnavailable as e:
            log.warning("mqtt: %d acks not stored (sent again later): %s", len(receipts), e)
        except StorageError as e:  # e.g. a node's client closed as its shard moved
            log.warning("mqtt: %d acks not stored (sent again later): %r", len(receipts), e)

    def _stale(self, queues: list[QueueRef]) -> Callable[[], bool]:
        """Whether a waiting pop over ``queues`` must be given up: the connection
        ends, or the session's shared subscriptions changed which queues to pop."""
        assert self._broker is not None and self._session is not None
        broker, session = self._broker, self._session
        shared = queues[:-1] if session.queue is not None else queues

        def stale() -> bool:
            return not self.active or [q for q, _ in broker.shared_queues(session)] != shared

        return stale

    def _send_stored(self, stored: StoredMessage, shared: SubOptions | None) -> None:
        assert self._broker is not None and self._session is not None
        assert stored.receipt is not None
        message = stored.message
        topic = mqtt_topic_of(message, stored.queue.topic)
        if shared is not None:
            qos, rap = shared.qos, shared.retain_as_published
            ids = [shared.subscription_id] if shared.subscription_id else []
        else:
            grant = self._broker.session_grant(self._session, topic)
            if grant is None:  # unsubscribed since it was queued
                self._ack_later(stored.receipt)
                return
            qos, ids, rap = grant
        qos = min(qos, published_qos(message))
        retain = rap and message.property(MQTT_RETAIN) == b"1"
        sent = self._send(
            message,
            topic,
            qos,
            retain,
            ids,
            receipt=stored.receipt if qos else None,
            dup=stored.delivery_attempt > 1,
        )
        if not qos or not sent:
            self._ack_later(stored.receipt)


async def _pop_until_stale(
    pop: Coroutine[Any, Any, list[StoredMessage]],
    wake: asyncio.Event,
    stale: Callable[[], bool],
) -> list[StoredMessage]:
    """A waiting pop. Wakes meanwhile (acks, this gateway's publishes) do not cut it
    short: a cancelled pop gives back what it took, and the next pop could overtake
    those, out of order. Only ``stale`` does (then nothing is handed out, unless it
    already was: those are returned, to be sent)."""
    popping = asyncio.ensure_future(pop)
    try:
        while True:
            woken = asyncio.ensure_future(wake.wait())
            try:
                await asyncio.wait({popping, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
            if popping.done() or stale():
                break
            wake.clear()  # the pump pops again anyway once this pop returns
    finally:
        popping.cancel()
        await asyncio.gather(popping, return_exceptions=True)
    if popping.cancelled():
        return []
    return popping.result()
