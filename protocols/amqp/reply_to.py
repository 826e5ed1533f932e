"""Direct reply-to (``amq.rabbitmq.reply-to``) across gateways.

A reply goes straight to the requesting channel, never to a queue. Within a gateway
that is a call into the channel (memory only, as RabbitMQ). The requester and the
replier may be connected to different gateways, though: a reply token starts with
the id of the gateway that issued it, and a reply for another gateway is appended to
that gateway's reply inbox, the internal storage topic ``%AMQP%reply.<gateway id>``,
which every gateway serving the vhost follows (from its end: a restarted gateway's
channels are new). A reply whose channel is gone is dropped, as RabbitMQ drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Final

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.amqp.properties import RAW_PROPERTIES
from polymq.storage.errors import StorageError, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import AppendRequest, Message, QueueRef, TopicConfig

__all__ = ["REPLY_TO", "ReplyRouter", "Sink"]

log = logging.getLogger(__name__)

REPLY_TO: Final = "amq.rabbitmq.reply-to"
_INBOX_PREFIX: Final = "%AMQP%reply."
_INBOX_RETENTION_MS: Final = 3600 * 1000
_WAIT_MS: Final = 5_000
_RETRY_S: Final = 0.5
_SEND_ATTEMPTS: Final = 10  # an inbox made a moment ago may not be routed to yet

# (routing key, raw content-header properties, body) -> delivered to the channel
Sink = Callable[[str, bytes, bytes], None]


class ReplyRouter:
    """One vhost's reply sinks in this gateway, and its inbox for other gateways'."""

    def __init__(self, processor: Processor, namespace: str, gateway_id: str) -> None:
        self._processor = processor
        self._namespace = namespace
        self._gateway_id = gateway_id
        self._sinks: dict[str, Sink] = {}
        self._reader: asyncio.Task[None] | None = None

    def new_token(self) -> str:
        return f"{self._gateway_id}.{secrets.token_urlsafe(18)}"  # no "." in the tail

    async def open(self, caller: Caller) -> None:
        """Follow this gateway's inbox from its end (with the vhost: by the time a
        reply consumer exists, other gateways can reach the inbox)."""
        ref = self._inbox(self._gateway_id)
        config = TopicConfig(retention_ms=_INBOX_RETENTION_MS, internal=True)
        with contextlib.suppress(TopicAlreadyExists):
            await self._processor.create_topic(caller, ref.topic, config)
        for attempt in range(_SEND_ATTEMPTS * 10):
            try:
                start = (await self._processor.queue_offsets(caller, ref)).latest
                break
            except TopicNotFound:  # the separated form's route follows a moment later
                if attempt == _SEND_ATTEMPTS * 10 - 1:
                    raise
                await asyncio.sleep(0.05)
        self._reader = asyncio.create_task(self._follow(caller, ref, start))

    def register(self, token: str, sink: Sink) -> None:
        self._sinks[token] = sink

    def unregister(self, token: str) -> None:
        self._sinks.pop(token, None)

    async def send(self, caller: Caller, routing_key: str, raw: bytes, body: bytes) -> bool:
        """Deliver a reply published to ``amq.rabbitmq.reply-to.<token>``; ``False``
        when no channel can be waiting for it (unroutable)."""
        token = routing_key[len(REPLY_TO) + 1 :]
        sink = self._sinks.get(token)
        if sink is not None:
            sink(routing_key, raw, body)
            return True
        gateway_id = token.rpartition(".")[0]
        if not gateway_id or gateway_id == self._gateway_id:
            return False
        reply = Message(body=body, key=routing_key.encode(), properties=((RAW_PROPERTIES, raw),))
        request = AppendRequest(entry=reply, queues=(self._inbox(gateway_id),))
        for _ in range(_SEND_ATTEMPTS):
            try:
                await self._processor.append(caller, [request])
                return True
            except TopicNotFound:  # no such gateway, or its inbox is not routed to yet
                await asyncio.sleep(0.02)
        return False

    def _inbox(self, tag: str) -> QueueRef:
        return QueueRef(self._namespace, _INBOX_PREFIX + tag, 0)

    async def _follow(self, caller: Caller, ref: QueueRef, offset: int) -> None:
        while True:
            try:
                result = await self._processor.read(
                    caller, ref, offset, max_messages=256, wait_ms=_WAIT_MS, metered=False
                )
            except StorageError as e:
                log.debug("amqp: reading the reply inbox failed: %s", e)
                await asyncio.sleep(_RETRY_S)
                continue
            offset = result.next_offset
            for stored in result.messages:
                routing_key = (stored.message.key or b"").decode(errors="replace")
                sink = self._sinks.get(routing_key[len(REPLY_TO) + 1 :])
                if sink is not None:
                    sink(
                        routing_key,
                        stored.message.property(RAW_PROPERTIES) or b"",
                        stored.message.body,
                    )

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
