"""The MNS queue and topic API through Alibaba's own SDK (aliyun-mns-sdk, signed
requests), judged by the MNS API reference: message fields, visibility, delays, long
polling, batches, error codes, topics with queue subscriptions."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from polymq.conformance.runner import NotApplicable, Registry, Target

registry = Registry("mns")
case = registry.case

warnings.filterwarnings("ignore", category=DeprecationWarning, module="mns")


def _account(t: Target, secret: str | None = None) -> Any:
    from mns.account import Account

    endpoint = f"http://{t.host}:{t.port('mns')}"
    return Account(endpoint, t.access_key or "conformance", secret or t.secret_key or "conformance")


@contextmanager
def _queue(t: Target, prefix: str = "q", **meta: Any) -> Iterator[Any]:
    from mns.queue import QueueMeta

    queue = _account(t).get_queue(t.name(prefix))
    queue.create(QueueMeta(**meta))
    try:
        yield queue
    finally:
        with suppress(Exception):
            queue.delete()


def _error_type(fn: Any) -> str:
    """The MNS error code ``fn`` fails with (AssertionError if it succeeds)."""
    from mns.mns_exception import MNSServerException

    try:
        fn()
    except MNSServerException as e:
        return str(e.type)
    raise AssertionError("the request succeeded")


@case("queue-lifecycle", "aliyun-mns-sdk")
def queue_lifecycle(t: Target) -> None:
    """CreateQueue, GetQueueAttributes, SetQueueAttributes, ListQueue, DeleteQueue; a
    create with other attributes is QueueAlreadyExist; a deleted queue QueueNotExist."""
    from mns.queue import QueueMeta

    account = _account(t)
    prefix = t.name("life")
    queue = account.get_queue(prefix + "x")
    queue.create(QueueMeta(vis_timeout=40, polling_wait_sec=3, max_msg_size=2048))
    try:
        queue.create(QueueMeta(vis_timeout=40, polling_wait_sec=3, max_msg_size=2048))  # same
        assert _error_type(lambda: queue.create(QueueMeta(vis_timeout=41))) == "QueueAlreadyExist"
        meta = queue.get_attributes()
        assert (meta.visibility_timeout, meta.polling_wait_seconds, meta.maximum_message_size) == (
            40,
            3,
            2048,
        )
        update = QueueMeta()
        update.set_visibilitytimeout(50)
        queue.set_attributes(update)
        assert queue.get_attributes().visibility_timeout == 50
        names, _ = account.list_queue(prefix)
        assert any(n.rstrip("/").endswith(prefix + "x") for n in names), names
    finally:
        queue.delete()
    assert _error_type(queue.get_attributes) == "QueueNotExist"


@case("auth-refused", "aliyun-mns-sdk")
def auth_refused(t: Target) -> None:
    """A request signed with a wrong secret gets SignatureDoesNotMatch (403)."""
    if not t.auth_enforced:
        raise NotApplicable("the target does not check signatures")
    queue = _account(t, secret="wrong-" + t.run_id).get_queue(t.name("auth"))
    assert _error_type(queue.get_attributes) in ("SignatureDoesNotMatch", "AccessDenied")


@case("send-receive-delete", "aliyun-mns-sdk")
def send_receive_delete(t: Target) -> None:
    """A received message carries MessageId, MessageBodyMD5, DequeueCount 1, times; a
    deleted one is gone."""
    from mns.queue import Message

    with _queue(t) as queue:
        sent = queue.send_message(Message("hello mns"))
        got = queue.receive_message(3)
        assert got.message_id == sent.message_id and got.message_body in (b"hello mns", "hello mns")
        assert got.message_body_md5 == sent.message_body_md5
        assert got.dequeue_count == 1 and got.enqueue_time > 0 and got.next_visible_time > 0
        queue.delete_message(got.receipt_handle)
        assert _error_type(lambda: queue.receive_message(1)) == "MessageNotExist"


@case("long-polling", "aliyun-mns-sdk")
def long_polling(t: Target) -> None:
    """ReceiveMessage with waitseconds waits for a message sent meanwhile."""
    from mns.queue import Message

    with _queue(t) as queue:
        results: list[Any] = []
        receiver = threading.Thread(
            target=lambda: results.append(queue.receive_message(10)), daemon=True
        )
        receiver.start()
        sender = _account(t).get_queue(queue.queue_name)
        time.sleep(0.3)  # let the receive start waiting (it still passes if it has not)
        sender.send_message(Message("woken"))
        receiver.join(15)
        assert results and results[0].message_body in (b"woken", "woken")


@case("visibility-timeout", "aliyun-mns-sdk")
def visibility_timeout(t: Target) -> None:
    """An undeleted message comes back after VisibilityTimeout with DequeueCount 2; the
    first receipt handle is stale (ReceiptHandleError)."""
    from mns.queue import Message

    with _queue(t, vis_timeout=1) as queue:
        queue.send_message(Message("again"))
        first = queue.receive_message(3)
        second = queue.receive_message(10)
        assert second.message_id == first.message_id and second.dequeue_count == 2
        error = _error_type(lambda: queue.delete_message(first.receipt_handle))
        assert error in ("ReceiptHandleError", "MessageNotExist"), error
        queue.delete_message(second.receipt_handle)


@case("change-visibility", "aliyun-mns-sdk")
def change_visibility(t: Target) -> None:
    """ChangeMessageVisibility returns a new handle and brings the message back sooner."""
    from mns.queue import Message

    with _queue(t, vis_timeout=60) as queue:
        queue.send_message(Message("later"))
        got = queue.receive_message(3)
        changed = queue.change_message_visibility(got.receipt_handle, 1)
        assert changed.receipt_handle != got.receipt_handle
        again = queue.receive_message(10)
        assert again.message_id == got.message_id and again.dequeue_count == 2
        queue.delete_message(again.receipt_handle)


@case("delay-seconds", "aliyun-mns-sdk")
def delay_seconds(t: Target) -> None:
    """A message sent with DelaySeconds is not receivable before then."""
    from mns.queue import Message

    with _queue(t) as queue:
        sent_at = time.time()
        queue.send_message(Message("soon", delay_seconds=2))
        assert _error_type(lambda: queue.receive_message(0)) == "MessageNotExist"
        got = queue.receive_message(10)
        assert got.message_body in (b"soon", "soon") and time.time() - sent_at >= 1.9


@case("batch-operations", "aliyun-mns-sdk")
def batch_operations(t: Target) -> None:
    """BatchSendMessage, BatchPeekMessage, BatchReceiveMessage, BatchDeleteMessage."""
    from mns.queue import Message

    with _queue(t) as queue:
        sent = queue.batch_send_message([Message(f"body-{i}") for i in range(16)])
        assert len(sent) == 16
        peeked = queue.batch_peek_message(5)
        assert len(peeked) == 5 and all(p.dequeue_count == 0 for p in peeked)
        received: list[Any] = []
        deadline = time.monotonic() + 15
        while len(received) < 16 and time.monotonic() < deadline:
            received += queue.batch_receive_message(16, 1)
        assert sorted(m.message_id for m in received) == sorted(m.message_id for m in sent)
        queue.batch_delete_message([m.receipt_handle for m in received])
        assert queue.get_attributes().active_messages == 0


@case("user-properties-priority", "aliyun-mns-sdk")
def user_properties_priority(t: Target) -> None:
    """Priority and typed user properties come back as sent; priority 1 goes first."""
    from mns.message_property import MessagePropertyValue, PropertyType
    from mns.queue import Message

    with _queue(t) as queue:
        queue.send_message(Message("low", priority=16))
        message = Message("high", priority=1)
        message.add_user_property("color", MessagePropertyValue(PropertyType.STRING, "blue"))
        message.add_user_property("count", MessagePropertyValue(PropertyType.NUMBER, 7))
        queue.send_message(message)
        got = queue.receive_message(3)
        assert got.message_body in (b"high", "high") and got.priority == 1, got.message_body
        props = got.get_user_properties()
        assert props["color"].get_string_value_by_type() == "blue"
        assert props["count"].get_data_type() == PropertyType.NUMBER


@case("errors", "aliyun-mns-sdk")
def errors(t: Target) -> None:
    """Unknown queue: QueueNotExist; a forged receipt handle: ReceiptHandleError."""
    account = _account(t)
    missing = account.get_queue(t.name("absent"))
    assert _error_type(missing.get_attributes) == "QueueNotExist"
    with _queue(t) as queue:
        error = _error_type(lambda: queue.delete_message("not-a-receipt-handle"))
        assert error in ("ReceiptHandleError", "InvalidArgument"), error


@case("topic-queue-subscription", "aliyun-mns-sdk")
def topic_queue_subscription(t: Target) -> None:
    """PublishMessage reaches subscribed queues; a tag filter keeps other tags out."""
    from mns.subscription import SubscriptionMeta
    from mns.topic import TopicMessage, TopicMeta

    account = _account(t)
    topic = account.get_topic(t.name("topic"))
    topic.create(TopicMeta())
    try:
        with _queue(t, "all") as everything, _queue(t, "red") as red:
            topic.get_subscription("all").subscribe(
                SubscriptionMeta(f"acs:mns:cn-local:1:queues/{everything.queue_name}")
            )
            topic.get_subscription("red").subscribe(
                SubscriptionMeta(f"acs:mns:cn-local:1:queues/{red.queue_name}", filter_tag="red")
            )
            for queue in (everything, red):
                queue.set_encoding(False)  # topic messages arrive as published, not base64
            topic.publish_message(TopicMessage("blue one", "blue"))
            topic.publish_message(TopicMessage("red one", "red"))
            bodies = sorted(str(everything.receive_message(5).message_body) for _ in range(2))
            assert bodies == ["blue one", "red one"], bodies
            only = red.receive_message(5)
            assert only.message_body == "red one", only.message_body
            red.delete_message(only.receipt_handle)
            assert _error_type(lambda: red.receive_message(1)) == "MessageNotExist"
    finally:
        topic.delete()


@case("topic-http-subscription", "aliyun-mns-sdk", timeout_s=45)
def topic_http_subscription(t: Target) -> None:
    """An HTTP endpoint subscribed to a topic is POSTed each published message (MNS
    notification, SIMPLIFIED format: the body as published), and a 500 is retried."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mns.subscription import SubscriptionMeta
    from mns.topic import TopicMessage, TopicMeta

    if t.host not in ("127.0.0.1", "localhost", "::1"):
        raise NotApplicable("the target must reach an endpoint on this machine's loopback")
    received: list[bytes] = []
    cond = threading.Condition()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            with cond:
                received.append(body)
                cond.notify_all()
                failing = len(received) == 1  # the first attempt fails: it must be retried
            self.send_response(500 if failing else 204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    topic = _account(t).get_topic(t.name("notify"))
    topic.create(TopicMeta())
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/notify"
        topic.get_subscription("hook").subscribe(
            SubscriptionMeta(
                url, notify_strategy="BACKOFF_RETRY", notify_content_format="SIMPLIFIED"
            )
        )
        topic.publish_message(TopicMessage("disk full", "ops"))
        with cond:
            assert cond.wait_for(lambda: len(received) >= 2, 30), f"{len(received)} POSTs"
        assert received[0] == received[1] == b"disk full", received
    finally:
        topic.delete()
        server.shutdown()
        server.server_close()


@case("queue-counters", "aliyun-mns-sdk")
def queue_counters(t: Target) -> None:
    """GetQueueAttributes counts ActiveMessages, InactiveMessages (received, not yet
    visible) and DelayMessages."""
    from mns.queue import Message

    with _queue(t, vis_timeout=60) as queue:
        for body in ("a", "b"):
            queue.send_message(Message(body))
        queue.send_message(Message("later", delay_seconds=60))
        queue.receive_message(3)
        meta = queue.get_attributes()
        counts = (meta.active_messages, meta.inactive_messages, meta.delay_messages)
        assert counts == (1, 1, 1), f"active, inactive, delayed = {counts}"


@case("list-paging", "aliyun-mns-sdk")
def list_paging(t: Target) -> None:
    """ListQueue with a prefix pages by ret number and NextMarker, each queue once."""
    from mns.queue import QueueMeta

    account = _account(t)
    prefix = t.name("page")
    names = [f"{prefix}-{i}" for i in range(3)]
    for name in names:
        account.get_queue(name).create(QueueMeta())
    try:
        first, marker = account.list_queue(prefix, 2)
        assert len(first) == 2 and marker, (first, marker)
        rest, last_marker = account.list_queue(prefix, 2, marker)
        listed = [url.rstrip("/").rsplit("/", 1)[-1] for url in first + rest]
        assert sorted(listed) == names and not last_marker, (listed, last_marker)
    finally:
        for name in names:
            account.get_queue(name).delete()
