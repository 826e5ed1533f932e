"""pika's BlockingConnection drives the core flows: work queues, routing, returns,
confirms, nack/requeue, get, qos, purge, delete, tx and properties."""

from __future__ import annotations

import datetime
import decimal

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, UnroutableError

from tests.amqp.conftest import channel_closed, connect, drain, unique, wait_for
from tests.live_server import LiveServer


def test_work_queue_with_acks_and_prefetch(server: LiveServer) -> None:
    queue = unique("work")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        for i in range(20):
            ch.basic_publish("", queue, f"job-{i}".encode())
        ch.basic_qos(prefetch_count=5)
        got = drain(conn, ch, queue, 20)
        assert [body for _, _, body in got] == [f"job-{i}".encode() for i in range(20)]
        assert ch.queue_declare(queue, passive=True).method.message_count == 0


def test_prefetch_bounds_unacked_deliveries(server: LiveServer) -> None:
    queue = unique("prefetch")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for i in range(10):
            ch.basic_publish("", queue, str(i).encode())
        ch.basic_qos(prefetch_count=3)
        seen: list[int] = []
        ch.basic_consume(queue, lambda c, m, p, b: seen.append(m.delivery_tag))
        conn.process_data_events(time_limit=1.0)
        assert seen == [1, 2, 3]  # no ack: the fourth waits
        ch.basic_ack(3, multiple=True)
        deadline = 50
        while len(seen) < 6 and deadline:
            conn.process_data_events(time_limit=0.2)
            deadline -= 1
        assert seen == [1, 2, 3, 4, 5, 6]


def test_properties_round_trip(server: LiveServer) -> None:
    queue = unique("props")
    stamp = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    headers = {
        "str": "text",
        "int": 42,
        "neg": -7,
        "big": 1 << 40,
        "bool": True,
        "dec": decimal.Decimal("3.14"),
        "when": stamp,
        "table": {"nested": "yes", "n": 1},
        "array": [1, "two", {"three": 3}],
        "void": None,
        "bytes": b"\x00\xff",
    }
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="gzip",
        headers=headers,
        delivery_mode=2,
        priority=3,
        correlation_id="corr-1",
        reply_to="replies",
        expiration="600000",
        message_id="msg-1",
        timestamp=1700000000,
        type="kind",
        user_id="guest",
        app_id="tests",
    )
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"payload", props)
        method, got, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None and body == b"payload"
        for name in (
            "content_type",
            "content_encoding",
            "delivery_mode",
            "priority",
            "correlation_id",
            "reply_to",
            "expiration",
            "message_id",
            "timestamp",
            "type",
            "user_id",
            "app_id",
        ):
            assert getattr(got, name) == getattr(props, name), name
        assert got.headers["str"] == "text"
        assert got.headers["int"] == 42 and got.headers["big"] == 1 << 40
        assert got.headers["bool"] is True
        assert got.headers["dec"] == decimal.Decimal("3.14")
        assert got.headers["when"] == stamp
        assert got.headers["table"] == {"nested": "yes", "n": 1}
        assert got.headers["array"] == [1, "two", {"three": 3}]
        assert got.headers["void"] is None
        assert got.headers["bytes"] == b"\x00\xff"


def test_large_body_is_split_and_joined_at_frame_max(server: LiveServer) -> None:
    queue = unique("large")
    body = bytes(range(256)) * 4096  # 1 MiB, far above frame_max
    with connect(server, frame_max=8192) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, body)
        method, _, got = ch.basic_get(queue, auto_ack=True)
        assert method is not None and got == body


def test_fanout_topic_direct_and_headers_routing(server: LiveServer) -> None:
    fan, top, hdr, direct = (unique(k) for k in ("fan", "top", "hdr", "dir"))
    with connect(server) as conn:
        ch = conn.channel()
        ch.exchange_declare(fan, "fanout")
        ch.exchange_declare(top, "topic")
        ch.exchange_declare(hdr, "headers")
        ch.exchange_declare(direct, "direct")
        queues = {name: unique(name) for name in ("f1", "f2", "t1", "t2", "h_all", "h_any", "d")}
        for q in queues.values():
            ch.queue_declare(q)
        ch.queue_bind(queues["f1"], fan)
        ch.queue_bind(queues["f2"], fan)
        ch.queue_bind(queues["t1"], top, "stock.*.nyse")
        ch.queue_bind(queues["t2"], top, "stock.#")
        ch.queue_bind(queues["h_all"], hdr, arguments={"x-match": "all", "a": "1", "b": "2"})
        ch.queue_bind(queues["h_any"], hdr, arguments={"x-match": "any", "a": "1", "c": "3"})
        ch.queue_bind(queues["d"], direct, "key")
        ch.basic_publish(fan, "ignored", b"fan")
        ch.basic_publish(top, "stock.ibm.nyse", b"t-both")
        ch.basic_publish(top, "stock.ibm.lse.x", b"t-hash")
        ch.basic_publish(hdr, "", b"h-ab", pika.BasicProperties(headers={"a": "1", "b": "2"}))
        ch.basic_publish(hdr, "", b"h-c", pika.BasicProperties(headers={"c": "3"}))
        ch.basic_publish(direct, "key", b"d-yes")
        ch.basic_publish(direct, "other", b"d-no")

        def bodies(q: str) -> list[bytes]:
            out: list[bytes] = []
            while True:
                method, _, body = ch.basic_get(queues[q], auto_ack=True)
                if method is None:
                    return out
                out.append(body)

        assert bodies("f1") == [b"fan"] and bodies("f2") == [b"fan"]
        assert bodies("t1") == [b"t-both"]
        assert bodies("t2") == [b"t-both", b"t-hash"]
        assert bodies("h_all") == [b"h-ab"]
        assert bodies("h_any") == [b"h-ab", b"h-c"]
        assert bodies("d") == [b"d-yes"]


def test_exchange_to_exchange_binding(server: LiveServer) -> None:
    source, middle, queue = unique("src"), unique("mid"), unique("e2e")
    with connect(server) as conn:
        ch = conn.channel()
        ch.exchange_declare(source, "topic")
        ch.exchange_declare(middle, "fanout")
        ch.exchange_bind(middle, source, "a.#")
        ch.queue_declare(queue)
        ch.queue_bind(queue, middle)
        ch.basic_publish(source, "a.b", b"through")
        ch.basic_publish(source, "b.a", b"not")
        _method, _, body = ch.basic_get(queue, auto_ack=True)
        assert body == b"through"
        assert ch.basic_get(queue)[0] is None
        ch.exchange_unbind(middle, source, "a.#")
        ch.basic_publish(source, "a.b", b"after unbind")
        assert ch.basic_get(queue)[0] is None


def test_mandatory_unroutable_is_returned_and_confirmed(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        with pytest.raises(UnroutableError) as info:
            ch.basic_publish("", unique("nobody"), b"lost", mandatory=True)
        [returned] = info.value.messages
        assert returned.body == b"lost" and returned.method.reply_code == 312


def test_confirms_ack_each_publish(server: LiveServer) -> None:
    queue = unique("confirm")
    with connect(server) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        for i in range(50):
            ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))
        assert ch.queue_declare(queue, passive=True).method.message_count == 50


def test_nack_requeue_redelivers_with_flag(server: LiveServer) -> None:
    queue = unique("nack")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"again")
        method, _, _ = ch.basic_get(queue)
        assert method is not None and not method.redelivered
        ch.basic_nack(method.delivery_tag, requeue=True)
        method, _, body = ch.basic_get(queue)
        assert method is not None and method.redelivered and body == b"again"
        ch.basic_reject(method.delivery_tag, requeue=False)  # no DLX: dropped
        assert ch.basic_get(queue)[0] is None


def test_unacked_go_back_when_the_channel_closes(server: LiveServer) -> None:
    queue = unique("closeback")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for i in range(3):
            ch.basic_publish("", queue, str(i).encode())
        for _ in range(3):
            assert ch.basic_get(queue)[0] is not None
        ch.close()
        ch2 = conn.channel()
        got = [ch2.basic_get(queue, auto_ack=True) for _ in range(3)]
        assert [m.redelivered for m, _, _ in got] == [True, True, True]
        assert sorted(b for _, _, b in got) == [b"0", b"1", b"2"]


def test_recover_requeues_unacked(server: LiveServer) -> None:
    queue = unique("recover")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"r")
        assert ch.basic_get(queue)[0] is not None
        ch.basic_recover(requeue=True)
        method, _, _ = ch.basic_get(queue, auto_ack=True)
        assert method is not None and method.redelivered


def test_purge_and_delete_report_counts(server: LiveServer) -> None:
    queue = unique("purge")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for _ in range(4):
            ch.basic_publish("", queue, b"x")
        assert ch.queue_purge(queue).method.message_count == 4
        ch.basic_publish("", queue, b"y")
        assert ch.queue_delete(queue).method.message_count == 1
        with channel_closed(404):
            ch.queue_declare(queue, passive=True)


def test_delete_if_empty_and_if_unused(server: LiveServer) -> None:
    queue = unique("ifempty")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"x")
        with channel_closed(406):
            ch.queue_delete(queue, if_empty=True)
        ch = conn.channel()
        ch.basic_consume(queue, lambda *a: None)
        ch2 = conn.channel()
        with channel_closed(406):
            ch2.queue_delete(queue, if_unused=True)


def test_unknown_exchange_and_queue_close_only_the_channel(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        with channel_closed(404):
            ch.basic_publish(unique("nowhere"), "k", b"x")
            ch.queue_declare(unique("probe"))  # the close arrives by the next sync call
        ch = conn.channel()
        with channel_closed(404):
            ch.basic_consume(unique("missing"), lambda *a: None)
        assert conn.is_open
        ch = conn.channel()
        ch.queue_declare(unique("still-fine"))


def test_redeclare_with_other_arguments_fails(server: LiveServer) -> None:
    queue = unique("equiv")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, arguments={"x-max-length": 5})
        with channel_closed(406):
            ch.queue_declare(queue, arguments={"x-max-length": 6})
        ch = conn.channel()
        ex = unique("ex")
        ch.exchange_declare(ex, "direct")
        with channel_closed(406):
            ch.exchange_declare(ex, "fanout")


def test_server_named_queue_and_exclusive_lock(server: LiveServer) -> None:
    with connect(server) as conn, connect(server) as other:
        ch = conn.channel()
        name = ch.queue_declare("", exclusive=True).method.queue
        assert name.startswith("amq.gen-")
        och = other.channel()
        with channel_closed(405):
            och.basic_consume(name, lambda *a: None)
    with connect(server) as conn:
        ch = conn.channel()
        with pytest.raises(ChannelClosedByBroker) as info:
            ch.queue_declare(name, passive=True)
        assert info.value.reply_code == 404  # went away with its connection


def test_auto_delete_queue_goes_with_its_last_consumer(server: LiveServer) -> None:
    queue = unique("autodel")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue, auto_delete=True)
        tag = ch.basic_consume(queue, lambda *a: None)
        ch.basic_cancel(tag)
        with channel_closed(404):
            ch.queue_declare(queue, passive=True)


def test_tx_commit_and_rollback(server: LiveServer) -> None:
    queue = unique("tx")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.tx_select()
        ch.basic_publish("", queue, b"rolled back")
        ch.tx_rollback()
        ch.basic_publish("", queue, b"committed")
        assert ch.queue_declare(queue, passive=True).method.message_count == 0
        ch.tx_commit()
        _method, _, body = ch.basic_get(queue, auto_ack=True)
        assert body == b"committed"
        assert ch.basic_get(queue)[0] is None


def test_many_channels_on_one_connection(server: LiveServer) -> None:
    queue = unique("many")
    with connect(server) as conn:
        channels = [conn.channel() for _ in range(20)]
        channels[0].queue_declare(queue)
        for i, ch in enumerate(channels):
            ch.basic_publish("", queue, str(i).encode())
        assert channels[-1].queue_declare(queue, passive=True).method.message_count == 20


def test_consumer_is_told_when_its_queue_is_deleted(server: LiveServer) -> None:
    queue = unique("cancelnotify")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        cancelled: list[object] = []
        ch.basic_consume(queue, lambda *a: None)
        ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
        other = conn.channel()
        other.queue_delete(queue)
        conn.process_data_events(time_limit=0.5)
        assert cancelled


def test_publishes_before_close_are_kept(server: LiveServer) -> None:
    queue = unique("beforeclose")
    with connect(server) as conn:
        conn.channel().queue_declare(queue)
    with connect(server) as conn:
        ch = conn.channel()
        for i in range(300):
            ch.basic_publish("", queue, str(i).encode())
    # No confirms: the close came right behind the publishes, and none is lost.
    with connect(server) as conn:
        assert conn.channel().queue_declare(queue, passive=True).method.message_count == 300


def _waiting_pops(server: LiveServer, queue: str) -> int:
    """Long polls open in storage on the queue's topic."""

    async def count() -> int:
        return sum(
            len(index.waiters or ())
            for engine in server.engines
            for (_, name), topic in list(engine._state.topics.items())
            if queue in name
            for index in topic.queues
        )

    return int(server.call(count))


def test_a_cancelled_consumer_takes_nothing(server: LiveServer) -> None:
    """Cancelling a consumer ends its long poll in storage: a message published next is
    a first delivery for whoever asks, not one taken and given back (redelivered)."""
    queue = unique("cancelpoll")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        tag = ch.basic_consume(queue, lambda *a: None)
        wait_for(lambda: _waiting_pops(server, queue) > 0)
        ch.basic_cancel(tag)
        assert _waiting_pops(server, queue) == 0
        ch.basic_publish("", queue, b"fresh")
        got: list[tuple[pika.spec.Basic.GetOk, bytes]] = []

        def get() -> bool:
            method, _, body = ch.basic_get(queue)
            if method is not None:
                got.append((method, body))
            return bool(got)

        wait_for(get)
        [(method, body)] = got
        assert body == b"fresh" and not method.redelivered
