"""One AMQP connection: handshake, channel 0, heartbeats, and the frame loop that
feeds the channels (spec sections 2.2.4, 4.2).

Reading is the only loop here: bytes become frames (:mod:`protocols.amqp.codec`), frames
on channel 0 drive the connection's state table, frames on other channels go to their
:class:`~protocols.amqp.channel.Channel`. Writes go straight to the transport; whoever
writes a burst awaits :meth:`AmqpConnection.drain` so a slow peer pushes back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from pamqp import commands
from pamqp.base import Frame as MethodFrame
from pamqp.heartbeat import Heartbeat

from polymq.gateway.accounts import AuthError, Principal
from polymq.gateway.connections import AccountConnectionLimit, current_connection_id
from polymq.gateway.fairness import SLICE, pause
from polymq.gateway.lazy_deadline import LazyDeadline
from polymq.gateway.listeners import ListenerContext, peer_certificate_name
from polymq.gateway.processor import Caller
from polymq.gateway.quotas import AccountQuota
from polymq.protocols.amqp import errors
from polymq.protocols.amqp._state import CONNECTION_ACCEPTS, ConnectionState
from polymq.protocols.amqp.channel import Channel
from polymq.protocols.amqp.codec import (
    HEARTBEAT_BYTES,
    PROTOCOL_HEADER,
    FrameError,
    FrameReader,
    ProtocolHeaderError,
    WholePublish,
    method_frame,
)
from polymq.protocols.amqp.errors import AmqpError, ChannelError, ConnectionError_
from polymq.protocols.amqp.fields import FieldError, decode_table
from polymq.protocols.amqp.flow import FlowControl
from polymq.protocols.amqp.quota import charge_frame, is_publishing
from polymq.protocols.amqp.vhost import AmqpServices, VirtualHost
from polymq.storage.errors import StorageError, StorageUnavailable
from polymq.storage.lifecycle import TaskSet

__all__ = ["AmqpConnection"]

log = logging.getLogger(__name__)

_CLOSE_OK_TIMEOUT_S: Final = 1.0
_MIN_FRAME_MAX: Final = 4096  # spec: frame-min-size
_BLOCKED_AFTER_S: Final = 1.0
_READ_SIZE: Final = 1 << 16

SERVER_CAPABILITIES: Final = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": True,
}


class _Closed(Exception):
    """The connection is finished; unwind the reader."""


class _FrameTimeout(Exception):
    """A frame begun was not received whole within ``limits.frame_timeout_ms``."""


class AmqpConnection:
    def __init__(
        self,
        context: ListenerContext,
        services: AmqpServices,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        flow: FlowControl | None = None,
    ) -> None:
        self._context = context
        self._flow = flow
        self._services = services
        self._reader = reader
        self._writer = writer
        # A verified client certificate's account name ([tls] principal_from): offers
        # the EXTERNAL mechanism (RabbitMQ's rabbitmq_auth_mechanism_ssl).
        self._certificate_name = peer_certificate_name(writer, context.tls)
        self.processor = context.processor
        config, limits = context.config.amqp, context.config.limits
        self._hard_max = limits.max_frame_bytes
        self.frame_max = (
            min(config.frame_max, self._hard_max) if config.frame_max else self._hard_max
        )
        self.max_message_bytes = limits.max_frame_bytes
        self._channel_max = config.channel_max
        self._heartbeat_s = config.heartbeat_s
        self._handshake_s = limits.handshake_timeout_ms / 1000
        self._frame_timeout_s = limits.frame_timeout_ms / 1000
        # Until connection.tune-ok, frames are held to the small pre-login limit: an
        # anonymous peer can make the server buffer at most that much.
        self._frames = FrameReader(
            frame_max=min(self.frame_max, limits.max_unauthenticated_frame_bytes),
            hard_max=self._hard_max,
            max_depth=limits.max_nesting_depth,
        )
        self._budget = context.frame_budget
        self._reservation: AbstractAsyncContextManager[None] | None = None
        self._reserved_for = -1  # frames_read when the reservation was taken
        # (frames_read, loop time) when the partly received frame began to arrive.
        self._frame_begun: tuple[int, float] | None = None
        self._handshake_deadline = 0.0  # loop time; set when the connection starts
        self._state = ConnectionState.AWAIT_START_OK
        self.channels: dict[int, Channel] = {}
        self._caller: Caller | None = None
        self._vhost: VirtualHost | None = None
        self._mechanism = "PLAIN"
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._connection_id = current_connection_id()
        # Exclusive queues belong to this key: unique across gateways (it names this
        # gateway's instance) even without a registry id.
        self.key = f"{services.membership.instance}/{self._connection_id}:{id(self)}"
        # Channel teardowns and give-backs, which the cleanup lets finish, and the
        # heartbeats, which it cancels.
        self._tasks = TaskSet(f"amqp connection {self.key}")
        self._closing = asyncio.Event()
        # The frame loop's task while it waits in a read: ``fail`` (from any task)
        # cancels that read, so a read costs no task and no second waiter of its own.
        self._reading: asyncio.Task[Any] | None = None
        self._read_interrupted = False
        self._loop_task: asyncio.Task[Any] | None = None  # the frame loop's, once known
        # The limit of the read under way, and whether it cancelled the read. No
        # period (inf): the timer goes straight to the earliest limit and, firing for
        # one since met, on to the limit of the read then under way.
        self._read_deadline = LazyDeadline(
            asyncio.get_running_loop(), self._read_expiry, period=math.inf
        )
        self._read_expired = False
        self._blocked_capable = False
        # The account's quota as last looked up, and for which quotas and principal.
        self._quota: AccountQuota | None = None
        self._quotas: object = None
        self._quota_principal: Principal | None = None

    @property
    def caller(self) -> Caller:
        assert self._caller is not None
        return self._caller

    @property
    def quota(self) -> AccountQuota:
        """The logged-in account's quota (gateway.quotas), looked up again only when the
        account or the gateway's quotas object changed: every frame read and every
        consumer turn asks for it."""
        quotas, principal = self._context.quotas, self.caller.principal
        if quotas is not self._quotas or principal is not self._quota_principal:
            self._quota = quotas.of(principal)
            self._quotas, self._quota_principal = quotas, principal
        assert self._quota is not None
        return self._quota

    @property
    def vhost(self) -> VirtualHost:
        """The loaded vhost: every channel method that needs it first awaits
        :meth:`ensure_vhost`."""
        assert self._vhost is not None
        return self._vhost

    @property
    def has_vhost(self) -> bool:
        return self._vhost is not None

    async def ensure_vhost(self) -> VirtualHost:
        """The vhost, loaded now if connection.open could not (its storage was
        unavailable then): :class:`StorageUnavailable` again closes only the channel
        that needed it, and the next method tries again."""
        if self._vhost is None:
            self._vhost = await self._services.get(self.caller)
        return self._vhost

    @property
    def namespace(self) -> str:
        return self.caller.namespace

    # -- writing ---------------------------------------------------------------------

    def send_bytes(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    def send_frame(self, channel: int, method: MethodFrame) -> None:
        self.send_bytes(method_frame(channel, method))

    async def drain(self) -> None:
        """Wait while the transport's buffer is over its high-water mark. With nothing
        buffered (the usual case: loopback and most sockets take a burst whole) the
        transport cannot be paused, so ``StreamWriter.drain``'s three coroutines are
        skipped: at everyday rates a message's frames drained two or three times."""
        writer = self._writer
        if writer.is_closing() or not writer.transport.get_write_buffer_size():
            return
        await writer.drain()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.spawn(coro)

    # -- errors ----------------------------------------------------------------------

    def fail(self, error: AmqpError) -> None:
        """A hard error: connection.close with its code; the reader waits for close-ok
        (briefly) and ends the connection."""
        if self._state is ConnectionState.CLOSING:
            return
        log.info("amqp: closing connection: %s", error.reply_text)
        self._state = ConnectionState.CLOSING
        self.send_frame(
            0,
            commands.Connection.Close(
                reply_code=error.code,
                reply_text=error.reply_text,
                class_id=error.class_id,
                method_id=error.method_id,
            ),
        )
        for channel in self.channels.values():
            channel.begin_close()
        self._closing.set()
        reading = self._reading
        if reading is not None and not self._read_interrupted:
            self._read_interrupted = True
            if not self._read_expired:  # else cancelled already, by its deadline
                reading.cancel()

    def fail_channel(self, channel: Channel, error: AmqpError) -> None:
        """A soft error: channel.close; its unacked messages go back now."""
        if isinstance(error, ConnectionError_) or not isinstance(error, ChannelError):
            self.fail(error)
            return
        if channel.state.name == "CLOSING":
            return
        channel.begin_close()
        channel.send(
            commands.Channel.Close(
                reply_code=error.code,
                reply_text=error.reply_text,
                class_id=error.class_id,
                method_id=error.method_id,
            )
        )
        self.spawn(channel.teardown())

    def forget_channel(self, channel: Channel) -> None:
        channel.closed = True
        if self.channels.get(channel.number) is channel:
            del self.channels[channel.number]

    # -- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._serve()
        finally:
            await self._cleanup()

    async def _serve(self) -> None:
        self._handshake_deadline = asyncio.get_running_loop().time() + self._handshake_s
        try:
            async with asyncio.timeout_at(self._handshake_deadline):
                await self._read_protocol_header()
        except TimeoutError:
            log.info(
                "amqp: no protocol header within %.1f s, closing %s", self._handshake_s, self.key
            )
            return
        except _Closed:
            return
        except ProtocolHeaderError:
            self.send_bytes(PROTOCOL_HEADER)  # section 4.2.2: say what we speak, close
            return
        self.send_frame(
            0,
            commands.Connection.Start(
                version_major=0,
                version_minor=9,
                server_properties={
                    "product": "polymq",
                    "version": "0.1",
                    "platform": "Python/asyncio",
                    "cluster_name": "polymq",
                    "copyright": "polymq authors",
                    "information": "AMQP 0-9-1 over polymq storage",
                    "capabilities": dict(SERVER_CAPABILITIES),
                },
                mechanisms="PLAIN AMQPLAIN"
                + (" EXTERNAL" if self._certificate_name is not None else ""),
                locales="en_US",
            ),
        )
        try:
            await self._frame_loop()
        except _Closed:
            return

    async def _read_protocol_header(self) -> None:
        while True:
            data = await self._reader.read(8)
            if not data:
                raise _Closed
            self._frames.receive_data(data)
            frame = self._frames.next_frame()
            if frame is not None:
                return

    async def _frame_loop(self) -> None:
        handled = 0
        frames = self._frames
        while True:
            if self._reservation is not None or frames.incomplete_frame() is not None:
                await self._hold_budget()
            try:
                data = await self._read()
            except _FrameTimeout:
                self.fail(
                    ConnectionError_(
                        errors.FRAME_ERROR,
                        f"frame not received whole within {self._frame_timeout_s:g} s",
                    )
                )
                await self._await_close_ok()
                return
            if not data:  # the peer hung up: still handle what it sent before
                await self._close_channels(flush=True)
                return
            self._frames.receive_data(data)
            while True:
                try:
                    whole = (
                        self._frames.next_publish() if self._state is ConnectionState.OPEN else None
                    )
                    if whole is not None:
                        await self._dispatch_publish(whole)
                        handled += whole.frames
                    else:
                        frame = self._frames.next_frame()
                        if frame is None:
                            break
                        await self._dispatch(frame.channel, frame.value)
                        handled += 1
                    if handled >= SLICE:  # a read of tiny frames: let others run
                        handled = 0
                        await pause()
                except FrameError as e:
                    self.fail(ConnectionError_(e.reply_code, str(e), e.class_id, e.method_id))
                    await self._await_close_ok()
                    return
                except ProtocolHeaderError as e:
                    self.fail(ConnectionError_(errors.FRAME_ERROR, str(e)))
                    await self._await_close_ok()
                    return
                except AmqpError as e:
                    self.fail(e)
                except AuthError as e:  # e.g. the vhost's namespace refused mid-way
                    self.fail(ConnectionError_(errors.ACCESS_REFUSED, str(e)))
                except StorageError as e:
                    log.warning("amqp: storage failed under connection %s: %s", self.key, e)
                    self.fail(ConnectionError_(errors.INTERNAL_ERROR, str(e)))
                except _Closed:
                    raise
                except Exception as e:  # our bug, not the peer's: say so, then close
                    log.exception("amqp: handling a frame of connection %s failed", self.key)
                    self.fail(ConnectionError_(errors.INTERNAL_ERROR, type(e).__name__))
                if self._closing.is_set():
                    await self._await_close_ok()
                    return
            await self.drain()

    async def _hold_budget(self) -> None:
        """Before reading the rest of a frame, reserve its declared size from the
        gateway's frame budget (waiting, and so not reading, while it is spent), and
        give back the previous frame's once it has been handled."""
        frames = self._frames
        if self._reservation is not None and frames.frames_read != self._reserved_for:
            await self._release_budget()
        size = frames.incomplete_frame()
        if size is not None and self._reservation is None:
            reservation = self._budget.reserve(size)
            await reservation.__aenter__()
            self._reservation, self._reserved_for = reservation, frames.frames_read

    async def _release_budget(self) -> None:
        reservation, self._reservation = self._reservation, None
        if reservation is not None:
            await reservation.__aexit__(None, None, None)

    def _read_limit(self) -> tuple[float | None, bool]:
        """When the next read must be done (loop time; None: never), and whether the
        limit is the frame timeout's (a frame begun must arrive whole) rather than
        the heartbeat or handshake one. Limits kept as loop times, not recomputed
        from what is left: each read of a frame begun gives its deadline the same
        limit, which moves no timer."""
        heartbeat_s = self._heartbeat_s
        frames = self._frames
        if self._state is ConnectionState.OPEN and not frames.buffered:
            self._frame_begun = None  # the common case: between frames, logged in
            if not heartbeat_s:
                return None, False
            return self._read_deadline.loop.time() + heartbeat_s * 2, False
        now = self._read_deadline.loop.time()
        at: float | None = now + heartbeat_s * 2 if heartbeat_s else None
        if self._state in (
            ConnectionState.AWAIT_START_OK,
            ConnectionState.AWAIT_TUNE_OK,
            ConnectionState.AWAIT_OPEN,
        ):
            at = self._handshake_deadline
        if not frames.buffered:
            self._frame_begun = None
        else:
            if self._frame_begun is None or self._frame_begun[0] != frames.frames_read:
                self._frame_begun = (frames.frames_read, now)
            frame_at = self._frame_begun[1] + self._frame_timeout_s
            if at is None or frame_at < at:
                return frame_at, True
        return at, False

    async def _read(self) -> bytes:
        """The next bytes from the peer (b"" once it hung up). Waits in the frame
        loop's own task: no task and no closing waiter per read (they were a good part
        of a message's CPU at everyday rates). A ``fail`` from another task meanwhile
        cancels the read (see ``fail``); the bytes not read stay in the stream for
        ``_await_close_ok``. The read's time limit (heartbeats, handshake, a frame
        begun) is kept by the connection's one :class:`LazyDeadline`, not by an
        ``asyncio.timeout`` armed and cancelled around every read."""
        if self._closing.is_set():
            await self._await_close_ok()
            raise _Closed
        at, for_frame = self._read_limit()
        task = self._loop_task
        if task is None:
            task = self._loop_task = asyncio.current_task()
            assert task is not None
        self._reading = task
        deadline = self._read_deadline
        if at is not None:
            deadline.start(at)
        try:
            return await self._reader.read(_READ_SIZE)
        except ConnectionError:
            return b""  # reset by the peer: as a hang-up
        except asyncio.CancelledError:
            interrupted, expired = self._read_interrupted, self._read_expired
            if not (interrupted or expired):
                raise
            self._read_expired = False
            if task.uncancel() > 0:
                raise  # cancelled from outside as well (the server stopping)
            if expired and not interrupted:
                if for_frame:
                    raise _FrameTimeout from None
                if self._state is ConnectionState.OPEN:
                    log.info("amqp: missed heartbeats, closing connection %s", self.key)
                else:
                    log.info(
                        "amqp: no handshake within %.1f s, closing %s", self._handshake_s, self.key
                    )
                raise _Closed from None
        finally:
            self._reading = None
            if at is not None:
                deadline.stop()
        # ``fail`` interrupted the read: closing, as the close-ok wait says.
        await self._await_close_ok()
        raise _Closed

    def _read_expiry(self) -> None:
        """The read under way is past its limit (``_read_deadline``'s expiry): cancel
        it, unless ``fail`` has already."""
        reading = self._reading
        if reading is None or self._read_interrupted:
            return
        self._read_expired = True
        reading.cancel()

    async def _await_close_ok(self) -> None:
        """After our connection.close: wait briefly for close-ok, reading nothing
        else, then the socket closes."""
        await self.drain()
        try:
            async with asyncio.timeout(_CLOSE_OK_TIMEOUT_S):
                while True:
                    data = await self._reader.read(1 << 16)
                    if not data:
                        return
                    self._frames.receive_data(data)
                    while (frame := self._frames.next_frame()) is not None:
                        if isinstance(frame.value, commands.Connection.CloseOk):
                            return
                        if isinstance(frame.value, commands.Connection.Close):
                            self.send_frame(0, commands.Connection.CloseOk())  # both closed
                            await self.drain()
                            return
        except (TimeoutError, FrameError, ProtocolHeaderError, ConnectionError):
            return

    async def _dispatch(self, number: int, value: object) -> None:
        if isinstance(value, Heartbeat):
            return
        if number == 0:
            if not isinstance(value, MethodFrame):
                raise ConnectionError_(errors.UNEXPECTED_FRAME, "content frame on channel 0")
            await self._connection_method(value)
            return
        if self._state is not ConnectionState.OPEN:
            if self._state is ConnectionState.CLOSING:
                return
            raise ConnectionError_(errors.CHANNEL_ERROR, f"channel {number} before connection.open")
        channel = self.channels.get(number)
        if isinstance(value, commands.Channel.Open):
            if channel is not None:
                raise ConnectionError_(
                    errors.CHANNEL_ERROR, f"channel {number} is already open", 20, 10
                )
            if number > self._channel_max:
                raise ConnectionError_(
                    errors.NOT_ALLOWED, f"channel {number} above channel_max", 20, 10
                )
            self.channels[number] = Channel(self, number)
            self.send_frame(number, commands.Channel.OpenOk())
            return
        if channel is None:
            if isinstance(value, commands.Channel.CloseOk):
                return
            raise ConnectionError_(
                errors.CHANNEL_ERROR, f"expected 'channel.open' on channel {number}"
            )
        flow = self._flow
        if flow is not None and flow.engaged and isinstance(value, commands.Basic.Publish):
            await self._blocked(flow.reason, flow.wait_released())
        channel.on_frame(value)
        if not channel.space.is_set():
            await self._wait_for_space(channel)
        if charge_frame(self.quota, value):  # over the account's rates (docs/quotas.md)
            if is_publishing(value):
                held = self.quota.hold("amqp", "produce", "requests")
                await self._blocked("polymq: over the account's publish rate", held)
            else:
                await self.quota.hold("amqp", "requests")

    async def _dispatch_publish(self, whole: WholePublish) -> None:
        """A publish read whole: what :meth:`_dispatch` does with its frames, with
        one hand-over to the channel; frame by frame where the channel cannot take it
        whole (no such channel, closing, amid another content, a bad header)."""
        channel = self.channels.get(whole.channel)
        flow = self._flow
        if channel is not None and flow is not None and flow.engaged:
            await self._blocked(flow.reason, flow.wait_released())
        if channel is None or not channel.on_publish(whole):
            await self._dispatch(whole.channel, whole.method)
            await self._dispatch(whole.channel, whole.header)
            if whole.frames == 3:
                await self._dispatch(whole.channel, whole.body)
            return
        if not channel.space.is_set():
            await self._wait_for_space(channel)
        owed = charge_frame(self.quota, whole.method)
        if whole.frames == 3:
            owed = charge_frame(self.quota, whole.body) or owed
        if owed:  # over the account's rates (docs/quotas.md)
            held = self.quota.hold("amqp", "produce", "requests")
            await self._blocked("polymq: over the account's publish rate", held)

    async def _wait_for_space(self, channel: Channel) -> None:
        """Stop reading while a channel's backlog drains. If that takes a while, tell
        clients that understand it (RabbitMQ's connection.blocked) why they stall."""
        try:
            async with asyncio.timeout(_BLOCKED_AFTER_S):
                await channel.space.wait()
                return
        except TimeoutError:
            pass
        await self._blocked("polymq: storage is behind", channel.space.wait())

    async def _blocked(self, reason: str, until: Coroutine[Any, Any, Any]) -> None:
        """Read nothing until ``until`` is done, framed by connection.blocked and
        connection.unblocked for the clients that announced the capability."""
        if self._blocked_capable:
            self.send_frame(0, commands.Connection.Blocked(reason=reason))
            await self.drain()
        waiting = asyncio.ensure_future(until)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({waiting, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, closing):
                task.cancel()
        if self._closing.is_set():
            return
        if self._blocked_capable:
            self.send_frame(0, commands.Connection.Unblocked())

    # -- channel 0 -------------------------------------------------------------------

    async def _connection_method(self, method: MethodFrame) -> None:
        accepted = CONNECTION_ACCEPTS[self._state]
        following = accepted.get(type(method))
        if following is None:
            if self._state is ConnectionState.CLOSING:
                return
            raise ConnectionError_(
                errors.COMMAND_INVALID
                if self._state is ConnectionState.OPEN
                else errors.CHANNEL_ERROR,
                f"unexpected {method.name} on channel 0",
                method.index >> 16,
                method.index & 0xFFFF,
            )
        if isinstance(method, commands.Connection.StartOk) and method.mechanism == "EXTERNAL":
            self._external_start_ok(method)
        elif isinstance(method, commands.Connection.StartOk):
            await self._start_ok(method)
        elif isinstance(method, commands.Connection.TuneOk):
            self._tune_ok(method)
        elif isinstance(method, commands.Connection.Open):
            await self._open(method)
        elif isinstance(method, commands.Connection.Close):
            await self._close_channels(flush=True)
            self.send_frame(0, commands.Connection.CloseOk())
            await self.drain()
            raise _Closed
        elif isinstance(method, commands.Connection.CloseOk):
            raise _Closed
        elif isinstance(method, commands.Connection.UpdateSecret):
            self.send_frame(0, commands.Connection.UpdateSecretOk())
        self._state = following

    async def _start_ok(self, method: commands.Connection.StartOk) -> None:
        mechanism = method.mechanism
        response = method.response
        raw = response.encode() if isinstance(response, str) else bytes(response or b"")
        user, password = _credentials(mechanism, raw)
        try:
            principal = await self._context.accounts.authenticate(
                user, password, protocol="amqp", peer=self._peer()
            )
        except AuthError as e:
            raise ConnectionError_(
                errors.ACCESS_REFUSED,
                f"Login was refused using authentication mechanism {mechanism}."
                " For details see the broker logfile.",
                10,
                11,
            ) from e
        self._logged_in(method, principal)

    def _external_start_ok(self, method: commands.Connection.StartOk) -> None:
        """EXTERNAL: the client certificate the TLS handshake verified names the
        account (its CN); the response, if any, is not a password and is ignored."""
        try:
            if self._certificate_name is None:
                raise AuthError("no verified client certificate")
            principal = self._context.accounts.by_certificate(self._certificate_name)
        except AuthError as e:
            raise ConnectionError_(
                errors.ACCESS_REFUSED,
                "Login was refused using authentication mechanism EXTERNAL."
                " For details see the broker logfile.",
                10,
                11,
            ) from e
        self._logged_in(method, principal)

    def _logged_in(self, method: commands.Connection.StartOk, principal: Principal) -> None:
        client = method.client_properties or {}
        capabilities = client.get("capabilities")
        self._blocked_capable = isinstance(capabilities, dict) and bool(
            capabilities.get("connection.blocked")
        )
        name = client.get("connection_name") or client.get("product")
        self._caller = Caller(
            principal=principal,
            namespace=principal.default_namespace,
            protocol="amqp",
            connection_id=self._connection_id,
            client_id=str(name) if name else None,
        )
        self.send_frame(
            0,
            commands.Connection.Tune(
                channel_max=self._channel_max,
                frame_max=self.frame_max,
                heartbeat=self._heartbeat_s,
            ),
        )

    def _peer(self) -> str:
        """The client's ``host:port``, as the connection registry lists it."""
        known = (
            None
            if self._connection_id is None
            else self._context.connections.get(self._connection_id)
        )
        return "" if known is None else known.peer

    def _tune_ok(self, method: commands.Connection.TuneOk) -> None:
        if method.frame_max:
            if method.frame_max < _MIN_FRAME_MAX:
                raise ConnectionError_(errors.NOT_ALLOWED, "frame_max below 4096", 10, 31)
            self.frame_max = min(self.frame_max, method.frame_max)
        self._frames.frame_max = self.frame_max
        if method.channel_max:
            self._channel_max = min(self._channel_max, method.channel_max) or self._channel_max
        self._heartbeat_s = method.heartbeat
        if self._heartbeat_s:
            self._heartbeat_task = self._tasks.spawn(self._send_heartbeats())

    async def _open(self, method: commands.Connection.Open) -> None:
        caller = self.caller
        vhost = method.virtual_host or "/"
        namespace = caller.principal.default_namespace if vhost == "/" else vhost
        if not caller.principal.may_use(namespace):
            raise ConnectionError_(
                errors.NOT_ALLOWED,
                f"access to vhost '{vhost}' refused for user '{caller.principal.name}'",
                10,
                40,
            )
        try:
            known = namespace in await self.processor.list_namespaces(caller)
        except StorageUnavailable as e:
            # No storage node answers (a gateway started before any, every shard of
            # the replicated pool moving at once): open, as below while the
            # definitions are out of reach; the channels answer what storage can.
            log.warning("amqp: vhost '%s' not checked at connection.open: %s", vhost, e)
            known = True
        if not known:
            raise ConnectionError_(errors.NOT_ALLOWED, f"vhost '{vhost}' not found", 10, 40)
        self._caller = Caller(
            principal=caller.principal,
            namespace=namespace,
            protocol="amqp",
            connection_id=caller.connection_id,
            client_id=caller.client_id,
        )
        try:
            self._vhost = await self._services.get(self._caller)
        except StorageUnavailable as e:
            # The namespace's definitions live on its home node: while that is down,
            # the connection opens anyway and its channels load the vhost when they
            # first need it.
            log.warning("amqp: vhost '%s' not loaded at connection.open: %s", vhost, e)
        if self._connection_id is not None:
            try:
                self._context.connections.identify(
                    self._connection_id,
                    principal=caller.principal,
                    namespace=namespace,
                    client_id=caller.client_id,
                )
            except AccountConnectionLimit as e:  # RabbitMQ's per-user connection limit
                raise ConnectionError_(
                    errors.NOT_ALLOWED, f"connection refused for user: {e}", 10, 40
                ) from e
        self.send_frame(0, commands.Connection.OpenOk())

    async def _send_heartbeats(self) -> None:
        interval = max(1.0, self._heartbeat_s / 2)
        while not self._writer.is_closing():
            await asyncio.sleep(interval)
            self.send_bytes(HEARTBEAT_BYTES)

    # -- cleanup ---------------------------------------------------------------------

    async def _close_channels(self, *, flush: bool = False) -> None:
        channels = list(self.channels.values())
        if flush:
            for channel in channels:
                await channel.flush()
        self.channels.clear()
        for channel in channels:
            await channel.teardown()

    async def _cleanup(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        self._read_deadline.close()
        await self._release_budget()
        try:
            await self._close_channels()
            if self._vhost is not None and self._caller is not None:
                await self._vhost.release_owner(self._caller, self.key)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        except Exception:
            log.exception("amqp: cleanup of connection %s failed", self.key)
        await self._tasks.close()


def _credentials(mechanism: str, response: bytes) -> tuple[str | None, str | None]:
    """User and password from a PLAIN (``\\0user\\0password``) or AMQPLAIN (a field
    table without its length prefix, keys LOGIN and PASSWORD) response."""
    if mechanism == "PLAIN":
        parts = response.split(b"\0")
        if len(parts) != 3:
            return None, None
        return parts[1].decode(errors="replace"), parts[2].decode(errors="replace")
    if mechanism == "AMQPLAIN":
        try:
            table, _ = decode_table(
                len(response).to_bytes(4, "big") + response, 0, 4 + len(response), 2
            )
        except FieldError:
            return None, None
        return _text(table.get("LOGIN")), _text(table.get("PASSWORD"))
    return None, None


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    return None
