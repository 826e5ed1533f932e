"""Channel-level rules through pika: the soft errors RabbitMQ raises, qos variants,
flow, and delivery of messages other protocols produced."""

from __future__ import annotations

from typing import Any

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef
from tests.amqp.conftest import channel_closed, connect, unique
from tests.live_server import LiveServer


def test_unknown_delivery_tag_is_precondition_failed(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        ch.basic_ack(99)
        with pytest.raises(ChannelClosedByBroker) as info:
            ch.queue_declare(unique("after"))
        assert info.value.reply_code == 406
        assert "unknown delivery tag 99" in info.value.reply_text


def test_reserved_names_are_refused(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        with channel_closed(403):
            ch.exchange_declare("amq.mine", "direct")
        ch = conn.channel()
        with channel_closed(403):
            ch.exchange_delete("amq.fanout")
        ch = conn.channel()
        ch.exchange_declare("amq.topic", "topic", passive=True)  # predeclared


def test_internal_exchange_takes_no_publishes(server: LiveServer) -> None:
    internal = unique("internal")
    with connect(server) as conn:
        ch = conn.channel()
        ch.exchange_declare(internal, "fanout", internal=True)
        ch.basic_publish(internal, "", b"x")
        with channel_closed(403):
            ch.queue_declare(unique("after"))


def test_exchange_delete_if_unused_and_auto_delete(server: LiveServer) -> None:
    used, auto, queue = unique("used"), unique("auto"), unique("q")
    with connect(server) as conn:
        ch = conn.channel()
        ch.exchange_declare(used, "direct")
        ch.exchange_declare(auto, "direct", auto_delete=True)
        ch.queue_declare(queue)
        ch.queue_bind(queue, used, "k")
        ch.queue_bind(queue, auto, "k")
        with channel_closed(406):
            ch.exchange_delete(used, if_unused=True)
        ch = conn.channel()
        ch.queue_unbind(queue, auto, "k")  # its last binding: the exchange goes
        with channel_closed(404):
            ch.exchange_declare(auto, "direct", passive=True)


def test_global_qos_bounds_the_whole_channel(server: LiveServer) -> None:
    q1, q2 = unique("g1"), unique("g2")
    with connect(server) as conn:
        ch = conn.channel()
        for q in (q1, q2):
            ch.queue_declare(q)
            for i in range(5):
                ch.basic_publish("", q, str(i).encode())
        ch.basic_qos(prefetch_count=3, global_qos=True)
        seen: list[str] = []
        ch.basic_consume(q1, lambda c, m, p, b: seen.append(q1))
        ch.basic_consume(q2, lambda c, m, p, b: seen.append(q2))
        conn.process_data_events(time_limit=1.0)
        assert len(seen) == 3


def test_channel_flow_pauses_deliveries(server: LiveServer) -> None:
    queue = unique("flow")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"held")
        ch.flow(False)
        seen: list[bytes] = []
        ch.basic_consume(queue, lambda c, m, p, b: seen.append(b), auto_ack=True)
        conn.process_data_events(time_limit=0.5)
        assert seen == []
        ch.flow(True)
        for _ in range(50):
            conn.process_data_events(time_limit=0.1)
            if seen:
                break
        assert seen == [b"held"]


def test_message_from_another_protocol_is_delivered_with_its_fields(server: LiveServer) -> None:
    queue = unique("foreign")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        storage = server.gateway.storage
        message = Message(
            body=b"from kafka",
            key=b"k1",
            tag="t1",
            properties=(("trace", b"abc"), ("raw", b"\xff\x00")),
            content_type="text/plain",
            correlation_id=b"corr",
            reply_to="answers",
        )
        ref = QueueRef(DEFAULT_NAMESPACE, "amqp:" + queue, 0)
        server.call(lambda: storage.append([AppendRequest(entry=message, queues=(ref,))]))
        method, props, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None and body == b"from kafka"
        assert method.routing_key == "amqp:" + queue and method.exchange == ""
        assert props.content_type == "text/plain"
        assert props.correlation_id == "corr" and props.reply_to == "answers"
        assert props.headers == {
            "trace": "abc",
            "raw": b"\xff\x00",
            "polymq.key": "k1",
            "polymq.tag": "t1",
        }


def test_published_message_carries_model_fields(server: LiveServer) -> None:
    queue = unique("model")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.confirm_delivery()
        ch.basic_publish(
            "",
            queue,
            b"b",
            pika.BasicProperties(
                content_type="application/json", correlation_id="c", headers={"h": "v", "n": 2}
            ),
        )
        ref = QueueRef(DEFAULT_NAMESPACE, "amqp:" + queue, 0)
        storage = server.gateway.storage
        [stored] = server.call(lambda: storage.read(ref, 0)).messages
        message = stored.message
        assert message.content_type == "application/json"
        assert message.correlation_id == b"c" and message.key == queue.encode()
        assert message.property("amqp.routing-key") == queue.encode()
        assert message.property("h") == b"v" and message.property("n") == b"2"


def test_queue_that_never_drains_is_trimmed_to_its_acked_prefix(server: LiveServer) -> None:
    queue = unique("trim-busy")
    ref = QueueRef(DEFAULT_NAMESPACE, "amqp:" + queue, 0)
    storage = server.gateway.storage
    listener: Any = server.gateway.listeners.get("amqp")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for i in range(6):
            ch.basic_publish("", queue, str(i).encode())
        vhost = server.call(lambda: listener._services.get(conn_caller()))

        def trim_and_earliest() -> int:
            ch.queue_declare(queue, passive=True)  # a round trip: earlier acks are settled
            server.call(lambda: vhost.trim_consumed(conn_caller()))
            return server.call(lambda: storage.queue_offsets(ref)).earliest

        first, _, _ = ch.basic_get(queue)  # offset 0 held unacked
        assert first is not None
        for _ in range(2):  # offsets 1 and 2 acked behind it
            assert ch.basic_get(queue, auto_ack=True)[0] is not None
        assert trim_and_earliest() == 0  # the acked prefix is still empty
        ch.basic_ack(first.delivery_tag)
        assert trim_and_earliest() == 3  # 0..2 acked; 3..5 still wait
        assert ch.basic_get(queue, auto_ack=True)[2] == b"3"
        assert trim_and_earliest() == 4
        ch.basic_publish("", queue, b"6")
        bodies = [ch.basic_get(queue, auto_ack=True)[2] for _ in range(3)]
        assert bodies == [b"4", b"5", b"6"]
        assert trim_and_earliest() == 7  # drained: trimmed to its end
        ch.basic_publish("", queue, b"after")
        assert ch.basic_get(queue, auto_ack=True)[2] == b"after"


def conn_caller() -> Caller:
    return Caller(principal=ANONYMOUS, namespace=DEFAULT_NAMESPACE, protocol="amqp")


def test_unacked_delivery_lease_is_renewed(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases shortened to 0.6 s, renewed every 0.1 s: a delivery held for several
    lease lengths stays with its channel, and its ack (with the renewed receipt) works."""
    from polymq.protocols.amqp import channel as channel_module

    monkeypatch.setattr(channel_module, "INVISIBLE_MS", 600)
    monkeypatch.setattr(channel_module, "_RENEW_EVERY_S", 0.1)
    queue = unique("lease")
    with connect(server) as conn, connect(server) as other:
        ch = conn.channel()  # its renewal timer starts with the patched period
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"held")
        method, _, _ = ch.basic_get(queue)
        assert method is not None
        conn.sleep(2.0)  # more than three lease lengths
        assert other.channel().basic_get(queue)[0] is None  # still leased to `ch`
        ch.basic_ack(method.delivery_tag)
        ch.queue_declare(queue, passive=True)  # a round trip: the ack is settled
        conn.sleep(1.0)  # past any lease: an ack that failed would show it again
        assert other.channel().basic_get(queue)[0] is None
