"""Consumers (basic.consume): one task each, fetching while the consumer has credit
and handing what it got to its channel to deliver."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pamqp import commands

from polymq.protocols.amqp import errors
from polymq.protocols.amqp._state import ChannelState
from polymq.protocols.amqp.errors import AmqpError, ConnectionError_
from polymq.protocols.amqp.queues import QueueDef
from polymq.storage.errors import ShardAway, StorageError, TopicNotFound
from polymq.storage.model import QueueRef, StoredMessage

if TYPE_CHECKING:
    from polymq.protocols.amqp.channel import Channel

__all__ = ["INVISIBLE_MS", "POP_BATCH", "POP_WAIT_MS", "Consumer", "Delivery"]

log = logging.getLogger(__name__)

# An unacked delivery is leased to its channel: invisible to other consumers this long,
# renewed while the channel lives, given back at once when it closes. If the gateway
# dies, the lease runs out and the message comes back (redelivered) within seconds, to
# a consumer on another gateway.
INVISIBLE_MS: Final = 10_000
POP_WAIT_MS: Final = 5_000
POP_BATCH: Final = 250
UNLIMITED_PREFETCH: Final = 2_000  # bound on unacked deliveries with prefetch 0
_TOPIC_RETRY_MS: Final = 500  # an x-polymq-topic queue whose topic does not exist yet
_STOP_WAIT_S: Final = 5.0  # how long a stopping consumer's fetch or delivery may finish
# Pauses of a consumer whose queue's shard is between owners (doubling, bounded).
_AWAY_FIRST_S: Final = 0.1
_AWAY_MAX_S: Final = 1.0


@dataclass(slots=True, eq=False)
class Delivery:
    stored: StoredMessage
    queue: QueueDef
    consumer: Consumer | None


class Consumer:
    """A basic.consume: a task popping from the queue while it has credit."""

    def __init__(
        self,
        channel: Channel,
        *,
        tag: str,
        queue: QueueDef,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
    ) -> None:
        self.channel = channel
        self.tag = tag
        self.queue = queue
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch or UNLIMITED_PREFETCH
        self.inflight = 0
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._stopping = False
        self._busy = False  # fetching without waiting, or delivering: let it finish
        self._drained = False  # the last turn waited and took less than it asked for
        self.stream_offset: int | None = None  # set for consumers of stream queues
        self._refs: tuple[QueueRef, ...] | None = None  # the queue's, once (not a view's)
        # Unique across gateways: the connection's key holds its gateway instance.
        self.id = f"{channel.conn.key}/{channel.number}/{tag}"

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"amqp-consumer-{self.tag}")

    def credit(self) -> int:
        if self.queue.single_active and self.queue.active_id() != self.id:
            return 0  # waits for its turn (woken when a consumer of the queue leaves)
        return self.channel.credit(self)

    def wake(self) -> None:
        self.wakeup.set()

    async def stop(self) -> None:
        """Stop consuming (basic.cancel, the channel closing). A fetch that took
        messages is let finish instead of being cancelled, so none is lost in flight
        (invisible, and not counted as ready, until its lease ran out): they are
        delivered (before cancel-ok, as the spec allows) or, when the channel closes,
        given back. An idle consumer or a long poll is cancelled (a long poll
        waiting on an empty queue has taken nothing)."""
        self._stopping = True
        task = self.task
        if task is None or task.done():
            return
        if self._busy:
            await asyncio.wait({task}, timeout=_STOP_WAIT_S)  # bounded: a stuck drain
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        channel = self.channel
        away_s = _AWAY_FIRST_S
        try:
            while not self._stopping:
                credit = self.credit()
                if credit <= 0:
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                try:
                    await self._take_turn(min(credit, POP_BATCH))
                except ShardAway as e:
                    # The replicated pool's shard moves (a takeover, a hand-back): it
                    # is served again within the takeover time, so the consumer waits
                    # as a quorum queue's consumer waits for a new leader, instead of
                    # closing a channel the application may never look at again.
                    log.info("amqp consumer %s waits for its queue's shard: %s", self.tag, e)
                    await asyncio.sleep(away_s)
                    away_s = min(_AWAY_MAX_S, away_s * 2)
                else:
                    away_s = _AWAY_FIRST_S
        except asyncio.CancelledError:
            raise
        except AmqpError as e:
            channel.conn.fail_channel(channel, e)
        except StorageError as e:  # e.g. the queue's storage node is down: this channel only
            log.info("amqp consumer %s stopped: %s", self.tag, e)
            channel.conn.fail_channel(channel, errors.from_storage(e, 60, 20))
        except Exception as e:
            log.exception("amqp consumer %s failed", self.tag)
            channel.conn.fail(ConnectionError_(errors.INTERNAL_ERROR, str(e)))

    async def _take_turn(self, credit: int) -> None:
        """Fetch and deliver up to ``credit`` messages. The credit is reserved on the
        channel meanwhile (a global prefetch is shared by its consumers), but a long
        poll on an empty queue holds only one unit of it."""
        channel = self.channel
        # Over the account's consume rate: deliver nothing more until it is paid off
        # (asked first without a coroutine: the account rarely owes anything).
        quota = channel.conn.quota
        if quota.wait_ms("consume"):
            await quota.hold("amqp", "consume")
        channel.reserved += credit
        try:
            asked = credit
            waited = self._drained and self._polls_whole_credit()
            if waited:
                # The last turn found the queue empty and waited: straight to the long
                # poll again, which takes what is there at once. At everyday rates that
                # saves an empty pop per message (one of the three storage calls each).
                messages = await self._fetch(credit, POP_WAIT_MS)
            else:
                self._busy = True
                messages = await self._fetch(credit, 0)
                self._busy = False
                if not messages and not self._stopping:
                    channel.reserved -= credit - 1
                    credit = 1
                    waited = True
                    messages = await self._fetch(1, POP_WAIT_MS)
            # Only a wait marks the queue drained: a short pop of a busy queue does not.
            self._drained = waited and len(messages) < asked
            self._busy = True
            if messages and self._stopping and channel.state is not ChannelState.OPEN:
                await channel.give_back(self.queue.group, messages)
            elif messages:
                await channel.deliver(self, messages)
                quota.consumed("amqp", sum(len(m.message.body) for m in messages))
        finally:
            self._busy = False
            channel.reserved -= credit

    def _polls_whole_credit(self) -> bool:
        """Whether a long poll may ask for the consumer's whole credit: not with a
        global prefetch (a waiting poll holds credit the channel's other consumers
        share), a priority queue (levels are popped highest first, one by one), a
        view or a stream queue (their own fetches)."""
        queue = self.queue
        return (
            not self.channel.global_prefetch
            and queue.max_priority == 0
            and queue.view_topic is None
            and self.stream_offset is None
        )

    async def _fetch(self, count: int, wait_ms: int) -> list[StoredMessage]:
        channel = self.channel
        queue = self.queue
        if queue.view_topic is not None:
            return await self._fetch_view(count, wait_ms)
        refs = self._refs
        if refs is None:  # a plain queue's storage queues never change: once per consumer
            refs = self._refs = queue.refs(channel.conn.namespace)
        if self.stream_offset is None:
            # A hand-out is written, not waited on for its fsync (docs/performance.md):
            # no-ack deliveries are acked right after they are sent, and an acked
            # delivery's ack is durable; a crash of the machine can only forget that
            # an unacked message was handed out, which delivers it again, as RabbitMQ
            # does for every unacked message after a restart.
            return await channel.pop(queue.group, refs, count, wait_ms, durable=False)
        # A stream queue: read on from an offset; nothing is removed.
        result = await channel.conn.processor.read(
            channel.conn.caller, refs[0], self.stream_offset, max_messages=count, wait_ms=wait_ms
        )
        self.stream_offset = result.next_offset
        return list(result.messages)

    async def _fetch_view(self, count: int, wait_ms: int) -> list[StoredMessage]:
        """Pop from every queue of the storage topic a view (``x-polymq-topic``) reads
        (docs/interop.md). The topic belongs to whoever produces to it: until it
        exists, and after it is deleted, the consumer waits; an empty long poll looks
        again at how many queues it has (partitions added later)."""
        conn, queue = self.channel.conn, self.queue
        try:
            if not queue.view_queues and not await conn.vhost.resolve_view(conn.caller, queue):
                await asyncio.sleep(min(wait_ms, _TOPIC_RETRY_MS) / 1000)
                return []
            refs = queue.refs(conn.namespace)
            got = await self.channel.pop(queue.group, refs, count, wait_ms, durable=False)
            if not got and wait_ms:
                await conn.vhost.resolve_view(conn.caller, queue)
            return got
        except TopicNotFound:
            queue.view_queues = 0
            await asyncio.sleep(min(wait_ms, _TOPIC_RETRY_MS) / 1000)
            return []

    def queue_deleted(self) -> None:
        """consumer_cancel_notify: the queue went away under the consumer."""
        if self.task is not None:
            self.task.cancel()
        if self.channel.consumers.pop(self.tag, None) is not None:
            self.channel.send(commands.Basic.Cancel(consumer_tag=self.tag, nowait=True))
