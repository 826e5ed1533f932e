"""RocketMQ 5 (the gRPC protocol of Apache RocketMQ 5's proxy), judged by Apache
RocketMQ's documented behaviour. Topics are named per case and created by the first
send, as Apache does with ``autoCreateTopicEnable`` (a target without it needs them
created beforehand; the cases then error with TOPIC_NOT_FOUND)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
    TransactionChecker,
    TransactionResolution,
)

from polymq.conformance.runner import NotApplicable, Registry, Target

registry = Registry("rocketmq")
case = registry.case
_WAIT_S = 20.0


def _config(t: Target, secret: str | None = None) -> Any:
    credentials = Credentials(t.access_key or "", secret or t.secret_key or "")
    return ClientConfiguration(f"{t.host}:{t.port('rocketmq')}", credentials)


class _Checker(TransactionChecker):  # type: ignore[misc]
    """Answers check-backs with rollback: only the producer's own decision should count."""

    def check(self, message: Any) -> Any:
        return TransactionResolution.ROLLBACK


@contextmanager
def _producer(t: Target, *topics: str, transactional: bool = False) -> Iterator[Any]:
    producer = Producer(_config(t), topics, _Checker() if transactional else None)
    producer.startup()
    try:
        yield producer
    finally:
        producer.shutdown()


@contextmanager
def _consumer(t: Target, topic: str, expression: Any = None) -> Iterator[Any]:
    consumer = SimpleConsumer(
        _config(t), t.name("group"), {topic: expression or FilterExpression()}, await_duration=2
    )
    consumer.startup()
    try:
        yield consumer
    finally:
        consumer.shutdown()


def _message(topic: str, body: bytes, **fields: Any) -> Any:
    msg = Message()
    msg.topic = topic
    msg.body = body
    for name, value in fields.items():
        if name == "properties":
            for key, prop in value.items():
                msg.add_property(key, prop)
        else:
            setattr(msg, name, value)
    return msg


def _receive(
    consumer: Any, count: int, invisible_s: int = 20, timeout: float = _WAIT_S
) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count} messages"
        got.extend(consumer.receive(32, invisible_s))
    return got


def _topic(t: Target) -> str:
    return t.name("topic").replace("-", "_")


@case("send-receive-ack", "rocketmq-python")
def send_receive_ack(t: Target) -> None:
    """A message keeps its tag, keys and properties; acked, it is not received again."""
    topic = _topic(t)
    with _producer(t, topic) as p, _consumer(t, topic) as c:
        receipt = p.send(_message(topic, b"hello", tag="t1", keys="k1", properties={"app": "conf"}))
        [got] = _receive(c, 1)
        assert got.body == b"hello" and got.message_id == receipt.message_id
        assert got.tag == "t1" and list(got.keys) == ["k1"], (got.tag, got.keys)
        assert got.properties.get("app") == "conf", got.properties
        assert got.delivery_attempt == 1
        c.ack(got)
        assert c.receive(32, 20) == [], "an acked message was received again"


def _query_route_code(t: Target, secret: str, topic: str) -> int:
    """The status code of a QueryRoute signed by the client's own signing code."""
    import grpc
    from rocketmq.grpc_protocol import MessagingServiceStub, definition_pb2, service_pb2
    from rocketmq.v5.util.signature import Signature

    request = service_pb2.QueryRouteRequest(
        topic=definition_pb2.Resource(name=topic),
        endpoints=definition_pb2.Endpoints(
            scheme=definition_pb2.AddressScheme.IPv4,
            addresses=[definition_pb2.Address(host=t.host, port=t.port("rocketmq"))],
        ),
    )
    metadata = Signature.metadata(_config(t, secret=secret), t.name("client"))
    with grpc.insecure_channel(f"{t.host}:{t.port('rocketmq')}") as channel:
        response = MessagingServiceStub(channel).QueryRoute(request, metadata=metadata, timeout=10)
    return int(response.status.code)


@case("auth-refused", "rocketmq-python")
def auth_refused(t: Target) -> None:
    """A request signed with a wrong secret is UNAUTHORIZED; the right one is not."""
    from rocketmq.grpc_protocol import definition_pb2

    if not t.auth_enforced or not t.access_key:
        raise NotApplicable("the target does not check signatures")
    topic = _topic(t)
    unauthorized = definition_pb2.Code.UNAUTHORIZED
    assert _query_route_code(t, "wrong-" + t.run_id, topic) == unauthorized, "accepted"
    assert _query_route_code(t, t.secret_key or "", topic) != unauthorized


@case("tag-filter", "rocketmq-python")
def tag_filter(t: Target) -> None:
    """A tag expression ``a||c`` gets only those tags."""
    topic = _topic(t)
    with _producer(t, topic) as p:
        for tag in ("a", "b", "c", "end"):
            p.send(_message(topic, tag.encode(), tag=tag))
    with _consumer(t, topic, FilterExpression("a||c||end")) as c:
        got = _receive(c, 3)
        for m in got:
            c.ack(m)
        assert sorted(m.tag for m in got) == ["a", "c", "end"], [m.tag for m in got]


@case("change-invisible-duration", "rocketmq-python")
def change_invisible_duration(t: Target) -> None:
    """ChangeInvisibleDuration returns a new receipt; the message comes back at the new
    time with delivery_attempt 2."""
    topic = _topic(t)
    with _producer(t, topic) as p, _consumer(t, topic) as c:
        p.send(_message(topic, b"again"))
        [first] = _receive(c, 1, invisible_s=60)
        old = first.receipt_handle
        c.change_invisible_duration(first, 1)
        assert first.receipt_handle != old, "no new receipt handle"
        [second] = _receive(c, 1, invisible_s=60)
        assert second.message_id == first.message_id and second.delivery_attempt == 2
        c.ack(second)


@case("redelivery-after-invisible", "rocketmq-python", timeout_s=45)
def redelivery_after_invisible(t: Target) -> None:
    """An unacked message comes back after its invisible duration (the minimum, 10 s)."""
    topic = _topic(t)
    with _producer(t, topic) as p, _consumer(t, topic) as c:
        p.send(_message(topic, b"unacked"))
        [first] = _receive(c, 1, invisible_s=10)
        [second] = _receive(c, 1, invisible_s=60, timeout=30)
        assert second.message_id == first.message_id and second.delivery_attempt == 2
        c.ack(second)


@case("delay-message", "rocketmq-python")
def delay_message(t: Target) -> None:
    """A message with a delivery timestamp is not delivered before it."""
    topic = _topic(t)
    with _producer(t, topic) as p, _consumer(t, topic) as c:
        due_s = int(time.time()) + 2
        p.send(_message(topic, b"later", delivery_timestamp=due_s))
        [got] = _receive(c, 1)
        assert time.time() >= due_s - 0.1, "delivered before its delivery time"
        assert got.delivery_timestamp == due_s * 1000, got.delivery_timestamp
        c.ack(got)


@case("recall-delayed", "rocketmq-python")
def recall_delayed(t: Target) -> None:
    """RecallMessage (RocketMQ 5.3) cancels a pending delayed message."""
    topic = _topic(t)
    with _producer(t, topic) as p:
        receipt = p.send(_message(topic, b"never", delivery_timestamp=int(time.time()) + 3600))
        assert receipt.recall_handle, "no recall handle"
        assert p.recall_message(topic, receipt.recall_handle) == receipt.message_id


@case("fifo-message-group", "rocketmq-python")
def fifo_message_group(t: Target) -> None:
    """Messages of one message group keep their order and carry their group."""
    topic = _topic(t)
    with _producer(t, topic) as p:
        for i in range(5):
            p.send(_message(topic, f"m{i}".encode(), message_group="G"))
    with _consumer(t, topic) as c:
        got: list[bytes] = []
        while len(got) < 5:
            batch = _receive(c, 1)
            for m in batch:
                assert m.message_group == "G", m.message_group
                got.append(m.body)
                c.ack(m)
        assert got == [f"m{i}".encode() for i in range(5)], got


def _transaction_case(t: Target, commit: bool) -> None:
    topic = _topic(t)
    with _producer(t, topic, transactional=True) as p, _consumer(t, topic) as c:
        tx = p.begin_transaction()
        p.send(_message(topic, b"half"), tx)
        assert c.receive(32, 20) == [], "a half message was visible before the commit"
        if commit:
            tx.commit()
            [got] = _receive(c, 1)
            assert got.body == b"half"
            c.ack(got)
        else:
            tx.rollback()
            assert c.receive(32, 20) == [], "a rolled-back message was delivered"


@case("transaction-commit", "rocketmq-python")
def transaction_commit(t: Target) -> None:
    """A half message is invisible until committed, then delivered."""
    _transaction_case(t, commit=True)


@case("transaction-rollback", "rocketmq-python")
def transaction_rollback(t: Target) -> None:
    """A rolled-back half message is never delivered."""
    _transaction_case(t, commit=False)


@case("send-async", "rocketmq-python")
def send_async(t: Target) -> None:
    """Asynchronous sends: every future completes and every message arrives once."""
    topic = _topic(t)
    with _producer(t, topic) as p, _consumer(t, topic) as c:
        futures = [p.send_async(_message(topic, f"a{i}".encode())) for i in range(20)]
        ids = {f.result(_WAIT_S).message_id for f in futures}
        got = _receive(c, 20)
        for m in got:
            c.ack(m)
        assert {m.message_id for m in got} == ids


@case("send-receive-ack", "rocketmq-nodejs")
def node_roundtrip(t: Target) -> None:
    """rocketmq-client-nodejs: send with tag, keys and a property; receive and ack."""
    from polymq.conformance.cases._node import run_node

    creds = [t.access_key, t.secret_key or ""] if t.access_key else []
    endpoint = f"{t.host}:{t.port('rocketmq')}"
    result = run_node("conformance_rocketmq.js", endpoint, _topic(t), t.name("group"), *creds)
    assert sorted(g["id"] for g in result["got"]) == sorted(result["sent"]), result
    for got in result["got"]:
        assert got["tag"] == "node" and got["origin"] == "node", got
        assert got["keys"] == [f"key-{got['body'].split('-')[1]}"], got


@case("sql92-filter", "rocketmq-python")
def sql92_filter(t: Target) -> None:
    """A SQL92 filter over user properties and TAGS selects the matching messages."""
    from rocketmq.grpc_protocol import FilterType

    topic = _topic(t)
    with _producer(t, topic) as p:
        for i in range(6):
            p.send(_message(topic, str(i).encode(), tag="x", properties={"n": str(i)}))
    expression = FilterExpression("n >= 2 AND n BETWEEN 0 AND 4 AND TAGS = 'x'", FilterType.SQL)
    with _consumer(t, topic, expression) as c:
        got = _receive(c, 3)
        for m in got:
            c.ack(m)
        assert sorted(m.body for m in got) == [b"2", b"3", b"4"], [m.body for m in got]


@case("push-consumer-retry", "rocketmq-python")
def push_consumer_retry(t: Target) -> None:
    """PushConsumer: every message reaches the listener; one that fails is delivered
    again with delivery_attempt 2 (after the server's first retry backoff)."""
    import threading

    from rocketmq import ConsumeResult, MessageListener, PushConsumer

    deliveries: list[tuple[bytes, int]] = []
    lock = threading.Condition()

    class Listener(MessageListener):  # type: ignore[misc]
        def consume(self, message: Any) -> Any:
            with lock:
                deliveries.append((message.body, message.delivery_attempt))
                lock.notify_all()
            failing = message.body == b"flaky" and message.delivery_attempt == 1
            return ConsumeResult.FAILURE if failing else ConsumeResult.SUCCESS

    topic = _topic(t)
    with _producer(t, topic) as p:
        for body in (b"a", b"b", b"flaky"):
            p.send(_message(topic, body))
    consumer = PushConsumer(
        _config(t),
        t.name("push"),
        Listener(),
        {topic: FilterExpression()},
        consumption_thread_count=2,
    )
    consumer.startup()
    try:
        with lock:
            assert lock.wait_for(lambda: (b"flaky", 2) in deliveries, _WAIT_S), deliveries
        assert sorted(b for b, a in deliveries if a == 1) == [b"a", b"b", b"flaky"], deliveries
    finally:
        consumer.shutdown()
