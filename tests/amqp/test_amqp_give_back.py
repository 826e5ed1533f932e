"""A message the server popped for a consumer whose channel or connection closed
before it was sent goes back as never delivered: ready at once, and the next consumer
gets it with ``redelivered`` false (RabbitMQ flags only what a client was sent).

The race is forced, not waited for: the in-process server's pop holds its answer until
the consumer's stop has begun, so the closing channel finds a fetch that took messages.
aio-pika closes without cancelling its consumers first (pika's blocking channel cancels
them, and a cancelled consumer's fetch is delivered before cancel-ok instead).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import aio_pika
import pytest

from polymq.gateway.processor import Caller
from polymq.storage.model import QueueRef, StoredMessage
from tests.amqp.conftest import WAIT_S, unique
from tests.live_server import LiveServer


def _url(server: LiveServer) -> str:
    return f"amqp://guest:guest@127.0.0.1:{server.port('amqp')}/"


def _hold_pop_until_stop(
    server: LiveServer, queue: str, monkeypatch: pytest.MonkeyPatch
) -> threading.Event:
    """Make the first pop that takes a message of ``queue`` answer only once its
    consumer is stopping. Returns an event set when that pop has taken it."""
    listener: Any = server.gateway.listeners.get("amqp")
    processor = server.gateway.processor
    real_pop = processor.pop
    taken = threading.Event()

    async def pop(
        caller: Caller, group: str, queues: Sequence[QueueRef], **kwargs: Any
    ) -> list[StoredMessage]:
        popped = await real_pop(caller, group, queues, **kwargs)
        if popped and queues[0].topic == "amqp:" + queue and not taken.is_set():
            taken.set()
            vhost = await listener._services.get(caller)
            [consumer] = vhost.queues[queue].consumers
            stopping = asyncio.Event()
            stop = consumer.stop

            async def stop_then_release() -> None:
                stopped = stop()  # marks the consumer stopping before its first await
                stopping.set()
                await stopped

            monkeypatch.setattr(consumer, "stop", stop_then_release)
            await asyncio.wait_for(stopping.wait(), WAIT_S)
        return popped

    monkeypatch.setattr(processor, "pop", pop)
    return taken


async def _ready(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count or 0)


@pytest.mark.parametrize("closing", ["channel", "connection"])
async def test_a_message_popped_for_a_closing_consumer_comes_back_not_redelivered(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, closing: str
) -> None:
    name = unique("give-back")
    async with await aio_pika.connect(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(name)
        await channel.default_exchange.publish(aio_pika.Message(b"unseen"), routing_key=name)
        taken = _hold_pop_until_stop(server, name, monkeypatch)
        seen: list[bytes] = []

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            seen.append(message.body)

        consuming = await aio_pika.connect(_url(server))
        consumer_channel = await consuming.channel()
        consumer_queue = await consumer_channel.get_queue(name, ensure=False)
        await consumer_queue.consume(on_message)
        assert await asyncio.to_thread(taken.wait, WAIT_S), "the pop never took the message"
        if closing == "channel":
            await consumer_channel.close()  # close-ok: the server is done with the channel
        await consuming.close()
        assert seen == []
        assert await _ready(channel, name) == 1  # ready at once, not after its lease
        message = await queue.get(no_ack=True, timeout=WAIT_S)
        assert message.body == b"unseen"
        assert message.redelivered is False
