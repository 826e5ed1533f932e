"""One AMQP channel: content assembly, the method handlers, consumers and
acknowledgements.

Frames are taken apart by the connection's reader and queued in the channel's inbox;
one task per channel runs the commands in order (the spec makes a channel's methods
sequential), handing runs of consecutive publishes to storage as one append so a
pipelining publisher costs one group commit per run, not per message.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from pamqp import commands
from pamqp.base import Frame as MethodFrame

from polymq.gateway.accounts import AccessDenied
from polymq.protocols.amqp import declarations, errors
from polymq.protocols.amqp._state import ChannelState, ContentState, content_transition
from polymq.protocols.amqp.codec import (
    ContentHeaderFrame,
    WholePublish,
    content_frames,
    deliver_frames,
)
from polymq.protocols.amqp.consumer import INVISIBLE_MS, POP_BATCH, Consumer, Delivery
from polymq.protocols.amqp.dead_letter import dead_letter
from polymq.protocols.amqp.errors import AmqpError, ChannelError, ConnectionError_
from polymq.protocols.amqp.expiry import expires_at
from polymq.protocols.amqp.properties import (
    delivery_content,
    with_header,
)
from polymq.protocols.amqp.publishing import REPLY_TO, Publish, Publisher
from polymq.protocols.amqp.queues import QueueDef
from polymq.storage.errors import (
    InvalidReceipt,
    ShardAway,
    StorageError,
)
from polymq.storage.model import QueueRef, StoredMessage

if TYPE_CHECKING:
    from polymq.protocols.amqp.connection import AmqpConnection

__all__ = ["Channel"]

log = logging.getLogger(__name__)

_RENEW_EVERY_S: Final = INVISIBLE_MS / 1000 / 3
_INBOX_HIGH: Final = 512


class _Renew:
    """Inbox marker: renew the leases of unacked deliveries (run in order with acks,
    so a renewal never races an ack for the same receipt)."""


_RENEW = _Renew()


class _Flush:
    """Inbox marker: everything queued before it has been handled."""

    def __init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()


_Marker = _Renew | _Flush


class _Inbox:
    """The channel's ordered command queue, with a high-water mark the reader waits on.
    The task parks on a bare future, not an ``asyncio.Event``: at everyday rates it
    parks twice per message (for the publish, for the ack), and Event.wait is a
    coroutine of its own, with a waiter list, around the same future."""

    def __init__(self) -> None:
        self.items: collections.deque[Publish | MethodFrame | _Marker] = collections.deque()
        self.space = asyncio.Event()
        self.space.set()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Publish | MethodFrame | _Marker) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if len(self.items) >= _INBOX_HIGH:
            self.space.clear()

    async def get(self) -> Publish | MethodFrame | _Marker:
        while not self.items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self.take()

    def take(self) -> Publish | MethodFrame | _Marker:
        """The next item, there being one (a run's next publish or ack: no coroutine)."""
        item = self.items.popleft()
        if len(self.items) < _INBOX_HIGH // 2:
            self.space.set()
        return item

    def clear(self) -> None:
        """Drop queued commands (the channel is closing); release flush waiters."""
        for item in self.items:
            if isinstance(item, _Flush) and not item.done.done():
                item.done.set_result(None)
        self.items.clear()
        self.space.set()


Handler = Callable[["Channel", Any], Awaitable[None]]


class Channel:
    def __init__(self, conn: AmqpConnection, number: int) -> None:
        self.conn = conn
        self.number = number
        self.state = ChannelState.OPEN
        self._content = ContentState.METHOD
        self._publish: Publish | None = None
        self._inbox = _Inbox()
        self.consumers: dict[str, Consumer] = {}
        self.unacked: dict[int, Delivery] = {}
        self._next_tag = 1
        self._prefetch = 0  # for consumers created from now on (per consumer)
        self._global_prefetch = 0
        self.reserved = 0  # credit held by consumers fetching right now
        self._flow_active = True
        self.publisher = Publisher(self)
        self._tx: list[Publish] | None = None
        self._tx_acks: list[tuple[int, bool]] = []
        self.reply_token: str | None = None
        self.closed = False  # forgotten by the connection: the command loop ends
        self._task = asyncio.create_task(self._run(), name=f"amqp-channel-{number}")
        self._renewer = asyncio.create_task(self._renew_timer())

    # -- frames from the reader ------------------------------------------------------

    @property
    def space(self) -> asyncio.Event:
        return self._inbox.space

    def on_frame(self, value: object) -> None:
        """Take one frame (synchronously: content assembly); complete commands go to
        the inbox."""
        if isinstance(value, MethodFrame):
            kind = "content-method" if isinstance(value, commands.Basic.Publish) else "method"
        elif isinstance(value, ContentHeaderFrame):
            kind = "header"
        else:
            kind = "body"
        if self.state is ChannelState.CLOSING:
            if isinstance(value, commands.Channel.CloseOk):
                self.conn.forget_channel(self)
            elif isinstance(value, commands.Channel.Close):
                self.conn.send_frame(self.number, commands.Channel.CloseOk())
            return  # everything else is dropped until close-ok (section 4.5)
        following = content_transition(self._content, kind)
        if following is None:
            raise ConnectionError_(
                errors.UNEXPECTED_FRAME, f"unexpected {kind} frame on channel {self.number}"
            )
        self._content = following
        if isinstance(value, commands.Basic.Publish):
            self._publish = Publish(value)
        elif isinstance(value, ContentHeaderFrame):
            publish = self._publish
            assert publish is not None
            if value.class_id != 60:
                raise ConnectionError_(errors.FRAME_ERROR, "content header for a non-basic class")
            limit = self.conn.max_message_bytes
            if value.body_size > limit:
                raise ConnectionError_(
                    errors.FRAME_ERROR,
                    f"message body of {value.body_size} bytes exceeds the limit of {limit}",
                )
            publish.header = value
            if value.body_size == 0:
                self._complete()
        elif isinstance(value, bytes):
            publish = self._publish
            assert publish is not None and publish.header is not None
            publish.chunks += value
            publish.received += len(value)
            if publish.received > publish.header.body_size:
                raise ConnectionError_(errors.FRAME_ERROR, "body longer than its content header")
            if publish.received == publish.header.body_size:
                self._complete()
        else:
            assert isinstance(value, MethodFrame)
            self._inbox.put(value)

    def on_publish(self, whole: WholePublish) -> bool:
        """Take a basic.publish read whole (the frames of one publish in one go): what
        :meth:`on_frame` does with its frames, at once. ``False`` when the frames must
        go one by one instead (the channel closing or amid another content, a header
        that is not basic's or a body over the limit: on_frame says what is wrong)."""
        header = whole.header
        if (
            self.state is not ChannelState.OPEN
            or self._content is not ContentState.METHOD
            or header.class_id != 60
            or header.body_size > self.conn.max_message_bytes
        ):
            return False
        self._inbox.put(Publish(whole.method, header, whole.body, header.body_size))
        return True

    def _complete(self) -> None:
        publish = self._publish
        assert publish is not None
        self._publish = None
        self._content = ContentState.METHOD
        self._inbox.put(publish)

    # -- the command loop ------------------------------------------------------------

    async def _run(self) -> None:
        while not self.closed:
            item = await self._inbox.get()
            if isinstance(item, _Flush):
                item.done.set_result(None)
                continue
            if self.state is ChannelState.CLOSING:
                continue
            try:
                if isinstance(item, Publish):
                    batch = [item]
                    while self._inbox.items and isinstance(self._inbox.items[0], Publish):
                        next_item = self._inbox.take()
                        assert isinstance(next_item, Publish)
                        batch.append(next_item)
                    if not self.conn.has_vhost:
                        await self._guard(self._load_vhost(), batch[0].method)
                    await self._guard(self._publish_batch(batch), batch[0].method)
                elif isinstance(item, _Renew):
                    await self._renew_leases()
                elif isinstance(item, commands.Basic.Ack) and self._tx is None:
                    await self._guard(self._ack_run(item), item)
                else:
                    handler = _HANDLERS.get(type(item))
                    if handler is None:
                        raise ConnectionError_(
                            errors.NOT_IMPLEMENTED,
                            f"method {item.name} is not supported",
                            *_ids(item),
                        )
                    if not self.conn.has_vhost and type(item) not in _WITHOUT_VHOST:
                        await self._guard(self._load_vhost(), item)
                    await self._guard(handler(self, item), item)
            except AmqpError as e:
                if isinstance(e, ChannelError):
                    self.conn.fail_channel(self, e)
                else:
                    self.conn.fail(e)
            except Exception as e:
                log.exception("amqp channel %d failed", self.number)
                self.conn.fail(ConnectionError_(errors.INTERNAL_ERROR, str(e)))

    async def _renew_timer(self) -> None:
        while True:
            await asyncio.sleep(_RENEW_EVERY_S)
            if self.unacked and self.state is ChannelState.OPEN:
                self._inbox.put(_RENEW)

    async def _renew_leases(self) -> None:
        processor, caller = self.conn.processor, self.conn.caller
        renew_before = processor.clock.now_ms() + INVISIBLE_MS // 2
        for tag, delivery in list(self.unacked.items()):
            stored = delivery.stored
            if stored.receipt is None or (stored.next_visible_ms or 0) > renew_before:
                continue
            try:
                renewed = await processor.change_invisibility(
                    caller, delivery.queue.group, stored.receipt, INVISIBLE_MS
                )
            except StorageError:
                continue  # acked through a purge or deleted meanwhile
            if self.unacked.get(tag) is delivery:
                delivery.stored = renewed

    async def _load_vhost(self) -> None:
        await self.conn.ensure_vhost()

    async def _guard(self, call: Awaitable[None], method: MethodFrame) -> None:
        """Run a handler, turning the storage and access errors a peer can provoke
        into the channel error the spec names."""
        try:
            await call
        except AmqpError as e:
            if not e.class_id:
                e.class_id, e.method_id = _ids(method)
            raise
        except AccessDenied as e:
            raise ChannelError(errors.ACCESS_REFUSED, str(e), *_ids(method)) from e
        except StorageError as e:  # a queue deleted meanwhile, its node down, a bad name
            raise errors.from_storage(e, *_ids(method)) from e

    def send(self, method: MethodFrame) -> None:
        self.conn.send_frame(self.number, method)

    # -- teardown --------------------------------------------------------------------

    async def flush(self) -> None:
        """Wait until the commands already received are handled: a peer that publishes
        and then closes (or hangs up) has its publishes stored, as with RabbitMQ."""
        if self.state is not ChannelState.OPEN or self._task.done():
            return
        marker = _Flush()
        self._inbox.put(marker)
        await asyncio.wait([marker.done, self._task], return_when=asyncio.FIRST_COMPLETED)

    def begin_close(self) -> None:
        """Stop consuming and drop queued commands (an error closed the channel)."""
        self.state = ChannelState.CLOSING
        self._inbox.clear()

    async def teardown(self) -> None:
        """Cancel consumers and give every unacked delivery back to its queue (it comes
        back redelivered)."""
        self.state = ChannelState.CLOSING
        self._inbox.clear()
        self._renewer.cancel()
        if self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        consumers = list(self.consumers.values())
        self.consumers.clear()
        await asyncio.gather(*(consumer.stop() for consumer in consumers))
        if self.reply_token is not None:
            self.conn.vhost.replies.unregister(self.reply_token)
        deliveries = list(self.unacked.values())
        self.unacked.clear()
        await self._requeue(deliveries)
        if not consumers:
            return
        vhost = self.conn.vhost
        for consumer in consumers:
            consumer.queue.consumers.discard(consumer)
            await vhost.consumer_removed(self.conn.caller, consumer, consumer.queue)

    async def _requeue(self, deliveries: Sequence[Delivery]) -> None:
        """Give deliveries back to their queues: ready at once, where they were, to be
        redelivered (counted as ready by :class:`~protocols.amqp.requeued.Requeued`)."""
        processor, caller = self.conn.processor, self.conn.caller
        for delivery in deliveries:
            if delivery.stored.receipt is None:
                continue
            # The queue may be gone, or the message taken back already.
            with contextlib.suppress(StorageError):
                await processor.nack(caller, delivery.queue.group, delivery.stored.receipt)
                self.conn.vhost.requeued.given_back(delivery.stored)

    # -- channel class ---------------------------------------------------------------

    async def _channel_close(self, method: commands.Channel.Close) -> None:
        await self.teardown()
        self.conn.forget_channel(self)
        self.send(commands.Channel.CloseOk())

    async def _channel_flow(self, method: commands.Channel.Flow) -> None:
        self._flow_active = bool(method.active)
        self._wake_consumers()
        self.send(commands.Channel.FlowOk(active=method.active))

    async def _channel_flow_ok(self, method: commands.Channel.FlowOk) -> None:
        pass

    # -- basic class: consuming ------------------------------------------------------

    async def _basic_qos(self, method: commands.Basic.Qos) -> None:
        if method.global_:
            self._global_prefetch = method.prefetch_count
        else:
            self._prefetch = method.prefetch_count
        self._wake_consumers()
        self.send(commands.Basic.QosOk())

    async def _basic_consume(self, method: commands.Basic.Consume) -> None:
        tag = method.consumer_tag or "amq.ctag-" + secrets.token_urlsafe(16)
        if tag in self.consumers:
            raise ChannelError(errors.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        if method.queue == REPLY_TO:
            await self._consume_reply_to(method, tag)
            return
        await self.conn.processor.authorize(self.conn.caller, "topic", method.queue, "read")
        vhost = self.conn.vhost
        queue = vhost.queue(method.queue, self.conn.key, 60, 20)
        taken = any(c.exclusive for c in queue.consumers) or any(
            e.exclusive for e in queue.registry.values()
        )
        if taken or (method.exclusive and queue.consumer_count):
            raise ChannelError(
                errors.ACCESS_REFUSED,
                f"queue '{queue.name}' in vhost has an exclusive consumer",
            )
        consumer = Consumer(
            self,
            tag=tag,
            queue=queue,
            no_ack=method.no_ack,
            exclusive=method.exclusive,
            prefetch=self._prefetch,
        )
        if queue.is_stream:
            if method.no_ack:
                raise ChannelError(
                    errors.PRECONDITION_FAILED, "stream consumers must acknowledge", 60, 20
                )
            consumer.stream_offset = await self._stream_start(queue, method.arguments or {})
        self.consumers[tag] = consumer
        queue.consumers.add(consumer)
        queue.ever_consumed = True
        await vhost.consumer_added(self.conn.caller, consumer, queue)
        if not method.nowait:
            self.send(commands.Basic.ConsumeOk(consumer_tag=tag))
        consumer.start()

    async def _stream_start(self, queue: QueueDef, arguments: Mapping[str, Any]) -> int:
        """Where a stream consumer starts (``x-stream-offset``: first, last, next, an
        offset, or a timestamp)."""
        processor, caller = self.conn.processor, self.conn.caller
        ref = queue.refs(self.conn.namespace)[0]
        bounds = await processor.queue_offsets(caller, ref)
        spec = arguments.get("x-stream-offset", "next")
        if spec == "first":
            return bounds.earliest
        if spec == "last":
            return max(bounds.earliest, bounds.latest - 1)
        if isinstance(spec, datetime.datetime):
            return await processor.offset_for_timestamp(caller, ref, int(spec.timestamp() * 1000))
        if isinstance(spec, int) and not isinstance(spec, bool):
            return max(bounds.earliest, min(spec, bounds.latest))
        if spec == "next":
            return bounds.latest
        raise ChannelError(errors.PRECONDITION_FAILED, f"invalid x-stream-offset {spec!r}", 60, 20)

    async def _consume_reply_to(self, method: commands.Basic.Consume, tag: str) -> None:
        """Direct reply-to: replies go straight to this channel, never to storage."""
        if not method.no_ack:
            raise ChannelError(
                errors.PRECONDITION_FAILED, "reply consumer cannot acknowledge", 60, 20
            )
        if self.reply_token is None:
            self.reply_token = self.conn.vhost.replies.new_token()
        token = self.reply_token

        def sink(routing_key: str, raw_properties: bytes, body: bytes) -> None:
            delivery_tag = self._next_tag
            self._next_tag += 1
            self.conn.send_bytes(
                deliver_frames(
                    self.number,
                    consumer_tag=tag,
                    delivery_tag=delivery_tag,
                    redelivered=False,
                    exchange="",
                    routing_key=routing_key,
                    raw_properties=raw_properties,
                    body=body,
                    frame_max=self.conn.frame_max,
                )
            )

        self.conn.vhost.replies.register(token, sink)
        if not method.nowait:
            self.send(commands.Basic.ConsumeOk(consumer_tag=tag))

    async def _basic_cancel(self, method: commands.Basic.Cancel) -> None:
        consumer = self.consumers.pop(method.consumer_tag or "", None)
        if consumer is not None:
            await consumer.stop()
            consumer.queue.consumers.discard(consumer)
            await self.conn.vhost.consumer_removed(self.conn.caller, consumer, consumer.queue)
        elif self.reply_token is not None and method.consumer_tag:
            self.conn.vhost.replies.unregister(self.reply_token)
        if not method.nowait:
            self.send(commands.Basic.CancelOk(consumer_tag=method.consumer_tag))

    def credit(self, consumer: Consumer) -> int:
        if not self._flow_active or self.state is not ChannelState.OPEN:
            return 0
        if consumer.no_ack:
            return POP_BATCH
        credit = consumer.prefetch - consumer.inflight
        if self._global_prefetch:
            credit = min(credit, self._global_prefetch - len(self.unacked) - self.reserved)
        return credit

    @property
    def global_prefetch(self) -> bool:
        """basic.qos with ``global``: the consumers share one credit."""
        return self._global_prefetch > 0

    def _wake_consumers(self) -> None:
        for consumer in self.consumers.values():
            consumer.wakeup.set()

    async def pop(
        self,
        group: str,
        refs: Sequence[QueueRef],
        max_messages: int,
        wait_ms: int,
        *,
        durable: bool = True,
    ) -> list[StoredMessage]:
        """Pop highest priority first. ``durable=False`` for no-ack deliveries (acked
        right after they are sent): they need not wait for their hand-out's fsync.
        Cancelling is safe: storage gives back what a cancelled pop took, uncounted."""
        popped = await self._pop_levels(group, refs, max_messages, wait_ms, durable)
        self.conn.vhost.requeued.taken(popped)
        return popped

    async def _pop_levels(
        self,
        group: str,
        refs: Sequence[QueueRef],
        max_messages: int,
        wait_ms: int,
        durable: bool,
    ) -> list[StoredMessage]:
        processor, caller = self.conn.processor, self.conn.caller
        if len(refs) > 1:
            got: list[StoredMessage] = []
            try:
                for ref in refs:
                    got += await processor.pop(
                        caller,
                        group,
                        [ref],
                        max_messages=max_messages - len(got),
                        invisible_ms=INVISIBLE_MS,
                        durable=durable,
                    )
                    if len(got) >= max_messages:
                        return got
            except asyncio.CancelledError:
                self._give_back(group, got)  # taken from higher priorities before the cancel
                raise
            if got:
                return got
            max_messages = 1  # a long poll over every level takes whichever comes first
        return await processor.pop(
            caller,
            group,
            refs,
            max_messages=max_messages,
            invisible_ms=INVISIBLE_MS,
            wait_ms=wait_ms,
            durable=durable,
        )

    def _give_back(self, group: str, popped: list[StoredMessage]) -> None:
        """:meth:`give_back` in the background (a cancelled pop cannot wait for it)."""
        if popped:
            self.conn.spawn(self.give_back(group, popped))

    async def give_back(self, group: str, popped: Sequence[StoredMessage]) -> None:
        """Messages popped and never delivered: ready again at once. Not a nack: nobody
        saw them, so their next delivery is a first one (``redelivered`` false, as
        RabbitMQ) and costs no delivery attempt. Storage still counts them in flight
        until they are popped again, so the ready count adds them, as it does a
        requeue's."""
        given = {stored.receipt: stored for stored in popped if stored.receipt is not None}
        if not given:
            return
        # The queue may be gone; otherwise their leases run out and they come back then.
        with contextlib.suppress(StorageError):
            await self.conn.processor.give_back(self.conn.caller, group, list(given))
            for stored in given.values():
                self.conn.vhost.requeued.given_back(stored)

    @staticmethod
    def _expired(queue: QueueDef, stored: StoredMessage, now: int) -> bool:
        at = expires_at(queue, stored)
        return at is not None and at <= now

    async def deliver(self, consumer: Consumer, messages: Sequence[StoredMessage]) -> None:
        processor, caller = self.conn.processor, self.conn.caller
        now = processor.clock.now_ms()
        out: list[bytes] = []
        acks: list[str] = []
        for stored in messages:
            if self._expired(consumer.queue, stored, now):
                await dead_letter(
                    processor, caller, self.conn.vhost, consumer.queue, stored, "expired"
                )
                continue
            tag = self._next_tag
            self._next_tag += 1
            exchange, routing_key, raw = delivery_content(stored)
            if consumer.stream_offset is not None:
                raw = with_header(raw, "x-stream-offset", stored.offset)
            if consumer.no_ack:
                acks.append(stored.receipt or "")
            else:
                self.unacked[tag] = Delivery(stored, consumer.queue, consumer)
                consumer.inflight += 1
            out.append(
                deliver_frames(
                    self.number,
                    consumer_tag=consumer.tag,
                    delivery_tag=tag,
                    redelivered=stored.delivery_attempt > 1,
                    exchange=exchange,
                    routing_key=routing_key,
                    raw_properties=raw,
                    body=stored.message.body,
                    frame_max=self.conn.frame_max,
                )
            )
        if out:
            self.conn.send_bytes(b"".join(out))
        if acks:
            await processor.ack_many(caller, consumer.queue.group, acks)
        await self.conn.drain()

    async def _basic_get(self, method: commands.Basic.Get) -> None:
        vhost, processor, caller = self.conn.vhost, self.conn.processor, self.conn.caller
        await processor.authorize(caller, "topic", method.queue, "read")
        queue = vhost.queue(method.queue, self.conn.key, 60, 70)
        if queue.is_stream:
            raise ChannelError(
                errors.PRECONDITION_FAILED, "basic.get is not supported by stream queues"
            )
        vhost.touch(caller, queue)
        if queue.view_topic is not None:
            await vhost.resolve_view(caller, queue)
        now = processor.clock.now_ms()
        while True:
            refs = queue.refs(vhost.namespace)  # none: a view whose topic is not there
            popped = (
                await self.pop(queue.group, refs, 1, 0, durable=not method.no_ack) if refs else []
            )
            if not popped:
                self.send(commands.Basic.GetEmpty())
                return
            stored = popped[0]
            if self._expired(queue, stored, now):
                await dead_letter(processor, caller, vhost, queue, stored, "expired")
                continue
            break
        tag = self._next_tag
        self._next_tag += 1
        if method.no_ack:
            await processor.ack(caller, queue.group, stored.receipt or "")
        else:
            self.unacked[tag] = Delivery(stored, queue, None)
        exchange, routing_key, raw = delivery_content(stored)
        remaining = await vhost.message_count(caller, queue)
        self.send(
            commands.Basic.GetOk(
                delivery_tag=tag,
                redelivered=stored.delivery_attempt > 1,
                exchange=exchange,
                routing_key=routing_key,
                message_count=remaining,
            )
        )
        self.conn.send_bytes(
            content_frames(self.number, raw, stored.message.body, self.conn.frame_max)
        )

    # -- basic class: acknowledgements -----------------------------------------------

    def _take(self, delivery_tag: int, multiple: bool, method_id: int) -> list[Delivery]:
        if multiple:
            tags = [t for t in self.unacked if delivery_tag == 0 or t <= delivery_tag]
        elif delivery_tag in self.unacked:
            tags = [delivery_tag]
        else:
            raise ChannelError(
                errors.PRECONDITION_FAILED, f"unknown delivery tag {delivery_tag}", 60, method_id
            )
        taken = [self.unacked.pop(t) for t in tags]
        for delivery in taken:
            if delivery.consumer is not None:
                delivery.consumer.inflight -= 1
        self._wake_consumers()
        return taken

    async def _basic_ack(self, method: commands.Basic.Ack) -> None:
        if self._tx is not None:
            self._take_check(method.delivery_tag, method.multiple, 80)
            self._tx_acks.append((method.delivery_tag, method.multiple))
            return
        taken = self._take(method.delivery_tag, method.multiple, 80)
        await self._ack(taken)

    async def _ack_run(self, first: commands.Basic.Ack) -> None:
        """Settle a run of consecutive acks with one durable write: a consumer acking
        each message costs one group commit per run, not per message."""
        taken = self._take(first.delivery_tag or 0, bool(first.multiple), 80)
        try:
            while self._inbox.items and isinstance(self._inbox.items[0], commands.Basic.Ack):
                ack = self._inbox.take()
                assert isinstance(ack, commands.Basic.Ack)
                taken += self._take(ack.delivery_tag or 0, bool(ack.multiple), 80)
        finally:  # a bad tag later in the run still settles the good ones before it
            await self._ack(taken)

    def _take_check(self, delivery_tag: int, multiple: bool, method_id: int) -> None:
        if not multiple and delivery_tag not in self.unacked:
            raise ChannelError(
                errors.PRECONDITION_FAILED, f"unknown delivery tag {delivery_tag}", 60, method_id
            )

    async def _ack(self, taken: Sequence[Delivery], *, durable: bool = False) -> None:
        """``basic.ack`` has no reply, so nobody waits for its fsync: written, and
        fsynced with the next group commit (docs/performance.md); a ``tx.commit``
        answers for its acks, so it waits (``durable``)."""
        by_group: dict[str, list[str]] = {}
        for delivery in taken:
            if delivery.stored.receipt is not None:
                by_group.setdefault(delivery.queue.group, []).append(delivery.stored.receipt)
        processor, caller = self.conn.processor, self.conn.caller
        for group, receipts in by_group.items():
            if len(receipts) == 1:
                try:
                    await processor.ack(caller, group, receipts[0], durable=durable)
                except InvalidReceipt:  # purged or deleted meanwhile
                    pass
                except ShardAway as e:  # comes again (redelivered) once its shard is back
                    log.info("amqp: an ack waits for its redelivery, shard away: %s", e)
            else:
                await processor.ack_many(caller, group, receipts, durable=durable)

    async def _basic_nack(self, method: commands.Basic.Nack) -> None:
        taken = self._take(method.delivery_tag, method.multiple, 120)
        await self._settle_rejected(taken, method.requeue)

    async def _basic_reject(self, method: commands.Basic.Reject) -> None:
        taken = self._take(method.delivery_tag or 0, False, 90)
        await self._settle_rejected(taken, method.requeue)

    async def _settle_rejected(self, taken: Sequence[Delivery], requeue: bool) -> None:
        if requeue:
            await self._requeue(taken)
            return
        for delivery in taken:
            with contextlib.suppress(InvalidReceipt):
                await dead_letter(
                    self.conn.processor,
                    self.conn.caller,
                    self.conn.vhost,
                    delivery.queue,
                    delivery.stored,
                    "rejected",
                )

    async def _basic_recover(self, method: commands.Basic.Recover) -> None:
        taken = self._take(0, True, 110)
        await self._requeue(taken)
        self.send(commands.Basic.RecoverOk())

    async def _basic_recover_async(self, method: commands.Basic.RecoverAsync) -> None:
        await self._requeue(self._take(0, True, 100))

    # -- basic class: publishing -----------------------------------------------------

    async def _confirm_select(self, method: commands.Confirm.Select) -> None:
        if self._tx is not None:
            raise ChannelError(
                errors.PRECONDITION_FAILED, "cannot switch from tx to confirm mode", 85, 10
            )
        self.publisher.confirm = True
        if not method.nowait:
            self.send(commands.Confirm.SelectOk())

    async def _tx_select(self, method: commands.Tx.Select) -> None:
        if self.publisher.confirm:
            raise ChannelError(
                errors.PRECONDITION_FAILED, "cannot switch from confirm to tx mode", 90, 10
            )
        if self._tx is None:
            self._tx = []
        self.send(commands.Tx.SelectOk())

    async def _tx_commit(self, method: commands.Tx.Commit) -> None:
        if self._tx is None:
            raise ChannelError(errors.PRECONDITION_FAILED, "channel is not transactional", 90, 20)
        publishes, self._tx = self._tx, []
        acks, self._tx_acks = self._tx_acks, []
        await self.publisher.publish(publishes, committing=True)
        for delivery_tag, multiple in acks:
            await self._ack(self._take(delivery_tag, multiple, 80), durable=True)
        self.send(commands.Tx.CommitOk())

    async def _tx_rollback(self, method: commands.Tx.Rollback) -> None:
        if self._tx is None:
            raise ChannelError(errors.PRECONDITION_FAILED, "channel is not transactional", 90, 30)
        self._tx = []
        self._tx_acks = []
        self.send(commands.Tx.RollbackOk())

    async def _publish_batch(self, batch: list[Publish]) -> None:
        if self._tx is not None:
            for publish in batch:
                self.publisher.resolve(publish)  # unknown exchanges fail now, not at commit
            self._tx.extend(batch)
            return
        await self.publisher.publish(batch)


def _ids(method: MethodFrame) -> tuple[int, int]:
    index = getattr(method, "index", 0)
    return index >> 16, index & 0xFFFF


# What a channel does without its vhost's definitions (which a channel of a
# connection opened while they were unavailable loads before anything else).
_WITHOUT_VHOST: Final = frozenset(
    {
        commands.Channel.Close,
        commands.Channel.Flow,
        commands.Channel.FlowOk,
        commands.Basic.Qos,
        commands.Confirm.Select,
        commands.Tx.Select,
        commands.Tx.Rollback,
    }
)

_HANDLERS: Final[dict[type, Handler]] = {
    commands.Channel.Close: Channel._channel_close,
    commands.Channel.Flow: Channel._channel_flow,
    commands.Channel.FlowOk: Channel._channel_flow_ok,
    commands.Exchange.Declare: declarations.exchange_declare,
    commands.Exchange.Delete: declarations.exchange_delete,
    commands.Exchange.Bind: declarations.exchange_bind,
    commands.Exchange.Unbind: declarations.exchange_bind,
    commands.Queue.Declare: declarations.queue_declare,
    commands.Queue.Bind: declarations.queue_bind,
    commands.Queue.Unbind: declarations.queue_bind,
    commands.Queue.Purge: declarations.queue_purge,
    commands.Queue.Delete: declarations.queue_delete,
    commands.Basic.Qos: Channel._basic_qos,
    commands.Basic.Consume: Channel._basic_consume,
    commands.Basic.Cancel: Channel._basic_cancel,
    commands.Basic.Get: Channel._basic_get,
    commands.Basic.Ack: Channel._basic_ack,
    commands.Basic.Nack: Channel._basic_nack,
    commands.Basic.Reject: Channel._basic_reject,
    commands.Basic.Recover: Channel._basic_recover,
    commands.Basic.RecoverAsync: Channel._basic_recover_async,
    commands.Confirm.Select: Channel._confirm_select,
    commands.Tx.Select: Channel._tx_select,
    commands.Tx.Commit: Channel._tx_commit,
    commands.Tx.Rollback: Channel._tx_rollback,
}
