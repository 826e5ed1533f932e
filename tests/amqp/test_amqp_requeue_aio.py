"""RabbitMQ's requeue semantics, with aio-pika: messages given back by reject / nack
with requeue (single and multiple), by closing the channel, and by closing the
connection are ready at once (a passive declare counts them, a get returns them),
redelivered, in their original order ahead of the messages behind them."""

from __future__ import annotations

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from tests.amqp.conftest import unique
from tests.live_server import LiveServer


def _url(server: LiveServer) -> str:
    return f"amqp://guest:guest@127.0.0.1:{server.port('amqp')}/"


async def _queue_with(channel: AbstractChannel, count: int) -> str:
    name = unique("aio-requeue")
    await channel.declare_queue(name, durable=True)
    for i in range(count):
        await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), routing_key=name)
    return name


async def _ready(channel: AbstractChannel, name: str) -> int:
    queue = await channel.declare_queue(name, passive=True)
    result = queue.declaration_result
    return int(result.message_count or 0)


async def _get(channel: AbstractChannel, name: str, count: int) -> list[AbstractIncomingMessage]:
    queue = await channel.get_queue(name, ensure=False)
    got = []
    for _ in range(count):
        message = await queue.get(no_ack=False, fail=True)
        assert message is not None
        got.append(message)
    return got


async def _drain(channel: AbstractChannel, name: str) -> list[tuple[int, bool]]:
    queue = await channel.get_queue(name, ensure=False)
    got: list[tuple[int, bool]] = []
    while (message := await queue.get(no_ack=True, fail=False)) is not None:
        got.append((int(message.body), bool(message.redelivered)))
    return got


async def test_nack_and_reject_requeue_at_once_in_place(server: LiveServer) -> None:
    async with await aio_pika.connect(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True)
        name = await _queue_with(channel, 5)
        first, second, third = await _get(channel, name, 3)
        assert await _ready(channel, name) == 2
        await second.reject(requeue=True)
        assert await _ready(channel, name) == 3
        await third.nack(multiple=True, requeue=True)  # the first and the third
        assert await _ready(channel, name) == 5
        assert first.delivery_tag is not None
        assert await _drain(channel, name) == [
            (0, True),
            (1, True),
            (2, True),
            (3, False),
            (4, False),
        ]


async def test_closing_a_channel_or_the_connection_requeues_at_once(server: LiveServer) -> None:
    async with await aio_pika.connect(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True)
        name = await _queue_with(channel, 5)
        holder = await conn.channel()
        await _get(holder, name, 2)
        await holder.close()
        assert await _ready(channel, name) == 5
        async with await aio_pika.connect(_url(server)) as other:
            await _get(await other.channel(), name, 3)
            assert await _ready(channel, name) == 2
        assert await _ready(channel, name) == 5
        assert [redelivered for _, redelivered in await _drain(channel, name)] == [
            True,
            True,
            True,
            False,
            False,
        ]
