"""RabbitMQ extensions through pika: dead-lettering with x-death, message TTL,
max-length overflow, priorities, direct reply-to, x-expires, and durable queues
surviving a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, NackError

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols.amqp.expiry import sweep_once
from polymq.storage.model import DEFAULT_NAMESPACE
from tests.amqp.conftest import WAIT_S, channel_closed, connect, drain, start, unique
from tests.live_server import LiveServer


def _get(
    ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, timeout: float = WAIT_S
) -> tuple[pika.spec.Basic.GetOk, pika.BasicProperties, bytes]:
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            return method, props, body
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing arrived in {queue}")
        ch.connection.sleep(0.05)


def _dlx_pair(
    ch: pika.adapters.blocking_connection.BlockingChannel, **arguments: object
) -> tuple[str, str, str]:
    dlx, dead, source = unique("dlx"), unique("dead"), unique("source")
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    ch.queue_declare(source, arguments={"x-dead-letter-exchange": dlx, **arguments})
    return dlx, dead, source


def test_rejected_message_is_dead_lettered_with_x_death(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        _, dead, source = _dlx_pair(ch)
        ch.basic_publish("", source, b"bad", pika.BasicProperties(headers={"keep": "me"}))
        method, _, _ = ch.basic_get(source)
        assert method is not None
        ch.basic_reject(method.delivery_tag, requeue=False)
        _, props, body = _get(ch, dead)
        assert body == b"bad" and props.headers["keep"] == "me"
        [death] = props.headers["x-death"]
        assert death["queue"] == source and death["reason"] == "rejected"
        assert death["count"] == 1 and death["exchange"] == ""
        assert death["routing-keys"] == [source]
        assert props.headers["x-first-death-reason"] == "rejected"


def test_message_ttl_dead_letters_without_consumers(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        _, dead, source = _dlx_pair(ch, **{"x-message-ttl": 200})
        ch.basic_publish("", source, b"expires")
        _, props, body = _get(ch, dead)
        assert body == b"expires"
        assert props.headers["x-death"][0]["reason"] == "expired"
        assert ch.basic_get(source)[0] is None


def test_per_message_expiration_on_delivery(server: LiveServer) -> None:
    queue = unique("perexp")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"short", pika.BasicProperties(expiration="50"))
        ch.basic_publish("", queue, b"long", pika.BasicProperties(expiration="600000"))
        conn.sleep(0.3)
        _, _, body = _get(ch, queue)
        assert body == b"long"


def test_per_message_expiration_at_head_without_consumers(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        _, dead, source = _dlx_pair(ch)  # no x-message-ttl: the message's own expiration
        ch.basic_publish("", source, b"gone", pika.BasicProperties(expiration="20"))
        _, props, body = _get(ch, dead)  # nobody asked for it: expired at the head
        assert body == b"gone" and props.headers["x-death"][0]["reason"] == "expired"
        assert props.headers["x-death"][0]["original-expiration"] == "20"


def test_ttl_sweeper_peeks_without_delivering(server: LiveServer) -> None:
    """The sweeper removes what expired at the head (here by its own ``expiration``)
    and only looks at the unexpired message behind it: that one is then a first
    delivery, not a redelivery."""
    listener: Any = server.gateway.listeners.get("amqp")
    caller = Caller(principal=ANONYMOUS, namespace=DEFAULT_NAMESPACE, protocol="amqp")
    with connect(server) as conn:
        ch = conn.channel()
        _, dead, source = _dlx_pair(ch, **{"x-message-ttl": 600_000})
        ch.basic_publish("", source, b"short", pika.BasicProperties(expiration="1"))
        ch.basic_publish("", source, b"stays")
        _, props, body = _get(ch, dead)  # nobody consumes source: the sweeper did it
        assert body == b"short" and props.headers["x-death"][0]["reason"] == "expired"
        vhost = server.call(lambda: listener._services.get(caller))
        queue = vhost.queues[source]
        due = server.call(lambda: sweep_once(caller, vhost, queue))  # looks at "stays"
        assert due is not None and due > server.gateway.clock.now_ms() + 500_000
        method, _, body = ch.basic_get(source, auto_ack=True)
        assert body == b"stays"
        assert method is not None and method.redelivered is False


def test_single_active_consumer_hands_over_when_it_leaves(server: LiveServer) -> None:
    queue = unique("sac")
    got: dict[str, list[bytes]] = {"first": [], "second": []}
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, arguments={"x-single-active-consumer": True})
        first, second = conn.channel(), conn.channel()

        def taker(name: str) -> Any:
            def on_message(c: Any, m: Any, _p: Any, body: bytes) -> None:
                got[name].append(body)
                c.basic_ack(m.delivery_tag)

            return on_message

        for name, channel in (("first", first), ("second", second)):
            channel.basic_consume(queue, taker(name), consumer_tag=name)
        for i in range(4):
            ch.basic_publish("", queue, f"a{i}".encode())
        deadline = time.monotonic() + WAIT_S
        while len(got["first"]) + len(got["second"]) < 4:
            assert time.monotonic() < deadline, got
            conn.process_data_events(time_limit=0.05)
        assert got == {"first": [b"a0", b"a1", b"a2", b"a3"], "second": []}
        first.basic_cancel("first")
        for i in range(3):
            ch.basic_publish("", queue, f"b{i}".encode())
        while len(got["second"]) < 3:
            assert time.monotonic() < deadline, got
            conn.process_data_events(time_limit=0.05)
        # (Sorted: a long poll the cancelled consumer had open may still take one
        # message and give it back, which then comes after its successors.)
        assert sorted(got["second"]) == [b"b0", b"b1", b"b2"] and len(got["first"]) == 4
        with channel_closed(406):  # the argument is part of the queue's definition
            conn.channel().queue_declare(queue)


def test_dead_letter_routing_key_override(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        dlx, target = unique("dlxd"), unique("target")
        ch.exchange_declare(dlx, "direct")
        ch.queue_declare(target)
        ch.queue_bind(target, dlx, "to-target")
        source = unique("src")
        ch.queue_declare(
            source,
            arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "to-target"},
        )
        ch.basic_publish("", source, b"moved")
        method, _, _ = ch.basic_get(source)
        assert method is not None
        ch.basic_nack(method.delivery_tag, requeue=False)
        _, _, body = _get(ch, target)
        assert body == b"moved"


def test_max_length_drop_head(server: LiveServer) -> None:
    queue = unique("maxlen")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, arguments={"x-max-length": 3})
        for i in range(6):
            ch.basic_publish("", queue, str(i).encode())
        assert ch.queue_declare(queue, passive=True).method.message_count == 3
        got = [_get(ch, queue)[2] for _ in range(3)]
        assert got == [b"3", b"4", b"5"]


def test_max_length_reject_publish_nacks(server: LiveServer) -> None:
    queue = unique("reject")
    with connect(server) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
        ch.basic_publish("", queue, b"1")
        ch.basic_publish("", queue, b"2")
        with pytest.raises(NackError):
            ch.basic_publish("", queue, b"3")
        assert ch.queue_declare(queue, passive=True).method.message_count == 2


def test_reject_publish_dlx_nacks_and_dead_letters(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        _, dead, source = _dlx_pair(ch, **{"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
        ch.basic_publish("", source, b"kept")
        with pytest.raises(NackError):
            ch.basic_publish("", source, b"over")
        _, props, body = _get(ch, dead)
        assert body == b"over" and props.headers["x-death"][0]["reason"] == "maxlen"
        assert props.headers["x-death"][0]["queue"] == source
        assert ch.queue_declare(source, passive=True).method.message_count == 1
        assert ch.basic_get(source, auto_ack=True)[2] == b"kept"


def test_priorities_deliver_highest_first(server: LiveServer) -> None:
    queue = unique("prio")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, arguments={"x-max-priority": 5})
        for priority in (1, 5, 0, 3, 5, 9):
            ch.basic_publish(
                "", queue, str(priority).encode(), pika.BasicProperties(priority=priority)
            )
        got = [_get(ch, queue)[2] for _ in range(6)]
        assert got == [b"5", b"5", b"9", b"3", b"1", b"0"]  # 9 is capped to 5: FIFO there


def test_rpc_with_direct_reply_to(server: LiveServer) -> None:
    service = unique("rpc")
    with connect(server) as server_conn, connect(server) as client_conn:
        sch = server_conn.channel()
        sch.queue_declare(service)
        cch = client_conn.channel()
        replies: list[tuple[pika.BasicProperties, bytes]] = []
        cch.basic_consume(
            "amq.rabbitmq.reply-to", lambda c, m, p, b: replies.append((p, b)), auto_ack=True
        )
        cch.basic_publish(
            "",
            service,
            b"2+2",
            pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id="c1"),
        )
        [(_, props, _)] = drain(server_conn, sch, service, 1)
        assert props.reply_to.startswith("amq.rabbitmq.reply-to.")
        sch.basic_publish(
            "", props.reply_to, b"4", pika.BasicProperties(correlation_id=props.correlation_id)
        )
        deadline = time.monotonic() + WAIT_S
        while not replies and time.monotonic() < deadline:
            client_conn.process_data_events(time_limit=0.1)
        [(reply_props, reply)] = replies
        assert reply == b"4" and reply_props.correlation_id == "c1"


def test_reply_to_needs_a_reply_consumer(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        with channel_closed(406):
            ch.basic_publish("", "x", b"", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
            ch.queue_declare(unique("sync"))


def test_x_expires_deletes_an_unused_queue(server: LiveServer) -> None:
    queue = unique("expires")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, arguments={"x-expires": 200})
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                ch.queue_declare(queue, passive=True)
            except ChannelClosedByBroker as e:
                assert e.reply_code == 404
                break
            assert time.monotonic() < deadline, "queue did not expire"
            conn.sleep(0.05)


def test_durable_queues_and_messages_survive_restart(tmp_path: Path) -> None:
    queue, exchange = unique("durable"), unique("dex")
    with start(tmp_path) as live, connect(live) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare(exchange, "topic", durable=True)
        ch.queue_declare(queue, durable=True)
        ch.queue_bind(queue, exchange, "k.#")
        ch.queue_declare("transient-" + queue, durable=False)
        for i in range(3):
            ch.basic_publish(
                exchange, "k.x", str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
        method, _, _ = ch.basic_get(queue)
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    with start(tmp_path) as live, connect(live) as conn:
        ch = conn.channel()
        assert ch.queue_declare(queue, durable=True, passive=True).method.message_count == 2
        ch.basic_publish(exchange, "k.y", b"after")  # the binding survived too
        got = [_get(ch, queue)[2] for _ in range(3)]
        assert got == [b"1", b"2", b"after"]
        with channel_closed(404):
            ch.queue_declare("transient-" + queue, passive=True)


def test_heartbeats_are_negotiated_and_sent(server: LiveServer) -> None:
    with connect(server, heartbeat=1) as conn:
        ch = conn.channel()
        assert conn._impl.params.heartbeat == 1
        conn.sleep(3)  # past the two-interval limit: both sides kept the link alive
        ch.queue_declare(unique("alive"))
        assert conn.is_open


def test_stream_queue_is_read_by_offset(server: LiveServer) -> None:
    stream = unique("stream")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
        for i in range(5):
            ch.basic_publish("", stream, str(i).encode())
        ch.basic_qos(prefetch_count=10)

        def read(offset: object, count: int) -> list[tuple[bytes, int]]:
            got: list[tuple[bytes, int]] = []
            for method, props, body in ch.consume(
                stream, arguments={"x-stream-offset": offset}, inactivity_timeout=WAIT_S
            ):
                assert method is not None
                got.append((body, props.headers["x-stream-offset"]))
                ch.basic_ack(method.delivery_tag)
                if len(got) == count:
                    break
            ch.cancel()
            return got

        assert read("first", 5) == [(str(i).encode(), i) for i in range(5)]
        assert read(3, 2) == [(b"3", 3), (b"4", 4)]
        assert read("first", 5)[0] == (b"0", 0)  # acks removed nothing
        with channel_closed(406):
            ch.basic_get(stream)
