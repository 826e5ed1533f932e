"""AMQP 0-9-1 with RabbitMQ's extensions, judged by the 0-9-1 specification and
RabbitMQ's documented behaviour (its extensions are the de-facto standard: confirms,
DLX with ``x-death``, TTL, max-length, priorities, exchange-to-exchange bindings)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from polymq.conformance.runner import NotApplicable, Registry, Target, wait_until

registry = Registry("amqp")
case = registry.case
_TIMEOUT_S = 10.0


def _params(t: Target, password: str | None = None) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        host=t.host,
        port=t.port("amqp"),
        virtual_host=t.vhost,
        credentials=pika.PlainCredentials(t.user or "guest", password or t.password or "guest"),
        connection_attempts=1,
        socket_timeout=5,
        blocked_connection_timeout=10,
        heartbeat=30,
    )


@contextmanager
def _channel(t: Target) -> Iterator[BlockingChannel]:
    connection = pika.BlockingConnection(_params(t))
    try:
        yield connection.channel()
    finally:
        if connection.is_open:
            connection.close()


@contextmanager
def _closes_channel(reply_code: int, otherwise: str) -> Iterator[None]:
    """The block must end with the broker closing the channel with ``reply_code``;
    if it ends normally, the case fails with ``otherwise``."""
    try:
        yield
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == reply_code, e
        return
    raise AssertionError(otherwise)


@contextmanager
def _queue(t: Target, prefix: str, **arguments: Any) -> Iterator[tuple[BlockingChannel, str]]:
    """A fresh queue, deleted afterwards (from a fresh channel, in case the case's own
    channel was closed by the broker)."""
    name = t.name(prefix)
    with _channel(t) as ch:
        ch.queue_declare(name, arguments=arguments or None)
        try:
            yield ch, name
        finally:
            with _channel(t) as cleanup:
                cleanup.queue_delete(name)


def _get_message(ch: BlockingChannel, queue: str, timeout: float = 5.0) -> tuple[Any, bytes]:
    """basic.get (auto-ack) until a message comes: its properties and body."""

    def fetch() -> tuple[Any, bytes] | None:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        return (props, body) if method is not None else None

    return wait_until(fetch, timeout, f"a message in {queue}")


def _get_body(ch: BlockingChannel, queue: str, timeout: float = 5.0) -> bytes:
    """basic.get until a message comes (publishes are asynchronous without confirms)."""

    def fetch() -> bytes | None:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        return body if method is not None else None

    return wait_until(fetch, timeout, f"a message in {queue}")


def _recv_exactly(sock: Any, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"connection closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def _confirmed(ch: BlockingChannel) -> BlockingChannel:
    ch.confirm_delivery()
    return ch


@case("connect", "pika")
def connect(t: Target) -> None:
    """Handshake, tune and channel open; the server announces RabbitMQ's capabilities."""
    connection = pika.BlockingConnection(_params(t))
    try:
        caps = connection._impl.server_capabilities
        for cap in ("publisher_confirms", "basic.nack", "exchange_exchange_bindings"):
            assert caps.get(cap) is True, f"capability {cap} not announced: {caps}"
        assert connection.channel().is_open
    finally:
        connection.close()


@case("auth-refused", "pika")
def auth_refused(t: Target) -> None:
    """A wrong password is refused with ACCESS_REFUSED (403), not a hang."""
    if not t.auth_enforced:
        raise NotApplicable("the target does not check credentials")
    try:
        pika.BlockingConnection(_params(t, password="wrong-" + t.run_id)).close()
    except pika.exceptions.ProbableAuthenticationError:
        return
    except pika.exceptions.ProbableAccessDeniedError:
        return
    raise AssertionError("a wrong password was accepted")


@case("publish-get-properties", "pika")
def publish_get_properties(t: Target) -> None:
    """Every basic property and header type comes back as published."""
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={"s": "text", "i": 42, "b": True, "n": {"x": 1}, "l": [1, "a"]},
        delivery_mode=2,
        priority=3,
        correlation_id="corr-1",
        reply_to="replies",
        expiration="60000",
        message_id="mid-1",
        timestamp=1_700_000_000,
        type="kind",
        user_id=None,
        app_id="conformance",
    )
    with _queue(t, "props") as (ch, q):
        _confirmed(ch).basic_publish("", q, b'{"a":1}', props)
        method, got, body = ch.basic_get(q, auto_ack=True)
        assert method is not None, "no message"
        assert body == b'{"a":1}'
        for field in (
            "content_type",
            "content_encoding",
            "headers",
            "delivery_mode",
            "priority",
            "correlation_id",
            "reply_to",
            "message_id",
            "timestamp",
            "type",
            "app_id",
        ):
            assert getattr(got, field) == getattr(props, field), (
                f"{field}: {getattr(got, field)!r} != {getattr(props, field)!r}"
            )


@case("consume-ack", "pika")
def consume_ack(t: Target) -> None:
    """basic.consume delivers in order; acked messages are gone from the queue."""
    with _queue(t, "consume") as (ch, q):
        _confirmed(ch)
        for i in range(5):
            ch.basic_publish("", q, str(i).encode())
        got: list[bytes] = []
        for method, _, body in ch.consume(q, inactivity_timeout=5):
            assert method is not None, f"only {got} arrived"
            got.append(body)
            ch.basic_ack(method.delivery_tag)
            if len(got) == 5:
                break
        ch.cancel()
        assert got == [str(i).encode() for i in range(5)], got
        assert ch.queue_declare(q, passive=True).method.message_count == 0


@case("nack-requeue", "pika")
def nack_requeue(t: Target) -> None:
    """A nacked (requeued) message comes back with redelivered set."""
    with _queue(t, "nack") as (ch, q):
        _confirmed(ch).basic_publish("", q, b"again")
        first, _, _ = ch.basic_get(q)
        assert first is not None and not first.redelivered
        ch.basic_nack(first.delivery_tag, requeue=True)
        second, _, body = ch.basic_get(q)
        assert second is not None, "the nacked message did not come back"
        assert body == b"again" and second.redelivered, "redelivered flag not set"
        ch.basic_ack(second.delivery_tag)


@case("redelivery-on-close", "pika")
def redelivery_on_close(t: Target) -> None:
    """Unacked deliveries go back to the queue when their channel closes."""
    with _queue(t, "unacked") as (ch, q):
        _confirmed(ch).basic_publish("", q, b"held")
        with _channel(t) as other:
            method, _, _ = other.basic_get(q)
            assert method is not None

        # the connection holding the delivery is closed now
        def back() -> Any:
            method, _, _ = ch.basic_get(q)
            return method

        method = wait_until(back, 5, "the unacked message back in the queue")
        assert method.redelivered, "redelivered flag not set"
        ch.basic_ack(method.delivery_tag)


@case("publisher-confirms", "pika")
def publisher_confirms(t: Target) -> None:
    """confirm.select; a routed publish is acked, a mandatory unroutable one returned."""
    with _channel(t) as ch:
        _confirmed(ch)
        ch.basic_publish("amq.direct", t.name("nowhere"), b"x")  # acked, dropped
        try:
            ch.basic_publish("amq.direct", t.name("nowhere"), b"x", mandatory=True)
        except pika.exceptions.UnroutableError:
            return
        raise AssertionError("a mandatory unroutable publish was not returned")


def _bound(ch: BlockingChannel, t: Target, exchange: str, **bind: Any) -> str:
    q = ch.queue_declare(t.name("bound"), exclusive=True).method.queue
    ch.queue_bind(q, exchange, **bind)
    return str(q)


def _count(ch: BlockingChannel, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


def _routing_case(
    t: Target, kind: str, binds: list[dict[str, Any]], publish: dict[str, Any]
) -> list[int]:
    """Declare a ``kind`` exchange, one exclusive queue per binding, publish once with
    confirms; the number of messages each queue got."""
    ex = t.name(kind)
    with _channel(t) as ch:
        _confirmed(ch)
        ch.exchange_declare(ex, kind, auto_delete=False)
        try:
            queues = [_bound(ch, t, ex, **b) for b in binds]
            ch.basic_publish(ex, publish.get("routing_key", ""), b"m", publish.get("properties"))
            return [_count(ch, q) for q in queues]
        finally:
            ch.exchange_delete(ex)


@case("exchange-direct", "pika")
def exchange_direct(t: Target) -> None:
    """direct: exact routing-key match only."""
    got = _routing_case(
        t, "direct", [{"routing_key": "a"}, {"routing_key": "b"}], {"routing_key": "a"}
    )
    assert got == [1, 0], got


@case("exchange-fanout", "pika")
def exchange_fanout(t: Target) -> None:
    """fanout: every bound queue, whatever the key."""
    got = _routing_case(
        t, "fanout", [{"routing_key": "a"}, {"routing_key": "b"}], {"routing_key": "z"}
    )
    assert got == [1, 1], got


@case("exchange-topic", "pika")
def exchange_topic(t: Target) -> None:
    """topic: ``*`` is one word, ``#`` zero or more."""
    binds = [{"routing_key": k} for k in ("a.*.c", "a.#", "*.b", "#", "a.b.c.d")]
    got = _routing_case(t, "topic", binds, {"routing_key": "a.b.c"})
    assert got == [1, 1, 0, 1, 0], got


@case("exchange-headers", "pika")
def exchange_headers(t: Target) -> None:
    """headers: x-match all and any."""
    binds = [
        {"arguments": {"x-match": "all", "k": "v", "n": 1}},
        {"arguments": {"x-match": "any", "k": "other", "n": 1}},
        {"arguments": {"x-match": "all", "k": "v", "missing": 1}},
    ]
    props = pika.BasicProperties(headers={"k": "v", "n": 1})
    got = _routing_case(t, "headers", binds, {"properties": props})
    assert got == [1, 1, 0], got


@case("exchange-to-exchange", "pika")
def exchange_to_exchange(t: Target) -> None:
    """exchange.bind: a message routes through a bound exchange to its queue."""
    src, dst = t.name("e2e-src"), t.name("e2e-dst")
    with _channel(t) as ch:
        _confirmed(ch)
        ch.exchange_declare(src, "topic")
        ch.exchange_declare(dst, "fanout")
        try:
            ch.exchange_bind(dst, src, routing_key="x.#")
            q = _bound(ch, t, dst)
            ch.basic_publish(src, "x.y", b"m")
            ch.basic_publish(src, "other", b"m")
            assert _count(ch, q) == 1
        finally:
            ch.exchange_delete(src)
            ch.exchange_delete(dst)


@case("queue-ttl", "pika")
def queue_ttl(t: Target) -> None:
    """x-message-ttl: messages older than the TTL are dropped even with no consumer."""
    with _queue(t, "ttl", **{"x-message-ttl": 200}) as (ch, q):
        _confirmed(ch).basic_publish("", q, b"short-lived")
        wait_until(lambda: _count(ch, q) == 0, 10, "the expired message dropped")
        assert ch.basic_get(q)[0] is None


@case("message-ttl", "pika")
def message_ttl(t: Target) -> None:
    """Per-message expiration: only the expired message is dropped."""
    with _queue(t, "msgttl") as (ch, q):
        _confirmed(ch)
        ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="200"))
        ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="60000"))
        wait_until(lambda: _count(ch, q) == 1, 10, "the expired message dropped")
        assert _get_body(ch, q) == b"long"


@case("dead-letter", "pika")
def dead_letter(t: Target) -> None:
    """A rejected message goes to the DLX with an x-death entry naming the reason."""
    with _queue(t, "dlq") as (ch, dlq):
        args = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
        with _queue(t, "dlsrc", **args) as (_, src):
            _confirmed(ch).basic_publish("", src, b"doomed")
            method, _, _ = ch.basic_get(src)
            assert method is not None
            ch.basic_reject(method.delivery_tag, requeue=False)
            props, body = _get_message(ch, dlq)
        assert body == b"doomed"
        death = (props.headers or {}).get("x-death")
        assert death, f"no x-death header: {props.headers}"
        entry = death[0]
        assert entry.get("reason") == "rejected", entry
        assert entry.get("queue") == src and entry.get("count") == 1, entry


@case("max-length", "pika")
def max_length(t: Target) -> None:
    """x-max-length with the default overflow drops from the head."""
    with _queue(t, "maxlen", **{"x-max-length": 2}) as (ch, q):
        _confirmed(ch)
        for body in (b"1", b"2", b"3"):
            ch.basic_publish("", q, body)
        assert _count(ch, q) == 2
        assert [_get_body(ch, q), _get_body(ch, q)] == [b"2", b"3"]


@case("priority", "pika")
def priority(t: Target) -> None:
    """x-max-priority: a higher priority message is delivered first."""
    with _queue(t, "prio", **{"x-max-priority": 5}) as (ch, q):
        _confirmed(ch)
        ch.basic_publish("", q, b"low", pika.BasicProperties(priority=1))
        ch.basic_publish("", q, b"high", pika.BasicProperties(priority=5))
        assert [_get_body(ch, q), _get_body(ch, q)] == [b"high", b"low"]


@case("transactions", "pika")
def transactions(t: Target) -> None:
    """tx.select: a rolled-back publish never arrives, a committed one does."""
    with _queue(t, "tx") as (ch, q):
        ch.tx_select()
        ch.basic_publish("", q, b"rolled-back")
        ch.tx_rollback()
        ch.basic_publish("", q, b"committed")
        ch.tx_commit()
        assert _count(ch, q) == 1
        assert _get_body(ch, q) == b"committed"


@case("prefetch", "pika")
def prefetch(t: Target) -> None:
    """basic.qos prefetch_count bounds unacked deliveries to a consumer."""
    with _queue(t, "qos") as (ch, q):
        _confirmed(ch)
        for i in range(5):
            ch.basic_publish("", q, str(i).encode())
        ch.basic_qos(prefetch_count=2)
        held: list[int] = []
        ch.basic_consume(q, lambda c, m, p, b: held.append(m.delivery_tag))
        wait_until(lambda: (ch.connection.process_data_events(0.05), len(held) >= 2)[1], 5)
        ch.connection.process_data_events(0.5)  # room for a wrongly sent third
        assert len(held) == 2, f"{len(held)} unacked deliveries with prefetch 2"
        ch.basic_ack(held[-1], multiple=True)
        wait_until(lambda: (ch.connection.process_data_events(0.05), len(held) >= 4)[1], 5)


@case("passive-declare-missing", "pika")
def passive_missing(t: Target) -> None:
    """A passive declare of a missing queue closes the channel with 404 NOT_FOUND."""
    with _channel(t) as ch, _closes_channel(404, "passive declare of a missing queue succeeded"):
        ch.queue_declare(t.name("absent"), passive=True)


@case("exclusive-queue", "pika")
def exclusive_queue(t: Target) -> None:
    """An exclusive queue is locked to its connection: others get 405 RESOURCE_LOCKED."""
    with _channel(t) as owner:
        q = owner.queue_declare(t.name("excl"), exclusive=True).method.queue
        refused = _closes_channel(405, "another connection could consume an exclusive queue")
        with _channel(t) as other, refused:
            other.basic_consume(q, lambda *a: None)


@case("publish-consume", "aio-pika")
async def aio_pika_roundtrip(t: Target) -> None:
    """aio-pika (asyncio): declare, publish with confirms, consume and ack."""
    import aio_pika

    url = f"amqp://{t.user or 'guest'}:{t.password or 'guest'}@{t.host}:{t.port('amqp')}/"
    connection = await aio_pika.connect(url if t.vhost == "/" else url + t.vhost, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(t.name("aio"), auto_delete=False)
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"hello", headers={"h": "v"}), routing_key=queue.name
            )
            async with queue.iterator() as messages:
                async for message in messages:
                    async with message.process():
                        assert message.body == b"hello" and message.headers == {"h": "v"}
                    break
        finally:
            await queue.delete(if_unused=False, if_empty=False)


@case("publish-consume", "amqplib")
def amqplib_roundtrip(t: Target) -> None:
    """amqplib (node): confirm channel, properties and headers, nack with requeue comes
    back redelivered, ack."""
    from urllib.parse import quote

    from polymq.conformance.cases._node import run_node

    user, password = quote(t.user or "guest", safe=""), quote(t.password or "guest", safe="")
    vhost = "" if t.vhost == "/" else quote(t.vhost, safe="")
    url = f"amqp://{user}:{password}@{t.host}:{t.port('amqp')}/{vhost}"
    seen = run_node("conformance_amqp.js", url, t.name("node"))["seen"]
    assert [(s["body"], s["redelivered"]) for s in seen] == [("hello", False), ("hello", True)]
    assert seen[1]["contentType"] == "text/plain" and seen[1]["correlationId"] == "c1"
    assert seen[1]["headers"] == {"n": 7, "s": "x"}, seen[1]["headers"]


@case("alternate-exchange", "pika")
def alternate_exchange(t: Target) -> None:
    """alternate-exchange: a message the exchange cannot route goes to its alternate."""
    main, alt = t.name("ae-main"), t.name("ae-alt")
    with _channel(t) as ch:
        _confirmed(ch)
        ch.exchange_declare(alt, "fanout")
        ch.exchange_declare(main, "direct", arguments={"alternate-exchange": alt})
        try:
            routed, spilled = _bound(ch, t, main, routing_key="known"), _bound(ch, t, alt)
            ch.basic_publish(main, "known", b"m")
            ch.basic_publish(main, "unknown", b"m", mandatory=True)  # routed by the AE
            assert (_count(ch, routed), _count(ch, spilled)) == (1, 1)
        finally:
            ch.exchange_delete(main)
            ch.exchange_delete(alt)


@case("overflow-reject-publish", "pika")
def overflow_reject_publish(t: Target) -> None:
    """x-overflow reject-publish: a publish to a full queue is nacked under confirms."""
    with _queue(t, "full", **{"x-max-length": 1, "x-overflow": "reject-publish"}) as (ch, q):
        _confirmed(ch).basic_publish("", q, b"fits")
        try:
            ch.basic_publish("", q, b"overflows")
        except pika.exceptions.NackError:
            assert _count(ch, q) == 1
            return
        raise AssertionError("a publish to a full reject-publish queue was confirmed")


@case("dead-letter-expired", "pika")
def dead_letter_expired(t: Target) -> None:
    """An expired message is dead-lettered with reason ``expired``."""
    with _queue(t, "dlq") as (ch, dlq):
        args = {
            "x-message-ttl": 100,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq,
        }
        with _queue(t, "expiring", **args) as (_, src):
            _confirmed(ch).basic_publish("", src, b"stale")

            props, _ = _get_message(ch, dlq, 10)
            entry = (props.headers or {}).get("x-death", [{}])[0]
            assert entry.get("reason") == "expired" and entry.get("queue") == src, entry


@case("single-active-consumer", "pika")
def single_active_consumer(t: Target) -> None:
    """x-single-active-consumer: only one consumer gets deliveries; the next takes over
    when it is cancelled."""
    with _queue(t, "sac", **{"x-single-active-consumer": True}) as (ch, q):
        _confirmed(ch)
        got: dict[str, list[bytes]] = {"a": [], "b": []}

        def consumer(name: str) -> Any:
            def on_message(c: Any, m: Any, p: Any, body: bytes) -> None:
                got[name].append(body)
                c.basic_ack(m.delivery_tag)

            return on_message

        tag_a = ch.basic_consume(q, consumer("a"))
        ch.basic_consume(q, consumer("b"))
        for i in range(4):
            ch.basic_publish("", q, f"m{i}".encode())

        def delivered(n: int) -> bool:
            ch.connection.process_data_events(0.05)
            return len(got["a"]) + len(got["b"]) >= n

        wait_until(lambda: delivered(4), 10, "4 deliveries")
        assert got == {"a": [b"m0", b"m1", b"m2", b"m3"], "b": []}, got
        ch.basic_cancel(tag_a)
        ch.basic_publish("", q, b"after")
        wait_until(lambda: delivered(5), 10, "the delivery after the cancel")
        assert got["b"] == [b"after"], got


@case("direct-reply-to", "pika")
def direct_reply_to(t: Target) -> None:
    """amq.rabbitmq.reply-to: an RPC reply reaches the requester without a queue."""
    with _queue(t, "rpc") as (server, q), _channel(t) as client:
        replies: list[bytes] = []
        client.basic_consume(
            "amq.rabbitmq.reply-to", lambda c, m, p, b: replies.append(b), auto_ack=True
        )
        client.basic_publish("", q, b"ping", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
        props, _ = _get_message(server, q)
        assert props.reply_to.startswith("amq.rabbitmq.reply-to."), props.reply_to
        server.basic_publish("", props.reply_to, b"pong")
        wait_until(lambda: (client.connection.process_data_events(0.05), replies)[1], 5, "reply")
        assert replies == [b"pong"]


@case("queue-expires", "pika")
def queue_expires(t: Target) -> None:
    """x-expires: an unused queue is deleted after the given idle time. A passive
    declare counts as a use (it renews the lease in RabbitMQ), so it is checked only
    after more than the idle time has passed each time."""
    name = t.name("expires")
    with _channel(t) as ch:
        ch.queue_declare(name, arguments={"x-expires": 200})
    deadline = time.monotonic() + 10
    while True:
        time.sleep(0.5)  # longer than x-expires: the feature is the passing of time
        with _channel(t) as probe:
            try:
                probe.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as e:
                assert e.reply_code == 404, e
                return
        assert time.monotonic() < deadline, "the idle queue was not deleted within 10s"


@case("reserved-names", "pika")
def reserved_names(t: Target) -> None:
    """Declaring an exchange named ``amq.*`` is refused with 403 ACCESS_REFUSED."""
    with _channel(t) as ch, _closes_channel(403, "an amq.* exchange was declared"):
        ch.exchange_declare(f"amq.{t.name('mine')}", "direct")


@case("publish-missing-exchange", "pika")
def publish_missing_exchange(t: Target) -> None:
    """A publish to an exchange that does not exist closes the channel with 404."""
    with _channel(t) as ch:
        _confirmed(ch)
        with _closes_channel(404, "a publish to a missing exchange was confirmed"):
            ch.basic_publish(t.name("no-such-exchange"), "k", b"m")


@case("purge-delete", "pika")
def purge_delete(t: Target) -> None:
    """queue.purge answers the ready count removed; delete if-empty refuses a non-empty
    queue (406 PRECONDITION_FAILED)."""
    with _queue(t, "purge") as (ch, q):
        _confirmed(ch)
        for _ in range(3):
            ch.basic_publish("", q, b"m")
        assert ch.queue_purge(q).method.message_count == 3
        ch.basic_publish("", q, b"m")
        with _closes_channel(406, "delete if-empty removed a non-empty queue"):
            ch.queue_delete(q, if_empty=True)


@case("stream-queue", "pika")
def stream_queue(t: Target) -> None:
    """x-queue-type stream: consumers read by offset (x-stream-offset ``first``), acks
    remove nothing, so a second consumer reads the same messages."""
    name = t.name("stream")
    with _channel(t) as ch:
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
        try:
            _confirmed(ch)
            for i in range(3):
                ch.basic_publish("", name, f"s{i}".encode())
            for _ in range(2):
                with _channel(t) as reader:
                    reader.basic_qos(prefetch_count=10)
                    got: list[bytes] = []
                    for method, _, body in reader.consume(
                        name, arguments={"x-stream-offset": "first"}, inactivity_timeout=5
                    ):
                        assert method is not None, f"only {got}"
                        got.append(body)
                        reader.basic_ack(method.delivery_tag)
                        if len(got) == 3:
                            break
                    reader.cancel()
                    assert got == [b"s0", b"s1", b"s2"], got
        finally:
            ch.queue_delete(name)


@case("consumer-cancel-notify", "pika")
def consumer_cancel_notify(t: Target) -> None:
    """Deleting a queue sends basic.cancel to its consumers (RabbitMQ's
    consumer_cancel_notify capability)."""
    name = t.name("cancelled")
    with _channel(t) as ch:
        ch.queue_declare(name)
        cancelled: list[Any] = []
        ch.add_on_cancel_callback(cancelled.append)
        ch.basic_consume(name, lambda *args: None)
        with _channel(t) as other:
            other.queue_delete(name)
        wait_until(
            lambda: (ch.connection.process_data_events(0.05), cancelled)[1], 5, "basic.cancel"
        )


@case("get-message-count", "pika")
def get_message_count(t: Target) -> None:
    """basic.get-ok carries the count of messages left; declare-ok the ready count."""
    with _queue(t, "count") as (ch, q):
        _confirmed(ch)
        for i in range(3):
            ch.basic_publish("", q, str(i).encode())
        assert ch.queue_declare(q, passive=True).method.message_count == 3
        method, _, _ = ch.basic_get(q, auto_ack=True)
        assert method is not None and method.message_count == 2, method


@case("heartbeat-timeout", "raw-socket")
def heartbeat_timeout(t: Target) -> None:
    """A client that negotiated a 1 s heartbeat and then falls silent is disconnected
    after missing two (AMQP 0-9-1 4.2.7; RabbitMQ closes it the same way)."""
    import socket
    import struct

    def frame(kind: int, channel: int, payload: bytes) -> bytes:
        return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"

    def shortstr(text: str) -> bytes:
        return bytes([len(text)]) + text.encode()

    def longstr(data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + data

    def read_method(sock: socket.socket) -> tuple[tuple[int, int], bytes]:
        kind, _, size = struct.unpack(">BHI", _recv_exactly(sock, 7))
        payload = _recv_exactly(sock, size + 1)[:-1]
        assert kind == 1, f"frame type {kind}"
        return struct.unpack(">HH", payload[:4]), payload[4:]

    user, password = t.user or "guest", t.password or "guest"
    with socket.create_connection((t.host, t.port("amqp")), timeout=_TIMEOUT_S) as sock:
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        assert read_method(sock)[0] == (10, 10), "no connection.start"
        response = b"\x00" + user.encode() + b"\x00" + password.encode()
        start_ok = struct.pack(">HH", 10, 11) + struct.pack(">I", 0)  # empty client props
        start_ok += shortstr("PLAIN") + longstr(response) + shortstr("en_US")
        sock.sendall(frame(1, 0, start_ok))
        method, tune = read_method(sock)
        assert method == (10, 30), "no connection.tune"
        channel_max, frame_max, _ = struct.unpack(">HIH", tune[:8])  # the server's limits
        tune_ok = struct.pack(">HHHIH", 10, 31, channel_max, frame_max, 1)  # heartbeat 1 s
        sock.sendall(frame(1, 0, tune_ok))
        sock.sendall(frame(1, 0, struct.pack(">HH", 10, 40) + shortstr(t.vhost) + b"\x00\x00"))
        assert read_method(sock)[0] == (10, 41), "no connection.open-ok"
        deadline = time.monotonic() + 8
        try:
            while time.monotonic() < deadline:  # read (and ignore) its heartbeats
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                if not sock.recv(4096):
                    return
        except TimeoutError:
            raise AssertionError("a silent client stayed connected for 8 s") from None
        except OSError:
            return  # reset
        raise AssertionError("a silent client stayed connected for 8 s")
