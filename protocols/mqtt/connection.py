"""One MQTT client connection: CONNECT, then packets in and out until the client
leaves, breaks the protocol, goes silent past its keep-alive, or is taken over.

The connection's task reads, then handles what the read brought in order before
reading again, so a run of PUBLISH packets becomes one storage append and a run of
acks one ack call; what arrives meanwhile waits in the socket and makes the next batch.
What goes to the client is :mod:`protocols.mqtt.outbound`'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from functools import partial

from polymq.gateway.accounts import AuthenticationFailed, AuthError
from polymq.gateway.connections import AccountConnectionLimit
from polymq.gateway.fairness import cooperatively
from polymq.gateway.permissions import Operation
from polymq.gateway.processor import Caller
from polymq.gateway.quotas import AccountQuota
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt._state import ConnectionState, accepts
from polymq.protocols.mqtt.broker import MqttBroker
from polymq.protocols.mqtt.connect_checks import connect_problem
from polymq.protocols.mqtt.mapping import (
    message_from_publish,
    published_qos,
    storage_topic,
)
from polymq.protocols.mqtt.model import Delivery, Outgoing, Session, SubOptions
from polymq.protocols.mqtt.outbound import Outbound
from polymq.protocols.mqtt.quota import charge_packets, receive_maximum
from polymq.protocols.mqtt.services import MqttServices
from polymq.protocols.mqtt.store_queue import PublishBatch, StoreOutcome, StoreQueue, store_batches
from polymq.protocols.mqtt.topic_filter_index import (
    is_valid_filter,
    is_valid_topic_name,
    split_shared,
    topic_levels,
)
from polymq.protocols.mqtt.transport import Transport
from polymq.storage.errors import InvalidName, MessageTooLarge, StorageError

__all__ = ["MqttConnection"]

log = logging.getLogger(__name__)

_BATCH = 256  # PUBLISHes per append, acks per ack call
# Bodies of PUBLISHes read and routed but not yet being stored, per connection:
# past this, reading waits until they are stored (store_queue.py).
_STORE_QUEUE_BYTES = 1 << 20
_ACKS = (codec.PubAck, codec.PubRec, codec.PubComp)

# v5 reason codes (2.4) used here
_SUCCESS = 0x00
_DISCONNECT_WITH_WILL = 0x04
_NO_SUBSCRIPTION = 0x11
_UNSPECIFIED = 0x80
_PROTOCOL_ERROR = 0x82
_CLIENT_ID_INVALID = 0x85
_NOT_AUTHORIZED = 0x87
_BAD_CREDENTIALS = 0x86
_KEEP_ALIVE_TIMEOUT = 0x8D
_TAKEN_OVER = 0x8E
_FILTER_INVALID = 0x8F
_TOPIC_INVALID = 0x90
_TOPIC_ALIAS_INVALID = 0x94
_PACKET_TOO_LARGE = 0x95
_QUOTA_EXCEEDED = 0x97
_SERVER_SHUTTING_DOWN = 0x8B
_RECEIVE_MAXIMUM_EXCEEDED = 0x93


class _Close(Exception):
    """End the connection; v5 clients get DISCONNECT with ``reason`` first."""

    def __init__(self, reason: int, text: str) -> None:
        super().__init__(text)
        self.reason = reason


@dataclass(slots=True)
class _Will:
    packet: codec.Publish
    client_id: str
    delay_s: int

    def outgoing(self, now_ms: int) -> Outgoing:
        """The will as published now: its message expiry counts from now (v5 3.1.3.2.4)."""
        packet = self.packet
        message = message_from_publish(packet, client_id=self.client_id, now_ms=now_ms)
        return Outgoing(
            message=message,
            topic=packet.topic,
            qos=packet.qos,
            retain=packet.retain,
            publisher=self.client_id,
        )


class MqttConnection:
    # Slots: servers hold tens of thousands of mostly idle connections.
    __slots__ = (
        "_alive_until",
        "_broker",
        "_caller",
        "_certificate_name",
        "_clock",
        "_config",
        "_connection_id",
        "_decoder",
        "_done",
        "_expired",
        "_finished",
        "_graceful",
        "_in_alias_chars",
        "_in_aliases",
        "_inbound_unacked",
        "_keep_alive",
        "_kicked",
        "_out",
        "_problem_info",
        "_quota",
        "_receive_maximum",
        "_services",
        "_session",
        "_stores",
        "_task",
        "_transport",
        "_v5",
        "_will",
        "client_id",
        "deadline_tick",
        "parked",
        "state",
    )

    def __init__(
        self,
        services: MqttServices,
        transport: Transport,
        connection_id: int | None,
        *,
        certificate_name: str | None = None,
    ) -> None:
        self._services = services
        # A verified client certificate's account name ([tls] principal_from): it is
        # the user, whatever CONNECT says (Mosquitto's use_identity_as_username).
        self._certificate_name = certificate_name
        self._config = services.config
        self._transport = transport
        self._connection_id = connection_id
        self._clock = services.clock
        self.state = ConnectionState.AWAIT_CONNECT
        # Until CONNECT is accepted a peer may send only small packets (Kafka's
        # sasl.server.max.receive.size): an anonymous socket holds little.
        anonymous_max = services.limits.max_unauthenticated_frame_bytes
        # None while detached (:meth:`shed`): made again when the connection wakes.
        self._decoder: codec.Decoder | None = codec.Decoder(
            max_packet_bytes=min(self._config.max_packet_bytes, anonymous_max),
            max_filters=self._config.max_filters_per_subscribe,
            stop_after_connect=True,
        )
        self._v5 = False
        self._caller: Caller | None = None
        self._broker: MqttBroker | None = None
        self._session: Session | None = None
        self.client_id = ""
        self._keep_alive = 0
        self._will: _Will | None = None
        self._problem_info = True  # v5 3.1.2.11.7: reason strings only if the client wants
        self._graceful = False
        # inbound
        self._in_aliases: dict[int, str] | None = None  # on first alias: most set none
        self._in_alias_chars = 0  # of the topics in _in_aliases
        self._inbound_unacked = 0  # QoS 1/2 PUBLISHes received, not yet acked (v5)
        self._receive_maximum = self._config.receive_maximum  # announced; smaller under a quota
        self._quota: AccountQuota | None = None  # the account's, once CONNECT is accepted
        self._out = Outbound(services, transport)
        # PUBLISH batches routed, being stored behind the reading (on first publish:
        # an idle connection holds none).
        self._stores: StoreQueue[PublishBatch, StoreOutcome] | None = None
        self._finished: asyncio.Future[None] | None = None  # awaited by a takeover
        self._done = False
        # Keep-alive (protocols/mqtt/deadlines.py): the loop time by which the next
        # packet must come while the connection waits for one; -1 while it handles
        # what came (handling time is not the client's silence). ``_expired`` tells
        # the deadline's cancel from a server stop's.
        self._alive_until = -1.0
        self._expired = False
        self.deadline_tick = 0
        self._task: asyncio.Task[None] | None = None  # run()'s, for the keep-alive
        # Parked: idle with no task at all, until the transport has bytes (or the
        # peer left) and starts run() again (a transport that can, TcpTransport).
        self.parked = False
        self._kicked = False  # to end at once when run() next comes to wait

    # -- lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection: CONNECT, then packets until it ends. Over a transport
        that can park (TCP), it returns while the connection waits for bytes, with
        :attr:`parked` set and the connection alive: the transport's wake (the
        listener) calls it again when bytes come, and it goes on reading."""
        self._task = asyncio.current_task()
        self.parked = False
        try:
            if self.state is ConnectionState.CONNECTED:  # again, after a park
                packets: list[codec.Packet] = []
                park_now = False
                if self._decoder is None:
                    self._decoder = self._connected_decoder()
            else:
                # Parks at its first wait: after CONNACK a client often idles, and
                # a reconnecting crowd's tasks are then not all held at once.
                park_now = True
                # (inline, not a coroutine of its own: one frame less per connection)
                connect = await self._first_packet()
                if connect is None or not await self._accept(connect):
                    return
                del connect  # not kept for the connection's life
                assert self._decoder is not None
                self._decoder.max_packet_bytes = self._max_packet_bytes()
                self._transport.limit_packets(self._decoder.max_packet_bytes)
                packets = self._decoder.feed(b"")  # what was pipelined behind CONNECT
                if self._keep_alive:
                    loop_time = asyncio.get_running_loop().time()
                    self._services.deadlines.add(self, loop_time + self._keep_alive * 1.5)
            # The read loop: read, then handle everything the read brought before
            # reading again, so what arrives while a batch is being stored waits in
            # the socket and makes the next batch (one append for many PUBLISHes,
            # one ack call for many PUBACKs). While it waits, the connection is filed
            # in the services' deadlines for its keep-alive (1.5 times the client's,
            # v5 3.1.2.10): no timer of its own, as most connections mostly wait.
            keep_alive_s = self._keep_alive * 1.5 if self._keep_alive else None
            loop = asyncio.get_running_loop()
            decoder, transport = self._decoder, self._transport
            assert decoder is not None
            drop_bytes = self._services.options.qos0_drop_bytes
            while True:
                self._admit_all(packets)
                await self._handle(packets)
                if self._stores is not None and self._stores.ended:
                    return  # a publish could not be stored: closed (_batch_stored)
                if self._quota is not None and charge_packets(self._quota, packets):
                    await self._quota.hold("mqtt", "produce", "requests")  # slow reads
                if self._out.pending_bytes() > drop_bytes:  # the client reads slowly
                    self._out.flush()
                    await transport.drain()
                if keep_alive_s is not None:
                    self._alive_until = loop.time() + keep_alive_s
                del packets  # nothing of the last batch is held while waiting
                if decoder.pending_bytes:
                    read = await self._read()
                else:  # between packets (the usual case)
                    if self._kicked or self._expired:
                        raise asyncio.CancelledError  # woken to end: run()'s own cancel
                    if park_now and not self._stores and transport.park():
                        self.parked = True
                        self._task = None
                        return
                    park_now = False
                    data = await transport.read()
                    # b"" is the peer's end, or the transport asking an idle
                    # connection to park: then no task and no frame while it waits
                    # (unless bytes came meanwhile: read them).
                    while not data and transport.asked_to_park():
                        await self._stored()  # nothing in flight while parked
                        if transport.park():
                            self.parked = True
                            self._task = None
                            return
                        data = await transport.read()
                    read = decoder.feed(data) if data else None
                    del data
                    if read is not None and not read and decoder.pending_bytes:
                        read = await self._read()  # a packet begun: its own deadline
                if read is None:
                    return
                self._alive_until = -1.0
                packets = read
        except _Close as e:
            log.info("mqtt %s: closing: %s", self.client_id or "-", e)
            self._goodbye(e.reason, str(e))
        except (codec.MalformedPacket, codec.ProtocolError, codec.PacketTooLarge) as e:
            log.info("mqtt %s: bad packet: %s", self.client_id or "-", e)
            self._goodbye(e.reason, str(e))
        except _Disconnected:
            pass  # the client said goodbye
        except asyncio.CancelledError:
            task = self._task
            if self._expired and task is not None and task.uncancel() == 0:
                # Only the keep-alive (:meth:`due`) cancelled the connection.
                log.info("mqtt %s: keep-alive expired", self.client_id or "-")
                self._goodbye(_KEEP_ALIVE_TIMEOUT, "keep alive timeout")
            else:
                self._goodbye(_SERVER_SHUTTING_DOWN, "server shutting down")
                raise
        finally:
            if not self.parked:
                self._services.deadlines.discard(self)
                await self._finish()

    async def _first_packet(self) -> codec.Connect | None:
        """CONNECT, which must arrive within ``limits.handshake_timeout_ms`` (the TCP
        listener's own deadline says the same; this one also covers WebSocket)."""
        timeout_s = self._services.limits.handshake_timeout_ms / 1000
        assert self._decoder is not None
        self._transport.limit_packets(self._decoder.max_packet_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                packets = await self._read()
            if packets is None:
                return None
        except TimeoutError:
            log.info("mqtt: no CONNECT within %g s; closing", timeout_s)
            return None
        except codec.UnsupportedProtocol as e:
            # v5 3.1.2.2: CONNACK 0x84 (v5) or return code 1 (v3), then close.
            level = codec.LEVEL_5 if e.level == codec.LEVEL_5 else codec.LEVEL_311
            reason = 0x84 if level == codec.LEVEL_5 else 0x01
            self._transport.write(codec.encode(codec.ConnAck(reason=reason), level))
            return None
        except (codec.MalformedPacket, codec.ProtocolError, codec.PacketTooLarge) as e:
            log.info("mqtt: bad first packet: %s", e)
            return None
        first = packets[0]
        if not accepts(self.state, first) or not isinstance(first, codec.Connect):
            log.info("mqtt: first packet is %s, not CONNECT", type(first).__name__)
            return None
        return first  # the decoder stopped there: what follows waits in it

    async def _read(self) -> list[codec.Packet] | None:
        """The packets the next reads make whole; ``None`` once the peer has closed.

        A packet once begun must arrive whole within ``limits.frame_timeout_ms``, and
        while it arrives its declared size is held from the gateway's frame budget: a
        peer declaring large packets and sending them slowly holds neither its
        connection nor the process's memory for long."""
        decoder, transport = self._decoder, self._transport
        assert decoder is not None
        if not decoder.pending_bytes:  # between packets (the usual case): nothing held
            data = await transport.read()
            if not data:
                return None
            packets = decoder.feed(data)
            if packets or not decoder.pending_bytes:
                return packets
        timeout_s = self._services.limits.frame_timeout_ms / 1000
        deadline = asyncio.get_running_loop().time() + timeout_s
        budget = self._services.frame_budget
        while True:
            try:
                async with asyncio.timeout_at(deadline) as limit:
                    async with budget.reserve(decoder.declared_size):
                        data = await transport.read()
            except TimeoutError:
                if limit.expired():
                    raise _Close(
                        _KEEP_ALIVE_TIMEOUT, f"a packet begun was not whole within {timeout_s:g} s"
                    ) from None
                raise
            if not data:
                return None
            packets = decoder.feed(data)
            if packets:
                return packets

    def due(self, now: float) -> float | None:
        """The keep-alive deadline's check (protocols/mqtt/deadlines.py): the next
        look when the client was heard from since, or is being served; else close
        the connection (its task, cancelled, says why: :meth:`run`)."""
        if self._done or self.state is ConnectionState.CLOSING:
            return None
        until = self._alive_until
        if until > now:
            return until
        if until < 0:  # handling what came: look again a keep-alive later
            return now + self._keep_alive * 1.5
        self._expired = True
        if self.parked:
            self.kick()  # run() again, which ends it (keep-alive) as it comes to wait
            return None
        task = self._task
        if task is not None and not task.done():
            task.cancel()
        return None

    def shed(self) -> None:
        """Parked a long while (its socket detached): drop the decoder, which holds
        nothing between packets, until the connection wakes (80 bytes a connection)."""
        if self.parked and self._decoder is not None and not self._decoder.pending_bytes:
            self._decoder = None

    def _connected_decoder(self) -> codec.Decoder:
        """The decoder of a connection past CONNECT, as :meth:`_accept` set it up."""
        return codec.Decoder(
            level=self._out.level,
            max_packet_bytes=self._max_packet_bytes(),
            max_filters=self._config.max_filters_per_subscribe,
            stop_after_connect=True,
        )

    def kick(self) -> None:
        """End a parked connection: its transport's wake starts run() again, which
        ends it as though its task had been cancelled (:meth:`run`); a task running
        is cancelled by whoever kicks it."""
        self._kicked = True
        self._transport.unpark()

    def _max_packet_bytes(self) -> int:
        """The largest packet a connected client may send (and is told in CONNACK)."""
        return min(self._config.max_packet_bytes, self._services.limits.max_frame_bytes)

    def _admit_all(self, packets: list[codec.Packet]) -> None:
        for packet in packets:
            self._admit(packet)

    def _admit(self, packet: codec.Packet) -> None:
        if not accepts(self.state, packet):
            raise codec.ProtocolError(f"{type(packet).__name__} is not allowed here")
        if isinstance(packet, codec.Publish) and packet.qos and self._v5:
            # v5 3.3.4: at most receive-maximum QoS 1/2 PUBLISHes unacknowledged
            self._inbound_unacked += 1
            held = len(self._session.inbound_qos2 or ()) if self._session else 0
            if self._inbound_unacked + held > self._config.receive_maximum:
                raise _Close(_RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")

    async def _finish(self) -> None:
        """Give back what was in flight, keep or end the session, send the will. A
        server stop that cancels the connection meanwhile waits for this to end, so
        a persistent session is always saved before storage closes."""
        self.state = ConnectionState.CLOSING
        wind_down = asyncio.ensure_future(self._wind_down())
        try:
            await asyncio.shield(wind_down)
        except asyncio.CancelledError:
            await wind_down
            raise
        finally:
            self._transport.close()
            self._done = True
            if self._finished is not None and not self._finished.done():
                self._finished.set_result(None)
            if self._caller is not None:
                self._services.stats.connected -= 1

    async def _wind_down(self) -> None:
        try:
            if self._stores is not None:
                await self._stores.drain()  # what the peer sent before it left is stored
            await self._out.stop()
            await self._end_session()
        except StorageError as e:  # storage refused or is away: not a bug of ours
            log.warning("mqtt %s: ending the session: %s", self.client_id, e)
        except Exception:
            log.exception("mqtt %s: ending the session failed", self.client_id)

    async def _end_session(self) -> None:
        broker, session = self._broker, self._session
        if broker is None or session is None:
            return
        will, self._will = self._will, None
        if self._graceful:
            will = None
        kept = session.expiry_s > 0 and session.queue is not None
        await broker.detach(session, self)
        if will is None:
            return
        delay = min(will.delay_s, session.expiry_s) if kept else 0
        clock = self._clock
        if delay <= 0:
            await broker.publish([will.outgoing(clock.now_ms())])
        elif session.owner is None:  # v5 3.1.3.2.2: a resumed session cancels the will
            broker.schedule(
                session,
                delay,
                lambda: broker.spawn(broker.publish([will.outgoing(clock.now_ms())])),
            )

    def _goodbye(self, reason: int, text: str = "") -> None:
        """DISCONNECT with a reason for v5 clients that got their CONNACK (v5 4.13)."""
        if self.state is ConnectionState.CLOSING:
            return
        if self._v5 and self._caller is not None:
            props = {codec.REASON_STRING: text[:200]} if text and self._problem_info else {}
            self._out.seal(codec.Disconnect(reason=reason, properties=props))
        else:
            self._out.seal()
        self.state = ConnectionState.CLOSING

    async def take_over(self) -> None:
        self._goodbye(_TAKEN_OVER, "another connection took the session over")
        self._transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                if not self._done:
                    self._finished = asyncio.get_running_loop().create_future()
                    await self._finished

    # -- CONNECT ---------------------------------------------------------------------

    def _peer(self) -> str:
        """The client's ``host:port``, as the connection registry lists it."""
        registry = self._services.connections
        known = None if self._connection_id is None else registry.get(self._connection_id)
        return "" if known is None else known.peer

    async def _accept(self, connect: codec.Connect) -> bool:
        self._out.level = connect.level
        self._v5 = connect.level == codec.LEVEL_5
        assert self._decoder is not None
        self._decoder.level = connect.level
        props = connect.properties
        services = self._services
        refusal = connect_problem(connect, self._v5, self._config.max_topic_levels)
        if refusal is not None:
            reason, problem = refusal
            log.info("mqtt %r: refused: %s", connect.client_id[:100], problem)
            self._out.write(codec.ConnAck(reason=reason))
            self._out.flush()
            return False
        password = None if connect.password is None else connect.password.decode("utf-8", "replace")
        try:
            if self._certificate_name is not None:
                principal = services.accounts.by_certificate(self._certificate_name)
            else:
                principal = await services.accounts.authenticate(
                    connect.username, password, protocol="mqtt", peer=self._peer()
                )
            services.accounts.authorize(principal, principal.default_namespace)
            if connect.will_topic is not None:  # a will it could not publish: 0x87 / 5
                await services.processor.permissions.check(
                    principal,
                    principal.default_namespace,
                    "topic",
                    storage_topic(connect.will_topic),
                    "write",
                )
        except AuthError as e:
            log.info("mqtt: refused %r: %s", connect.username, e)
            bad_login = isinstance(e, AuthenticationFailed)
            reason = (
                (_BAD_CREDENTIALS if bad_login else _NOT_AUTHORIZED)
                if self._v5
                else (4 if bad_login else 5)
            )
            self._out.write(codec.ConnAck(reason=reason))
            self._out.flush()
            return False
        client_id = connect.client_id
        assigned = not client_id
        if assigned:
            if not self._v5 and not connect.clean_start:
                self._out.write(codec.ConnAck(reason=0x02))  # v3 3.1.3-8: identifier rejected
                self._out.flush()
                return False
            client_id = f"auto-{uuid.uuid4().hex}"
        self.client_id = client_id
        namespace = principal.default_namespace
        if self._v5:
            expiry_s = int(props.get(codec.SESSION_EXPIRY, 0))
            out = self._out
            out.window = min(out.window, int(props.get(codec.RECEIVE_MAXIMUM, 65535)))
            out.alias_max = int(props.get(codec.TOPIC_ALIAS_MAXIMUM, 0))
            out.max_packet = int(props.get(codec.MAXIMUM_PACKET_SIZE, 0))
            self._problem_info = props.get(codec.REQUEST_PROBLEM_INFO, 1) == 1
        else:
            expiry_s = 0 if connect.clean_start else self._config.default_session_expiry_s
        self._keep_alive = connect.keep_alive
        max_keep_alive = services.options.max_keep_alive_s
        server_keep_alive = None
        if self._v5 and max_keep_alive and not 0 < connect.keep_alive <= max_keep_alive:
            server_keep_alive = self._keep_alive = max_keep_alive  # v5 3.2.2.3.14
        self._caller = Caller(
            principal=principal,
            namespace=namespace,
            protocol="mqtt",
            connection_id=self._connection_id,
            client_id=client_id,
        )
        services.stats.connected += 1
        if self._connection_id is not None:
            try:
                with contextlib.suppress(KeyError):
                    services.connections.identify(
                        self._connection_id,
                        principal=principal,
                        namespace=namespace,
                        client_id=client_id,
                    )
            except AccountConnectionLimit as e:  # v5 0x97 quota exceeded, v3 code 3
                log.info("mqtt %s: refused: %s", client_id, e)
                self._out.write(codec.ConnAck(reason=_QUOTA_EXCEEDED if self._v5 else 3))
                self._out.flush()
                self._caller = None
                services.stats.connected -= 1
                return False
        self._quota = services.quotas.of(principal)
        self._receive_maximum = receive_maximum(
            services.quotas.limits(principal), self._config.receive_maximum
        )
        if connect.will_topic is not None:
            self._will = _Will(
                packet=codec.Publish(
                    topic=connect.will_topic,
                    payload=connect.will_payload,
                    qos=connect.will_qos,
                    retain=connect.will_retain,
                    properties=connect.will_properties,
                ),
                client_id=client_id,
                delay_s=int(connect.will_properties.get(codec.WILL_DELAY, 0)),
            )
        try:
            self._broker = await services.brokers.get(namespace)
            self._session, present = await self._broker.attach(
                self, client_id, clean_start=connect.clean_start, expiry_s=expiry_s
            )
        except StorageError as e:  # v5 0x88 server unavailable, v3 return code 3
            log.warning("mqtt %s: cannot open the session: %s", client_id, e)
            self._out.write(codec.ConnAck(reason=0x88 if self._v5 else 3))
            self._out.flush()
            self._caller = None
            services.stats.connected -= 1
            return False
        ack = codec.ConnAck(session_present=present)
        if self._v5:
            ack.properties = {
                codec.RECEIVE_MAXIMUM: self._receive_maximum,
                codec.MAXIMUM_PACKET_SIZE: self._max_packet_bytes(),
                codec.TOPIC_ALIAS_MAXIMUM: self._config.topic_alias_maximum,
                codec.RETAIN_AVAILABLE: 1,
                codec.WILDCARD_SUB_AVAILABLE: 1,
                codec.SUB_ID_AVAILABLE: 1,
                codec.SHARED_SUB_AVAILABLE: 1,
            }
            if assigned:
                ack.properties[codec.ASSIGNED_CLIENT_ID] = client_id
            if server_keep_alive is not None:
                ack.properties[codec.SERVER_KEEP_ALIVE] = server_keep_alive
        self._out.write(ack)
        self.state = ConnectionState.CONNECTED
        self._out.bind(self._session, self._broker, self._caller)
        return True

    # -- packets in order ----------------------------------------------------------

    async def _handle(self, packets: list[codec.Packet]) -> None:
        """Handle packets in order, a run of PUBLISHes as one batch and a run of acks
        of our PUBLISHes as one."""
        i, end = 0, len(packets)
        while i < end:
            packet = packets[i]
            j = i + 1
            if isinstance(packet, codec.Publish):
                while j < end and j - i < _BATCH and isinstance(packets[j], codec.Publish):
                    j += 1
                await self._on_publishes(packets[i:j])  # type: ignore[arg-type]
            elif isinstance(packet, _ACKS):
                while j < end and j - i < _BATCH and isinstance(packets[j], _ACKS):
                    j += 1
                await self._out.on_acks(packets[i:j])  # type: ignore[arg-type]
            elif isinstance(packet, codec.PubRel):
                while j < end and j - i < _BATCH and isinstance(packets[j], codec.PubRel):
                    j += 1
                await self._stored()
                await self._on_pubrels(packets[i:j])  # type: ignore[arg-type]
            else:
                await self._stored()  # e.g. a retained publish, then a subscribe
                await self._on_packet(packet)
            i = j

    async def _stored(self) -> None:
        """Wait until the PUBLISHes read so far are stored and acknowledged (or the
        connection closes for one of them): packets other than PUBLISH see them."""
        stores = self._stores
        if stores is not None and len(stores):
            await stores.drain()
            if stores.ended:
                raise _Disconnected  # closed with a goodbye of its own (_batch_stored)

    async def _on_packet(self, packet: codec.Packet) -> None:
        if isinstance(packet, codec.Subscribe):
            await self._on_subscribe(packet)
        elif isinstance(packet, codec.Unsubscribe):
            await self._on_unsubscribe(packet)
        elif isinstance(packet, codec.PingReq):
            self._out.write(codec.PingResp())
            self._out.flush()
        elif isinstance(packet, codec.Disconnect):
            self._on_disconnect(packet)

    def _on_disconnect(self, packet: codec.Disconnect) -> None:
        assert self._session is not None
        expiry = packet.properties.get(codec.SESSION_EXPIRY)
        if expiry is not None:
            if self._session.expiry_s == 0 and expiry > 0:
                raise _Close(
                    _PROTOCOL_ERROR, "session expiry set at DISCONNECT after 0 (3.14.2.2.2)"
                )
            self._session.expiry_s = expiry
        self._graceful = packet.reason != _DISCONNECT_WITH_WILL
        self.state = ConnectionState.CLOSING
        raise _Disconnected

    async def _on_pubrels(self, batch: list[codec.PubRel]) -> None:
        """PUBCOMP a run of PUBRELs once the session's release epoch is saved."""
        assert self._broker is not None and self._session is not None
        ids = [packet.packet_id for packet in batch]
        known = await self._broker.release_qos2(self._session, ids)
        for packet_id, found in zip(ids, known, strict=True):
            reason = _SUCCESS if found else 0x92  # v5 3.7.2.1: packet identifier not found
            self._out.write(codec.PubComp(packet_id=packet_id, reason=reason))
        self._out.flush()

    # -- PUBLISH in ------------------------------------------------------------------

    def _resolve_topic(self, packet: codec.Publish) -> str:
        """Topic aliases (v5 3.3.2.3.4): an alias with a topic sets it, alone uses it."""
        alias = packet.properties.pop(codec.TOPIC_ALIAS, None)
        if alias is None:
            return packet.topic
        if not 0 < alias <= self._config.topic_alias_maximum:
            raise _Close(_TOPIC_ALIAS_INVALID, f"topic alias {alias} is out of range")
        aliases = self._in_aliases
        if packet.topic:
            if aliases is None:
                aliases = self._in_aliases = {}
            old = aliases.get(alias, "")
            chars = self._in_alias_chars - len(old) + len(packet.topic)
            # 65,535 aliases of 64 KiB topics would be 4 GiB: together at most one
            # packet's worth.
            if chars > self._config.max_packet_bytes:
                raise _Close(_QUOTA_EXCEEDED, "topic aliases hold too many topic bytes")
            self._in_alias_chars = chars
            aliases[alias] = packet.topic
            return packet.topic
        topic = aliases.get(alias) if aliases is not None else None
        if topic is None:
            raise _Close(_PROTOCOL_ERROR, f"topic alias {alias} was never set")
        return topic

    async def _on_publishes(self, batch: list[codec.Publish]) -> None:
        assert self._broker is not None and self._session is not None
        session = self._session
        items: list[Outgoing] = []
        acks: list[codec.Packet] = []
        item_acks: dict[int, int] = {}  # index in items -> index of its ack in acks
        now = self._clock.now_ms()
        # Topics of this batch found valid, permitted and with a storage topic: a
        # burst usually repeats one or a few, checked once each.
        cleared: set[str] = set()
        for packet in batch:
            topic = self._resolve_topic(packet)
            if topic in cleared:
                if packet.qos == 2 and session.qos2_known(packet.packet_id):
                    acks.append(codec.PubRec(packet_id=packet.packet_id))  # a resend: stored
                    continue
                self._admit_publish(packet, topic, now, items, acks, item_acks)
                continue
            if not is_valid_topic_name(topic):
                raise _Close(_TOPIC_INVALID, f"invalid topic name {topic[:100]!r} in PUBLISH")
            if topic_levels(topic) > self._config.max_topic_levels:
                # As EMQX: DISCONNECT 0x90 (v3: a close), whatever the QoS.
                raise _Close(
                    _TOPIC_INVALID,
                    f"topic name with more than {self._config.max_topic_levels} levels",
                )
            if packet.qos == 2 and session.qos2_known(packet.packet_id):
                acks.append(codec.PubRec(packet_id=packet.packet_id))  # a resend: stored
                continue
            if topic.startswith("$SYS"):
                if packet.qos:
                    ack = _ack_for(packet, _SUCCESS)  # v3 has no failure ack: dropped
                    if self._v5:
                        self._fail_ack(ack, _NOT_AUTHORIZED, "$SYS topics are the server's")
                    acks.append(ack)
                continue
            if not await self._permitted(storage_topic(topic), "write"):
                # v5: PUBACK/PUBREC 0x87; v3 has no failure ack: acknowledged and
                # dropped, as Mosquitto does (docs/permissions.md).
                log.info("mqtt %s: not authorized to publish to %r", self.client_id, topic[:100])
                if packet.qos:
                    ack = _ack_for(packet, _SUCCESS)
                    if self._v5:
                        self._fail_ack(ack, _NOT_AUTHORIZED, f"not authorized for {topic[:100]!r}")
                    acks.append(ack)
                continue
            try:
                await self._broker.ensure_topic(storage_topic(topic))
            except InvalidName as e:  # this one cannot be stored; the others can
                if not self._v5:
                    raise _Close(_TOPIC_INVALID, str(e)) from None
                if packet.qos:
                    acks.append(self._fail_ack(_ack_for(packet, _SUCCESS), _TOPIC_INVALID, str(e)))
                continue
            cleared.add(topic)
            self._admit_publish(packet, topic, now, items, acks, item_acks)
        stored = PublishBatch(acks, item_acks, sum(1 for p in batch if p.qos))
        if items:
            try:
                stored.routed = await self._broker.route(items)
            except (MessageTooLarge, InvalidName, StorageError) as e:
                stored.error = e
        stores = self._stores
        if stores is None:
            stores = self._stores = StoreQueue(
                partial(store_batches, self._broker),
                self._batch_stored,
                limit_bytes=_STORE_QUEUE_BYTES,
            )
        stores.put(stored, sum(len(p.payload) for p in batch))
        if stores.full():
            await stores.drain()

    def _batch_stored(self, batch: PublishBatch, outcome: StoreOutcome) -> bool:
        """A batch's acks, in publish order; False once this closes the connection."""
        try:
            self._send_publish_acks(batch, outcome)
        except _Close as e:
            log.info("mqtt %s: closing: %s", self.client_id or "-", e)
            self._goodbye(e.reason, str(e))
            self._transport.close()
            return False
        return True

    def _send_publish_acks(self, batch: PublishBatch, outcome: StoreOutcome) -> None:
        acks = batch.acks
        if isinstance(outcome, MessageTooLarge | InvalidName):
            failed = _PACKET_TOO_LARGE if isinstance(outcome, MessageTooLarge) else _TOPIC_INVALID
            if not self._v5:
                raise _Close(failed, str(outcome))
            acks = [self._fail_ack(a, failed, str(outcome)) for a in acks]
        elif isinstance(outcome, StorageError):
            log.warning("mqtt %s: publish failed: %s", self.client_id, outcome)
            if not self._v5:
                raise _Close(_UNSPECIFIED, str(outcome))
            acks = [self._fail_ack(a, _UNSPECIFIED, str(outcome)) for a in acks]
        elif outcome:
            self._unstored(outcome, batch.item_acks, acks)
        self._write_acks(acks)
        if self._v5:
            self._inbound_unacked -= batch.qos_count
        self._out.flush()

    def _admit_publish(
        self,
        packet: codec.Publish,
        topic: str,
        now: int,
        items: list[Outgoing],
        acks: list[codec.Packet],
        item_acks: dict[int, int],
    ) -> None:
        """A PUBLISH whose topic passed the checks: to be routed and stored, its ack
        (if any) to be sent once it is."""
        assert self._broker is not None and self._session is not None
        qos = packet.qos
        items.append(
            Outgoing(
                message=message_from_publish(
                    packet, client_id=self.client_id, now_ms=now, topic=topic
                ),
                topic=topic,
                qos=qos,
                retain=packet.retain,
                publisher=self.client_id,
                dedup_key=(
                    self._broker.qos2_dedup_key(self._session, packet.packet_id)
                    if qos == 2
                    else None
                ),
            )
        )
        if qos:
            item_acks[len(items) - 1] = len(acks)
            acks.append(_ack_for(packet, _SUCCESS))

    def _unstored(
        self, unstored: dict[int, StorageError], item_acks: dict[int, int], acks: list[codec.Packet]
    ) -> None:
        """Publishes whose own storage topic is unavailable (the others of the batch
        were stored): v5 PUBACK/PUBREC 0x80 for those alone (retryable: the client
        may publish again). v3 acks have no failure code, and must go out in order
        (3.1.1 4.6): the acks before the first failed one are sent, then this
        connection (no other) is closed, so the client sends the rest again when it
        reconnects (docs/mqtt.md, "A storage node down")."""
        first = min(unstored)
        log.warning(
            "mqtt %s: %d publishes not stored: %s", self.client_id, len(unstored), unstored[first]
        )
        failed = sorted(item_acks[i] for i in unstored if i in item_acks)
        if not failed:
            return  # QoS 0: at most once
        if not self._v5:
            self._write_acks(acks[: failed[0]])
            self._out.flush()
            raise _Close(_UNSPECIFIED, str(unstored[first]))
        for i in unstored:
            if i in item_acks:
                self._fail_ack(acks[item_acks[i]], _UNSPECIFIED, str(unstored[i]))

    def _write_acks(self, acks: list[codec.Packet]) -> None:
        """Record each stored QoS 2 PUBLISH (a resent one is not stored twice) and
        send the acks, unless the connection is closing: publishes stored after the
        server's DISCONNECT (v5 3.14.4: nothing may follow it) or the client's
        leaving are acknowledged by the session, not on the wire."""
        assert self._session is not None
        session = self._session
        closing = self.state is ConnectionState.CLOSING
        for ack in acks:
            if isinstance(ack, codec.PubRec) and not ack.reason:
                session.qos2_arrived(ack.packet_id)
            if not closing:
                self._out.write(ack)

    def _fail_ack(self, ack: codec.Packet, reason: int, text: str) -> codec.Packet:
        """Turn a PUBACK/PUBREC into a failure, with a reason string if the client asked
        for problem information (v5 3.1.2.11.7)."""
        if isinstance(ack, codec.PubAck | codec.PubRec) and not ack.reason:
            ack.reason = reason
            if self._problem_info:
                ack.properties[codec.REASON_STRING] = text[:200]
        return ack

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------

    async def _on_subscribe(self, packet: codec.Subscribe) -> None:
        assert self._broker is not None and self._session is not None
        ids = packet.properties.get(codec.SUBSCRIPTION_ID, [])
        if any(i == 0 for i in ids):
            raise _Close(_PROTOCOL_ERROR, "subscription identifier 0")
        sub_id = ids[0] if ids else None
        reasons: list[int] = []
        retained: list[Delivery] = []
        max_levels = self._config.max_topic_levels
        # In slices: up to max_filters_per_subscribe filters, each an index update
        # and maybe a retained lookup, must not hold the loop all at once.
        async for sub in cooperatively(packet.subscriptions):
            try:
                shared = split_shared(sub.filter)
                valid = shared is not None or is_valid_filter(sub.filter)
            except ValueError:
                valid = False
                shared = None
            if valid:  # as EMQX: a shared filter's levels are counted without $share/g
                valid = topic_levels(shared[1] if shared else sub.filter) <= max_levels
            if not valid or (shared is not None and sub.no_local):
                reasons.append(_FILTER_INVALID if self._v5 else 0x80)
                continue
            if not await self._may_subscribe(sub.filter, shared):
                reasons.append(_NOT_AUTHORIZED if self._v5 else 0x80)
                continue
            options = SubOptions(
                qos=sub.qos,
                no_local=sub.no_local,
                retain_as_published=sub.retain_as_published,
                retain_handling=sub.retain_handling,
                subscription_id=sub_id,
            )
            new = await self._broker.subscribe(self._session, sub.filter, options)
            reasons.append(sub.qos)
            if shared is None and (sub.retain_handling == 0 or (sub.retain_handling == 1 and new)):
                for topic, message in await self._broker.retained(sub.filter):
                    retained.append(
                        Delivery(
                            message=message,
                            topic=topic,
                            qos=min(sub.qos, published_qos(message)),
                            retain=True,
                            subscription_ids=[sub_id] if sub_id else [],
                        )
                    )
            for sys_delivery in self._services.sys_topics(sub.filter, sub_id):
                retained.append(sys_delivery)
        await self._broker.save_subscriptions(self._session)
        self._out.write(codec.SubAck(packet_id=packet.packet_id, reasons=reasons))
        for delivery in retained:
            self.deliver(delivery)
        self._out.flush()
        self.wake()  # a new shared subscription: a new queue to pop

    async def _permitted(self, name: str, operation: Operation) -> bool:
        assert self._caller is not None
        return await self._services.processor.permitted(self._caller, "topic", name, operation)

    async def _may_subscribe(self, topic_filter: str, shared: tuple[str, str] | None) -> bool:
        """Read permission on the storage topic of the filter's first level (a wildcard
        there, ``+`` or ``#``, matches only rules allowing every name), and for a shared
        subscription on its group (docs/permissions.md)."""
        assert self._caller is not None
        if shared is not None:
            group, topic_filter = shared
            if not await self._services.processor.permitted(self._caller, "group", group, "read"):
                return False
        return await self._permitted(storage_topic(topic_filter), "read")

    async def _on_unsubscribe(self, packet: codec.Unsubscribe) -> None:
        assert self._broker is not None and self._session is not None
        reasons = []
        async for topic_filter in cooperatively(packet.filters):
            found = self._broker.unsubscribe(self._session, topic_filter)
            reasons.append(_SUCCESS if found else _NO_SUBSCRIPTION)
        await self._broker.save_subscriptions(self._session)
        self._out.write(codec.UnsubAck(packet_id=packet.packet_id, reasons=reasons))
        self._out.flush()

    # -- SessionOwner: what the broker hands this connection --------------------------

    def deliver(self, delivery: Delivery) -> None:
        self._out.deliver(delivery)

    def wake(self) -> None:
        self._out.wake()


class _Disconnected(Exception):
    """The client sent DISCONNECT: stop reading."""


def _ack_for(packet: codec.Publish, reason: int) -> codec.Packet:
    if packet.qos == 2:
        return codec.PubRec(packet_id=packet.packet_id, reason=reason)
    return codec.PubAck(packet_id=packet.packet_id, reason=reason)
