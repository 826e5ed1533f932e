"""Two gateways over one storage behave as one RabbitMQ cluster: what is declared
through one is in effect through the other once declare-ok returns, consumers on both
share a queue, exclusivity, auto-delete, x-expires and single-active-consumer hold
across them, and clients that lose their gateway carry on through the other without
losing a confirmed message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import AMQPConnectionError, ChannelClosedByBroker, UnroutableError

from polymq.protocols import interop
from tests.amqp.conftest import FACTORIES, WAIT_S, channel_closed, unique, wait_for
from tests.live_server import LiveServer, live_gateways


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[list[LiveServer]]:
    with live_gateways(
        tmp_path_factory.mktemp("amqp-gateways"), ("amqp",), 2, factories=FACTORIES
    ) as gateways:
        yield gateways


def connect(server: LiveServer) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", server.port("amqp"), heartbeat=0, blocked_connection_timeout=WAIT_S
        )
    )


def _get(ch: BlockingChannel, queue: str) -> bytes:
    deadline = time.monotonic() + WAIT_S
    while True:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            return bytes(body)
        assert time.monotonic() < deadline, f"nothing arrived in {queue}"
        ch.connection.sleep(0.02)


def _pump(conn: pika.BlockingConnection, done: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "not in time"
        conn.process_data_events(time_limit=0.05)


def test_declarations_through_one_gateway_route_through_the_other(
    pair: list[LiveServer],
) -> None:
    a, b = pair
    with connect(a) as on_a, connect(b) as on_b:
        ch_a, ch_b = on_a.channel(), on_b.channel()
        ch_b.confirm_delivery()
        for round_ in range(5):  # no waiting between the ok and the publish
            exchange, queue = unique("x"), unique("q")
            ch_a.exchange_declare(exchange, "topic")
            ch_a.queue_declare(queue)
            ch_a.queue_bind(queue, exchange, "orders.*")
            ch_b.basic_publish(exchange, "orders.new", f"m{round_}".encode(), mandatory=True)
            assert _get(ch_a, queue) == f"m{round_}".encode()
            ch_a.queue_unbind(queue, exchange, "orders.*")
            with pytest.raises(UnroutableError):
                ch_b.basic_publish(exchange, "orders.new", b"nowhere", mandatory=True)
            ch_a.exchange_delete(exchange)
            with channel_closed(404):
                ch_b.basic_publish(exchange, "orders.new", b"gone")
            ch_b = on_b.channel()
            ch_b.confirm_delivery()
            ch_a.queue_delete(queue)
            with channel_closed(404):
                on_b.channel().queue_declare(queue, passive=True)


def test_consumers_on_both_gateways_share_a_queue_within_their_prefetch(
    pair: list[LiveServer],
) -> None:
    a, b = pair
    queue = unique("work")
    with connect(a) as on_a, connect(b) as on_b:
        ch_a, ch_b = on_a.channel(), on_b.channel()
        ch_a.queue_declare(queue, durable=True)
        held: list[int] = []  # A takes one and never acks it: prefetch 1 holds A back
        ch_a.basic_qos(prefetch_count=1)
        ch_a.basic_consume(queue, lambda c, m, p, body: held.append(m.delivery_tag))
        got_b: list[bytes] = []

        def on_b_message(c: Any, m: Any, _p: Any, body: bytes) -> None:
            got_b.append(body)
            c.basic_ack(m.delivery_tag)

        ch_b.basic_qos(prefetch_count=5)
        ch_b.basic_consume(queue, on_b_message)
        publisher = on_a.channel()
        publisher.confirm_delivery()
        for i in range(20):
            publisher.basic_publish("", queue, str(i).encode())

        def settled() -> bool:
            on_a.process_data_events(time_limit=0.01)
            return len(held) + len(got_b) >= 20

        _pump(on_b, settled)
        on_a.process_data_events(time_limit=0.3)
        on_b.process_data_events(time_limit=0.3)
        assert len(held) == 1 and len(got_b) == 19  # each message once, A within prefetch
        ch_a.basic_ack(held[0])  # an ack through A of a message B never saw
        ch_a.queue_declare(queue, durable=True, passive=True)
        assert ch_b.queue_declare(queue, durable=True, passive=True).method.message_count == 0


def test_exclusive_queues_are_locked_on_every_gateway_and_go_with_their_connection(
    pair: list[LiveServer],
) -> None:
    a, b = pair
    with connect(b) as on_b:
        with connect(a) as on_a:
            queue = on_a.channel().queue_declare("", exclusive=True).method.queue
            with channel_closed(405):
                on_b.channel().basic_consume(queue, lambda *args: None)
            with channel_closed(405):
                on_b.channel().queue_declare(queue, passive=True)
            with channel_closed(405):
                on_b.channel().queue_delete(queue)
        # Its connection closed: the queue is gone through B too.
        wait_for(lambda: _missing(on_b, queue))


def _missing(conn: pika.BlockingConnection, queue: str) -> bool:
    """Whether ``queue`` is gone (an exclusive one is locked until then)."""
    try:
        conn.channel().queue_declare(queue, passive=True)
    except ChannelClosedByBroker as e:
        assert e.reply_code in (404, 405), e
        return bool(e.reply_code == 404)
    return False


def test_auto_delete_waits_for_the_last_consumer_on_any_gateway(pair: list[LiveServer]) -> None:
    a, b = pair
    queue = unique("auto")
    with connect(a) as on_a, connect(b) as on_b:
        on_a.channel().queue_declare(queue, auto_delete=True)
        ch_a, ch_b = on_a.channel(), on_b.channel()
        tag_a = ch_a.basic_consume(queue, lambda *args: None)
        tag_b = ch_b.basic_consume(queue, lambda *args: None)
        declared = on_b.channel().queue_declare(queue, auto_delete=True, passive=True)
        assert declared.method.consumer_count == 2
        ch_a.basic_cancel(tag_a)
        assert not _missing(on_b, queue)  # B's consumer still holds it
        ch_b.basic_cancel(tag_b)
        wait_for(lambda: _missing(on_a, queue))


def test_x_expires_counts_consumers_on_the_other_gateway(pair: list[LiveServer]) -> None:
    a, b = pair
    queue = unique("expires")
    with connect(a) as on_a, connect(b) as on_b:
        on_a.channel().queue_declare(queue, arguments={"x-expires": 300})
        ch_b = on_b.channel()
        tag = ch_b.basic_consume(queue, lambda *args: None)
        on_b.sleep(1.0)  # three expiry periods with a consumer on B: it stays
        assert not _missing(on_a, queue)
        ch_b.basic_cancel(tag)
        wait_for(lambda: _missing(on_a, queue))


def test_single_active_consumer_across_gateways(pair: list[LiveServer]) -> None:
    a, b = pair
    queue = unique("sac")
    got: dict[str, list[bytes]] = {"a": [], "b": []}

    def taker(name: str) -> Any:
        def on_message(c: Any, m: Any, _p: Any, body: bytes) -> None:
            got[name].append(body)
            c.basic_ack(m.delivery_tag)

        return on_message

    with connect(a) as on_a, connect(b) as on_b:
        ch_a, ch_b = on_a.channel(), on_b.channel()
        ch_a.queue_declare(queue, arguments={"x-single-active-consumer": True})
        tag_a = ch_a.basic_consume(queue, taker("a"))
        ch_b.basic_consume(queue, taker("b"))  # second in line, on the other gateway
        publisher = on_b.channel()
        publisher.confirm_delivery()
        for i in range(5):
            publisher.basic_publish("", queue, f"a{i}".encode())

        def both() -> None:
            on_a.process_data_events(time_limit=0.02)
            on_b.process_data_events(time_limit=0.02)

        deadline = time.monotonic() + WAIT_S
        while len(got["a"]) < 5:
            assert time.monotonic() < deadline, got
            both()
        ch_a.basic_cancel(tag_a)
        for i in range(3):
            publisher.basic_publish("", queue, f"b{i}".encode())
        while len(got["b"]) < 3:
            assert time.monotonic() < deadline, got
            both()
        assert got["a"] == [f"a{i}".encode() for i in range(5)]
        assert sorted(got["b"]) == [b"b0", b"b1", b"b2"]


def test_two_views_of_one_topic_each_get_every_message(pair: list[LiveServer]) -> None:
    a, b = pair
    topic = unique("view-topic")
    with connect(a) as on_a, connect(b) as on_b:
        ch_a, ch_b = on_a.channel(), on_b.channel()
        first, second = unique("view"), unique("view")
        ch_a.queue_declare(first, durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
        ch_b.queue_declare(second, durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
        ch_a.exchange_declare(topic, "fanout", arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
        ch_b.confirm_delivery()
        for i in range(3):
            ch_b.basic_publish(topic, f"k{i}", f"m{i}".encode())
        assert sorted(_get(ch_a, first) for _ in range(3)) == [b"m0", b"m1", b"m2"]
        assert sorted(_get(ch_b, second) for _ in range(3)) == [b"m0", b"m1", b"m2"]
        assert ch_a.queue_declare(first, durable=True, passive=True).method.message_count == 0
        # A view is no topic of its own, and deleting it leaves the topic alone.
        ch_a.queue_delete(first)
        ch_b.basic_publish(topic, "k", b"after")
        assert _get(ch_b, second) == b"after"


@pytest.mark.parametrize(
    "arguments",
    [
        {"x-queue-type": "stream"},
        {"x-max-priority": 5},
        {},
    ],
)
def test_a_view_refuses_streams_priorities_and_bad_topic_names(
    pair: list[LiveServer], arguments: dict[str, Any]
) -> None:
    with connect(pair[0]) as conn:
        topic: object = unique("t") if arguments else "amqp:" + unique("q")
        with channel_closed(406):
            conn.channel().queue_declare(
                unique("view"),
                durable=True,
                arguments={interop.AMQP_TOPIC_ARGUMENT: topic, **arguments},
            )


def test_aio_pika_publishes_through_one_gateway_and_consumes_through_the_other(
    pair: list[LiveServer],
) -> None:
    a, b = pair
    queue_name = unique("aio")

    async def run() -> list[bytes]:
        url_a = f"amqp://guest:guest@127.0.0.1:{a.port('amqp')}/"
        url_b = f"amqp://guest:guest@127.0.0.1:{b.port('amqp')}/"
        async with (
            await aio_pika.connect_robust(url_a) as conn_a,
            await aio_pika.connect_robust(url_b) as conn_b,
        ):
            publisher = await conn_a.channel(publisher_confirms=True)
            exchange = await publisher.declare_exchange(
                unique("aiox"), aio_pika.ExchangeType.DIRECT
            )
            queue_a = await publisher.declare_queue(queue_name, durable=True)
            await queue_a.bind(exchange, "k")
            consumer = await conn_b.channel()
            queue_b = await consumer.get_queue(queue_name)
            for i in range(10):
                await exchange.publish(aio_pika.Message(str(i).encode()), routing_key="k")
            got: list[bytes] = []
            async with asyncio.timeout(WAIT_S):
                async with queue_b.iterator() as messages:
                    async for message in messages:
                        got.append(message.body)
                        await message.ack()
                        if len(got) == 10:
                            break
            return got

    assert sorted(asyncio.run(run()), key=int) == [str(i).encode() for i in range(10)]


# -- losing a gateway ---------------------------------------------------------------


def test_clients_carry_on_through_the_other_gateway_without_losing_a_confirmed_message(
    tmp_path: Path, server_form: str
) -> None:
    """Gateway A stops under a confirming publisher and a consumer holding unacked
    deliveries; both reconnect to B: every confirmed message arrives (at least once),
    the unacked ones redelivered."""
    with live_gateways(tmp_path, ("amqp",), 2, factories=FACTORIES) as (a, b):
        queue = unique("failover")
        confirmed: list[int] = []
        producer_a, consumer_a = connect(a), connect(a)  # they die with A: never closed
        ch = producer_a.channel()
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        for i in range(50):
            ch.basic_publish("", queue, str(i).encode())
            confirmed.append(i)
        consuming = consumer_a.channel()
        consuming.basic_qos(prefetch_count=10)
        unacked: list[bytes] = []
        consuming.basic_consume(queue, lambda c, m, p, body: unacked.append(body))
        _pump(consumer_a, lambda: len(unacked) == 10)
        a.call(a.gateway.close)  # A goes away under both clients
        with pytest.raises(AMQPConnectionError):
            for i in range(50, 100):  # the publisher notices on its next publish
                ch.basic_publish("", queue, str(i).encode())
                confirmed.append(i)
        with connect(b) as producer_b, connect(b) as consumer_b:
            ch = producer_b.channel()
            ch.confirm_delivery()
            for i in range(100, 120):
                ch.basic_publish("", queue, str(i).encode())
                confirmed.append(i)
            got: set[int] = set()
            redelivered: set[int] = set()
            consuming = consumer_b.channel()

            def on_message(c: Any, m: Any, _p: Any, body: bytes) -> None:
                got.add(int(body))
                if m.redelivered:
                    redelivered.add(int(body))
                c.basic_ack(m.delivery_tag)

            consuming.basic_consume(queue, on_message)
            _pump(consumer_b, lambda: got >= set(confirmed))
        assert {int(body) for body in unacked} <= redelivered


def test_a_gateway_loading_the_vhost_later_keeps_its_peers_queues(
    tmp_path: Path, server_form: str
) -> None:
    """B loads the vhost only when its first client comes, after A's declarations:
    it finds them all, and leaves A's exclusive and transient queues alone (they
    belong to A's live connection and instance, not to an earlier run of B)."""
    with (
        live_gateways(tmp_path, ("amqp",), 2, factories=FACTORIES) as (a, b),
        connect(a) as on_a,
    ):
        ch_a = on_a.channel()
        exclusive = ch_a.queue_declare("", exclusive=True).method.queue
        transient = unique("transient")
        ch_a.queue_declare(transient, durable=False)
        ch_a.basic_publish("", transient, b"kept")
        with connect(b) as on_b:  # B's first client: B loads the vhost now
            with channel_closed(405):
                on_b.channel().queue_declare(exclusive, passive=True)
            assert _get(on_b.channel(), transient) == b"kept"
            on_b.sleep(1.5)  # a few reaper passes on both gateways
            with channel_closed(405):
                on_b.channel().queue_declare(exclusive, passive=True)
            ch_a.queue_declare(transient, durable=False, passive=True)


def test_direct_reply_to_reaches_a_requester_on_the_other_gateway(pair: list[LiveServer]) -> None:
    a, b = pair
    requests = unique("rpc")
    with connect(a) as client, connect(b) as server:
        server_ch = server.channel()
        server_ch.queue_declare(requests)

        def answer(c: Any, m: Any, props: pika.BasicProperties, body: bytes) -> None:
            reply = pika.BasicProperties(correlation_id=props.correlation_id)
            c.basic_publish("", props.reply_to, b"re: " + body, reply)
            c.basic_ack(m.delivery_tag)

        server_ch.basic_consume(requests, answer)
        client_ch = client.channel()
        replies: list[tuple[str, bytes]] = []
        client_ch.basic_consume(
            "amq.rabbitmq.reply-to",
            lambda c, m, p, body: replies.append((p.correlation_id, body)),
            auto_ack=True,
        )
        for i in range(3):
            asking = pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id=str(i))
            client_ch.basic_publish("", requests, f"q{i}".encode(), asking)

        def answered() -> bool:
            server.process_data_events(time_limit=0.02)
            return len(replies) == 3

        _pump(client, answered)
        assert sorted(replies) == [("0", b"re: q0"), ("1", b"re: q1"), ("2", b"re: q2")]


def test_a_views_count_get_and_purge_act_on_its_topic_for_it_alone(
    pair: list[LiveServer],
) -> None:
    a, b = pair
    topic = unique("counted")
    with connect(a) as on_a, connect(b) as on_b:
        ch_a, ch_b = on_a.channel(), on_b.channel()
        ch_a.exchange_declare(topic, "fanout", arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
        ch_a.confirm_delivery()
        for i in range(4):
            ch_a.basic_publish(topic, f"k{i}", f"m{i}".encode())
        arguments = {interop.AMQP_TOPIC_ARGUMENT: topic}
        first, second = unique("view"), unique("view")
        declared = ch_a.queue_declare(first, durable=True, arguments=arguments)
        assert declared.method.message_count == 4  # a new view starts at the topic's start
        ch_b.queue_declare(second, durable=True, arguments=arguments)
        assert _get(ch_a, first) == b"m0"
        assert ch_a.queue_purge(first).method.message_count == 3
        assert ch_a.queue_declare(first, durable=True, passive=True).method.message_count == 0
        # The other view, through the other gateway, still has all four (once B's
        # storage client routes to the topic A's publish made: in the separated form
        # a moment after).
        wait_for(
            lambda: ch_b.queue_declare(second, durable=True, passive=True).method.message_count == 4
        )
        assert [_get(ch_b, second) for _ in range(4)] == [b"m0", b"m1", b"m2", b"m3"]


def test_a_view_of_a_missing_topic_is_empty_not_an_error(pair: list[LiveServer]) -> None:
    with connect(pair[1]) as conn:
        ch = conn.channel()
        view = unique("view")
        arguments = {interop.AMQP_TOPIC_ARGUMENT: unique("nothing-yet")}
        assert ch.queue_declare(view, durable=True, arguments=arguments).method.message_count == 0
        assert ch.basic_get(view)[0] is None
        assert ch.queue_purge(view).method.message_count == 0
        ch.queue_delete(view)
