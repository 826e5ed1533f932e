"""basic.publish: routing a run of publishes, storing it with one append, and the
returns and confirms that follow, in publish order."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pamqp import commands

from polymq.gateway.accounts import AccessDenied
from polymq.gateway.fairness import SLICE, pause
from polymq.protocols import interop
from polymq.protocols.amqp import errors
from polymq.protocols.amqp.codec import (
    ContentHeaderFrame,
    confirm_frame,
    content_frames,
    method_frame,
)
from polymq.protocols.amqp.consumer import INVISIBLE_MS
from polymq.protocols.amqp.dead_letter import dead_letter
from polymq.protocols.amqp.errors import AmqpError, ChannelError, ConnectionError_
from polymq.protocols.amqp.natural import AMQ_TOPIC, mqtt_name
from polymq.protocols.amqp.properties import encode_properties, to_message
from polymq.protocols.amqp.queues import QueueDef
from polymq.protocols.amqp.reply_to import REPLY_TO
from polymq.storage.errors import InvalidName, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import (
    AppendRequest,
    Message,
    QueueRef,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)

if TYPE_CHECKING:
    from polymq.protocols.amqp.channel import Channel
    from polymq.protocols.amqp.connection import AmqpConnection

__all__ = ["EXPIRES_AT", "REPLY_TO", "Publish", "Publisher"]

EXPIRES_AT: Final = interop.AMQP_EXPIRES_AT
_MADE_ATTEMPTS: Final = 50


@dataclass(slots=True)
class Publish:
    """A basic.publish with its content, as the channel assembled it."""

    method: commands.Basic.Publish
    header: ContentHeaderFrame | None = None
    # One buffer, not a list of chunks: a body sent in 1-byte frames would otherwise
    # cost ~40 bytes of object per byte. A publish read whole has its body as bytes.
    chunks: bytearray | bytes = field(default_factory=bytearray)
    received: int = 0


class Publisher:
    """A channel's publishing side; ``confirm`` once confirm.select was received."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.confirm = False
        self.seq = 0  # the last publish's confirm sequence number
        self._topic_queues: dict[str, int] = {}  # x-polymq-topic targets: queue counts

    @property
    def _conn(self) -> AmqpConnection:
        return self._channel.conn

    def resolve(self, publish: Publish) -> None:
        if publish.method.immediate:  # RabbitMQ dropped it in 3.0, with this error
            raise ConnectionError_(errors.NOT_IMPLEMENTED, "immediate=true", 60, 40)
        exchange = self._conn.vhost.exchange(publish.method.exchange, 60, 40)
        if exchange.internal:
            raise ChannelError(
                errors.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange.name}'",
                60,
                40,
            )

    async def _may_write(self, publish: Publish) -> None:
        """RabbitMQ's write permission, on the exchange published to; through the
        default exchange, on the queue the routing key names (docs/permissions.md)."""
        method = publish.method
        target = method.exchange or method.routing_key
        try:
            await self._conn.processor.authorize(self._conn.caller, "topic", target, "write")
        except AccessDenied as e:
            raise ChannelError(errors.ACCESS_REFUSED, str(e), 60, 40) from e

    async def publish(self, batch: list[Publish], *, committing: bool = False) -> None:
        """Route and store a run of publishes with one append, then send returns and
        confirms in publish order. A publish that fails (unknown exchange) first lets
        the ones before it complete, as if they had been handled one by one.

        Persistent messages wait for the fsync only where the client is told they are
        stored: in confirm mode, or at a ``tx.commit`` (``committing``). Without either
        the publisher is never told, so the channel does not stall its next publishes
        behind a slow fsync (RabbitMQ's channel does not either): they are written
        (a crash of the process keeps them) and fsynced with the next durable append
        or within the flush interval (docs/amqp.md, "Durability")."""
        promised = self.confirm or committing
        processor, caller = self._conn.processor, self._conn.caller
        requests: list[AppendRequest] = []
        # Per publish: its confirm sequence number (0 without confirms), a basic.return
        # to send before the confirm (if unroutable and mandatory), and ack or nack.
        outcomes: list[tuple[int, bytes | None, bool]] = []
        drop_heads: dict[str, QueueDef] = {}
        # Messages this run adds to each length-limited queue, not yet stored.
        added: dict[str, int] = {}
        failure: AmqpError | None = None
        now = processor.clock.now_ms()
        # Targets whose write permission this run already checked: a run of publishes
        # to one exchange asks once (the permission is the same within one read).
        allowed: set[str] = set()
        for publish in batch:
            seq = 0
            if self.confirm:
                self.seq += 1
                seq = self.seq
            try:
                target = publish.method.exchange or publish.method.routing_key
                if target not in allowed:
                    await self._may_write(publish)
                    allowed.add(target)
                self.resolve(publish)
                request, returned, accepted, heads = await self._prepare(
                    publish, now, added, promised
                )
            except AmqpError as e:
                failure = e
                break
            if request is not None:
                requests.append(request)
            drop_heads.update((queue.name, queue) for queue in heads)
            outcomes.append((seq, returned, accepted))
        if requests:
            await processor.append(caller, requests)
        for queue in drop_heads.values():
            await self._drop_head(queue)
        if outcomes:
            self._send_outcomes(outcomes)
        if failure is not None:
            raise failure

    def _send_outcomes(self, outcomes: list[tuple[int, bytes | None, bool]]) -> None:
        out: list[bytes] = []
        for _, returned, _ in outcomes:
            if returned is not None:
                out.append(returned)
        if self.confirm:
            seqs = [seq for seq, _, _ in outcomes]
            if all(accepted for _, _, accepted in outcomes):
                out.append(confirm_frame(self._channel.number, seqs[-1], len(seqs) > 1))
            else:
                for seq, _, accepted in outcomes:
                    confirm = commands.Basic.Ack if accepted else commands.Basic.Nack
                    out.append(method_frame(self._channel.number, confirm(delivery_tag=seq)))
        if out:
            self._conn.send_bytes(b"".join(out))

    async def _prepare(
        self, publish: Publish, now: int, added: dict[str, int], promised: bool
    ) -> tuple[AppendRequest | None, bytes | None, bool, list[QueueDef]]:
        vhost = self._conn.vhost
        method, header = publish.method, publish.header
        assert header is not None
        body = bytes(publish.chunks)
        properties, raw = header.properties, header.raw_properties
        routing_key = method.routing_key
        exchange = vhost.exchanges[method.exchange]
        if properties.reply_to == REPLY_TO:
            if self._channel.reply_token is None:
                raise ChannelError(
                    errors.PRECONDITION_FAILED, "fast reply consumer does not exist", 60, 40
                )
            properties.reply_to = f"{REPLY_TO}.{self._channel.reply_token}"
            raw = encode_properties(properties)
        if exchange.name == "" and routing_key.startswith(REPLY_TO + "."):
            if await vhost.replies.send(self._conn.caller, routing_key, raw, body):
                return None, None, True, []
            return None, self._return_frames(method, raw, body), True, []
        names = list(vhost.route(exchange, routing_key, properties.headers))
        accepted = True
        heads: list[QueueDef] = []
        targets: list[QueueRef] = []
        reached: list[QueueDef] = []
        overflowed: list[QueueDef] = []  # reject-publish-dlx: dead-lettered, not stored
        # A fanout or topic exchange may reach thousands of queues: hand the loop
        # back every slice of them (a few need no async generator of their own).
        for i, name in enumerate(names, 1):
            if i % SLICE == 0:
                await pause()
            queue = vhost.queues[name]
            limit = queue.int_argument("x-max-length")
            if limit is not None:
                count = await vhost.message_count(self._conn.caller, queue)
                if count + added.get(name, 0) >= limit:
                    overflow = queue.arguments.get("x-overflow", "drop-head")
                    if overflow != "drop-head":
                        accepted = False
                        if overflow == "reject-publish-dlx":
                            overflowed.append(queue)
                        continue
                    heads.append(queue)
                added[name] = added.get(name, 0) + 1
            if queue.view_topic is not None:  # a view: to its topic, as a keyed producer
                targets.append(
                    await self._topic_ref(vhost.namespace, queue.view_topic, routing_key)
                )
            else:
                targets.append(queue.ref_for(vhost.namespace, properties.priority))
            reached.append(queue)
        topic, mqtt_topic = self._natural_target(exchange.name, exchange.arguments, routing_key)
        if topic is not None:
            try:
                targets.append(await self._topic_ref(vhost.namespace, topic, routing_key))
            except InvalidName:
                if self._explicit(exchange.arguments):
                    raise  # an explicit x-polymq-topic naming no valid topic
                topic = mqtt_topic = None  # a natural name storage refuses: AMQP only
        if not targets and not overflowed:
            returned = (
                self._return_frames(method, raw, body) if method.mandatory and not names else None
            )
            return None, returned, accepted, heads
        message = to_message(
            exchange=exchange.name,
            routing_key=routing_key,
            properties=properties,
            raw_properties=raw,
            body=body,
        )
        if mqtt_topic is not None:  # how MQTT subscribers of the topic see it
            message = _with_property(message, interop.MQTT_TOPIC, mqtt_topic.encode())
        if properties.expiration:
            try:
                ttl = max(0, int(properties.expiration))
            except ValueError as e:
                raise ChannelError(
                    errors.PRECONDITION_FAILED,
                    f"invalid expiration '{properties.expiration}'",
                    60,
                    40,
                ) from e
            message = _with_property(message, EXPIRES_AT, str(now + ttl).encode())
            for queue in reached:
                vhost.watch_expiry(self._conn.caller, queue, ttl)
        for queue in overflowed:
            rejected = StoredMessage(
                message=message,
                queue=queue.ref_for(vhost.namespace, properties.priority),
                offset=-1,
                message_id="",
                store_timestamp_ms=now,
            )
            await dead_letter(
                self._conn.processor, self._conn.caller, vhost, queue, rejected, "maxlen"
            )
        if not targets:
            return None, None, accepted, heads
        # A view bound to the exchange and the exchange's own topic may name one queue.
        unique = tuple(dict.fromkeys(targets))
        # A natural topic is not a queue: RabbitMQ's mandatory still returns a publish
        # no queue took (an explicit x-polymq-topic counts as routed, as documented).
        returned = None
        if method.mandatory and not names and not self._explicit(exchange.arguments):
            returned = self._return_frames(method, raw, body)
        # As RabbitMQ: only a persistent message (delivery_mode 2) to a durable queue
        # (or a storage topic) that the client is to be told about waits for the
        # fsync; a transient one, or one nobody confirms, is written only.
        durable = (
            promised
            and properties.delivery_mode == 2
            and (topic is not None or any(q.durable or q.view_topic is not None for q in reached))
        )
        request = AppendRequest(entry=message, queues=unique, durable=durable)
        return request, returned, accepted, heads

    @staticmethod
    def _explicit(arguments: Mapping[str, Any]) -> bool:
        explicit = arguments.get(interop.AMQP_TOPIC_ARGUMENT)
        return isinstance(explicit, str) and bool(explicit)

    def _natural_target(
        self, exchange: str, arguments: Mapping[str, Any], routing_key: str
    ) -> tuple[str | None, str | None]:
        """The storage topic a publish also goes to (docs/interop.md, natural names),
        and the MQTT topic name it is shown under there (None: the topic's own name):
        ``x-polymq-topic`` as given, exchange ``T`` is topic ``T`` (routing key ``a.b``
        shown as ``T/a/b``), ``amq.topic`` with ``a.b.c`` is topic ``a`` as ``a/b/c``."""
        natural = self._conn.vhost.natural
        if exchange == AMQ_TOPIC:
            target = natural.amq_topic_target(routing_key)
            return (None, None) if target is None else target
        topic = natural.topic_of(exchange, dict(arguments))
        if topic is None:
            return None, None
        if self._explicit(arguments):
            return topic, None
        return topic, mqtt_name(topic, routing_key)

    async def _topic_ref(self, namespace: str, topic: str, routing_key: str) -> QueueRef:
        """The queue of storage topic ``topic`` a publish to an exchange declared with
        ``x-polymq-topic`` also goes to (docs/interop.md): chosen by the routing key's
        hash, as a keyed producer picks a partition. A missing topic is created with
        one queue, as MQTT creates its topics on first publish."""
        count = self._topic_queues.get(topic)
        if count is None:
            processor, caller = self._conn.processor, self._conn.caller
            try:
                info = await processor.describe_topic(caller, topic)
            except TopicNotFound:
                with contextlib.suppress(TopicAlreadyExists):
                    await processor.create_topic(caller, topic, TopicConfig(queue_count=1))
                info = await self._describe_made(topic)
            count = self._topic_queues[topic] = max(1, len(info.queues))
        queue_id = zlib.crc32(routing_key.encode()) % count if count > 1 else 0
        return QueueRef(namespace, topic, queue_id)

    async def _describe_made(self, topic: str) -> TopicInfo:
        """A topic just made (here, or by another gateway: "already exists"): in the
        separated form this gateway's storage client may route to it a moment later."""
        processor, caller = self._conn.processor, self._conn.caller
        for _ in range(_MADE_ATTEMPTS - 1):
            with contextlib.suppress(TopicNotFound):
                return await processor.describe_topic(caller, topic)
            await asyncio.sleep(0.02)
        return await processor.describe_topic(caller, topic)

    def _return_frames(self, method: commands.Basic.Publish, raw: bytes, body: bytes) -> bytes:
        returned = commands.Basic.Return(
            reply_code=errors.NO_ROUTE,
            reply_text="NO_ROUTE",
            exchange=method.exchange,
            routing_key=method.routing_key,
        )
        return method_frame(self._channel.number, returned) + content_frames(
            self._channel.number, raw, body, self._conn.frame_max
        )

    async def _drop_head(self, queue: QueueDef) -> None:
        """x-max-length with drop-head: the oldest ready messages make room."""
        vhost, caller = self._conn.vhost, self._conn.caller
        limit = queue.int_argument("x-max-length") or 0
        excess = await vhost.message_count(caller, queue) - limit
        if excess <= 0:
            return
        refs = tuple(reversed(queue.refs(vhost.namespace)))  # lowest priority first
        for ref in refs:
            popped = await self._conn.processor.pop(
                caller, queue.group, [ref], max_messages=excess, invisible_ms=INVISIBLE_MS
            )
            vhost.requeued.taken(popped)
            for stored in popped:
                await dead_letter(self._conn.processor, caller, vhost, queue, stored, "maxlen")
            excess -= len(popped)
            if excess <= 0:
                return


def _with_property(message: Message, name: str, value: bytes) -> Message:
    return dataclasses.replace(message, properties=(*message.properties, (name, value)))
