"""aio-pika (robust connection, asyncio) drives a work queue, topic routing with
returns, confirms, nack/requeue, and RPC over direct reply-to."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from aio_pika.exceptions import DeliveryError

from tests.amqp.conftest import WAIT_S, unique
from tests.live_server import LiveServer


def _url(server: LiveServer) -> str:
    return f"amqp://guest:guest@127.0.0.1:{server.port('amqp')}/"


async def _work_queue(server: LiveServer) -> None:
    queue_name = unique("aio")
    async with await aio_pika.connect_robust(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=10)
        queue = await channel.declare_queue(queue_name, durable=True)
        for i in range(30):
            await channel.default_exchange.publish(
                aio_pika.Message(str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue_name,
            )
        got: list[int] = []
        requeued = False
        async with queue.iterator() as messages:
            async for message in messages:
                if int(message.body) == 5 and not requeued:
                    requeued = True
                    await message.nack(requeue=True)
                    continue
                if int(message.body) == 5:
                    assert message.redelivered
                got.append(int(message.body))
                await message.ack()
                if len(got) == 30:
                    break
        assert sorted(got) == list(range(30))


async def _topic_and_returns(server: LiveServer) -> None:
    async with await aio_pika.connect_robust(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(unique("aiotopic"), aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, "logs.*.error")
        await exchange.publish(aio_pika.Message(b"hit"), routing_key="logs.api.error")
        with pytest.raises(DeliveryError):
            await exchange.publish(
                aio_pika.Message(b"miss"), routing_key="logs.api.info", mandatory=True
            )
        message = await queue.get(timeout=WAIT_S)
        assert message is not None and message.body == b"hit"
        await message.ack()


async def _rpc(server: LiveServer) -> None:
    service = unique("aiorpc")
    async with await aio_pika.connect_robust(_url(server)) as conn:
        channel = await conn.channel()
        requests = await channel.declare_queue(service, auto_delete=True)

        async def serve(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                await channel.default_exchange.publish(
                    aio_pika.Message(message.body.upper(), correlation_id=message.correlation_id),
                    routing_key=message.reply_to or "",
                )

        await requests.consume(serve)
        client = await conn.channel()
        replies = await client.get_queue("amq.rabbitmq.reply-to", ensure=False)
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            assert message.correlation_id == "r1"
            answer.set_result(message.body)

        await replies.consume(on_reply, no_ack=True)
        await client.default_exchange.publish(
            aio_pika.Message(b"ping", reply_to="amq.rabbitmq.reply-to", correlation_id="r1"),
            routing_key=service,
        )
        assert await asyncio.wait_for(answer, WAIT_S) == b"PING"


def test_aio_pika_work_queue(server: LiveServer) -> None:
    asyncio.run(asyncio.wait_for(_work_queue(server), 60))


def test_aio_pika_topic_routing_and_returns(server: LiveServer) -> None:
    asyncio.run(asyncio.wait_for(_topic_and_returns(server), 60))


def test_aio_pika_rpc_with_direct_reply_to(server: LiveServer) -> None:
    asyncio.run(asyncio.wait_for(_rpc(server), 60))


async def _pipelined_confirms_keep_order(server: LiveServer) -> None:
    queue_name = unique("pipeline")
    async with await aio_pika.connect_robust(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(queue_name)
        confirms = [
            channel.default_exchange.publish(aio_pika.Message(str(i).encode()), queue_name)
            for i in range(500)
        ]
        await asyncio.gather(*confirms)  # all in flight at once: stored in runs
        got = []
        for _ in range(500):
            message = await queue.get(no_ack=True, timeout=WAIT_S)
            assert message is not None
            got.append(int(message.body))
        assert got == list(range(500))


def test_aio_pika_pipelined_confirms_keep_order(server: LiveServer) -> None:
    asyncio.run(asyncio.wait_for(_pipelined_confirms_keep_order(server), 60))
