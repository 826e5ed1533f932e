"""Messages other protocols put into a storage topic, brought to MQTT subscribers.

An MQTT publish is routed when it arrives; a Kafka record or an AMQP message that
lands in storage topic ``sensors`` is not. A tail follows each queue of a storage
topic that some MQTT filter can reach by its first level (offset mode, from the end
at the time the tail first starts, then from its committed offset) and routes the
messages that carry no ``mqtt.topic`` property, under the storage topic's name
(docs/interop.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from polymq.gateway.processor import Caller, Processor
from polymq.protocols import interop
from polymq.protocols.mqtt.own_appends import OwnAppends
from polymq.storage.errors import InvalidName, OffsetOutOfRange, StorageError, TopicNotFound
from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["TAIL_GROUP", "TopicTail", "from_mqtt"]

log = logging.getLogger(__name__)

_WAIT_MS = 5_000
_RETRY_S = 1.0
_COMMIT_EVERY_S = 10.0  # the position, when only MQTT's own messages went by
_READ_MAX = 256
_SETTLE_S = 0.5  # at most this long for the router to say where its appends landed
# Woken at the end of a queue by one of the router's own publishes: look again this
# much later, not at the next one. At 1,000 publishes/s a wake per publish (storage's
# long-poll: a future, a sleeper task and its timer, a read and a decode, then the
# wait for the append to settle) was an eighth of the server's time for nothing; a
# message from another protocol arriving while MQTT publishes to the same storage
# topic flow may wait this long (docs/mqtt.md, "CPU per message").
_OWN_PACE_S = 0.01
TAIL_GROUP = "mqtt.tail"  # the consumer group whose offsets say how far tails got

Route = Callable[[list[StoredMessage], bool], Awaitable[None]]
"""Route messages from another protocol; the flag says whether online clients get
them too (live) or only queues (caught up after a gap)."""


class TopicTail:
    """Follows every queue of one storage topic while :attr:`wanted` says so."""

    def __init__(
        self,
        processor: Processor,
        caller: Caller,
        topic: str,
        route: Route,
        wanted: Callable[[], bool],
        *,
        from_start: bool = False,
        group: str = TAIL_GROUP,
        keep: Callable[[StoredMessage], bool] | None = None,
        hold: Callable[[QueueRef], int | None] | None = None,
        own: OwnAppends | None = None,
    ) -> None:
        """``from_start``: the topic is known to be newer than the filters that want
        it (found by a wildcard filter's discovery), so all of it is new. ``group``
        holds the position (one per gateway when several serve the namespace);
        ``keep`` says which messages to route (by default those not from MQTT);
        ``hold`` the lowest offset of a queue still needed after routing (copies it
        owes not made yet, repairs.py): the position is not committed past it;
        ``own`` where the router's own publishes landed, skipped unread (they are not
        ``keep``'s)."""
        self._processor = processor
        self._caller = caller
        self.topic = topic
        self._route = route
        self._wanted = wanted
        self._tasks: list[asyncio.Task[None]] = []
        self._main: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._from_start = from_start
        self._group = group
        self._keep = keep or _not_from_mqtt
        self._hold = hold
        self._own = own
        self.messages_read = 0  # what the tail's reads decoded (own publishes skipped not)

    async def ready(self) -> None:
        """Wait until the tail knows where it starts: a message stored after this
        returns is routed."""
        await self._ready.wait()

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def done(self) -> bool:
        return self._main is None or self._main.done()

    def start(self) -> None:
        self._main = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _run(self) -> None:
        namespace = self._caller.namespace
        from_start = self._from_start  # a topic created after the tail started: all new
        while self._wanted():
            try:
                info = await self._processor.describe_topic(self._caller, self.topic)
            except TopicNotFound:
                from_start = True
                self._ready.set()
                await asyncio.sleep(_RETRY_S)  # nobody produced to it yet
                continue
            except InvalidName:
                self._ready.set()  # no storage topic can have this name: nothing to follow
                return
            except StorageError as e:
                log.warning("mqtt tail of %s: %s", self.topic, e)
                self._ready.set()
                await asyncio.sleep(_RETRY_S)
                continue
            starts = []
            for i, offsets in enumerate(info.queues):
                queue = QueueRef(namespace, self.topic, i)
                committed = await self._processor.fetch_offset(self._caller, self._group, queue)
                live_from = offsets.latest
                if committed is not None:  # resume where the last run stopped
                    start = committed.offset
                else:  # first run: from here on, and remember that
                    start = live_from = offsets.earliest if from_start else offsets.latest
                    await self._processor.commit_offset(self._caller, self._group, queue, start)
                starts.append((queue, start, live_from))
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow(*start)) for start in starts]
            self._ready.set()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks = []

    async def _follow(self, queue: QueueRef, offset: int, live_from: int) -> None:
        """Route what arrives from ``offset`` on. Messages below ``live_from`` were
        stored while nobody followed (the gateway was down): they go to the queues of
        persistent sessions and shared groups only, not to clients that subscribed
        after them. The position is committed, so a restart resumes from it.

        With ``own``, a wait at the end of the queue reads one message; once the
        router's appends begun by then have said where they landed (before any read
        that does not wait, too), the tail jumps over the router's own publishes and
        reads only up to the next of them (own_appends.py). Woken so by one of them,
        it looks again only ``_OWN_PACE_S`` later, one message at a time while what
        it reads is the router's own (appends still in flight when it looked)."""
        own = self._own
        committed, committed_at = offset, time.monotonic()
        probe = True  # at the end: the next read waits
        chasing = False  # the last read was all the router's own: what follows may be
        while self._wanted():
            limit = _READ_MAX
            if own is not None:
                if not probe:  # behind: first learn where the appends in flight land
                    await own.settled(own.issued, _SETTLE_S)
                offset, next_own = own.skip(queue, offset)
                if probe or chasing:
                    limit = 1
                elif next_own is not None:
                    limit = max(1, min(limit, next_own - offset))
            try:
                result = await self._processor.read(
                    self._caller,
                    queue,
                    offset,
                    max_messages=limit,
                    wait_ms=_WAIT_MS,
                    metered=False,  # a look: what reaches a client is metered on sending
                )
            except OffsetOutOfRange as e:
                offset = e.earliest if offset < e.earliest else e.latest
                if own is not None:
                    own.forget(queue)
                continue
            except TopicNotFound:
                if own is not None:
                    own.forget(queue)
                return
            messages = result.messages
            self.messages_read += len(messages)
            if own is not None:
                probe = result.next_offset >= result.offsets.latest
                # What a probe read, or a read that reached the end (woken there by
                # an append, or catching up with appends in flight): the router's own?
                if messages and (limit == 1 or probe):
                    await own.settled(own.issued, _SETTLE_S)
                    skipped, _ = own.skip(queue, offset)
                    if skipped >= result.next_offset:  # all it read is the router's own
                        offset, chasing = skipped, True
                        probe = skipped >= result.offsets.latest
                        if probe:  # MQTT publishes flow: not a wake for each of them
                            await asyncio.sleep(_OWN_PACE_S)
                            probe = False  # behind now, most likely by own publishes
                        continue
                chasing = False
            keep = self._keep
            foreign = [m for m in messages if keep(m)]
            offset = result.next_offset
            try:
                old = [m for m in foreign if m.offset < live_from]
                if old:
                    await self._route(old, False)
                if len(old) < len(foreign):
                    await self._route(foreign[len(old) :], True)
            except Exception:
                log.exception("mqtt tail of %s: routing failed", queue)
            position = offset
            held = self._hold(queue) if self._hold is not None else None
            if held is not None:
                position = min(position, held)
            if position != committed and (
                foreign or time.monotonic() - committed_at > _COMMIT_EVERY_S
            ):
                try:
                    await self._processor.commit_offset(self._caller, self._group, queue, position)
                except StorageError as e:  # the position's node is away: next time
                    log.warning("mqtt tail of %s: committing: %s", queue, e)
                else:
                    committed, committed_at = position, time.monotonic()


def _not_from_mqtt(stored: StoredMessage) -> bool:
    return not from_mqtt(stored)


def from_mqtt(stored: StoredMessage) -> bool:
    """Whether MQTT stored this (and so routed it already): its first property is
    ``mqtt.topic`` (mapping.message_from_publish puts it there), so MQTT's own
    messages are skipped without scanning their properties."""
    properties = stored.message.properties
    if properties and properties[0][0] == interop.MQTT_TOPIC:
        return True
    return stored.message.property(interop.MQTT_TOPIC) is not None
