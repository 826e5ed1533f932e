"""Topics and subscriptions through the real aliyun-mns-sdk: queue endpoints (one
stored body multi-dispatched, tag filtering) and HTTP endpoints (a small server in the
test receives notifications; a failing one is retried)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import QueueMeta
from mns.subscription import SubscriptionMeta
from mns.topic import TopicMessage, TopicMeta

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols.mns.notify import push_group, push_topic
from polymq.storage.model import QueueRef
from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, NAMESPACE, SECRET_KEY, endpoint, start
from tests.mns.signed import request

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Endpoint:
    """An HTTP endpoint that records what it is sent, failing the first ``fail``
    requests with 500."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.condition = threading.Condition()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with endpoint.condition:
                    endpoint.received.append(
                        ({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    failing = len(endpoint.received) <= endpoint.fail
                    endpoint.condition.notify_all()
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/notify"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[tuple[dict[str, str], bytes]]:
        with self.condition:
            assert self.condition.wait_for(lambda: len(self.received) >= count, timeout), (
                f"got {len(self.received)} of {count} notifications"
            )
            return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def http_endpoint() -> Iterator[Endpoint]:
    endpoint = Endpoint()
    yield endpoint
    endpoint.close()


def test_topic_attributes_list_and_delete(account: Account) -> None:
    topic = account.get_topic("news")
    assert topic.create(TopicMeta()).endswith("/topics/news")
    topic.create(TopicMeta())  # same attributes: fine
    meta = topic.get_attributes()
    assert meta.topic_name == "news" and meta.maximum_message_size == 65536
    assert meta.message_count == 0
    update = TopicMeta()
    update.set_maximum_message_size(4096)
    topic.set_attributes(update)
    assert topic.get_attributes().maximum_message_size == 4096
    with pytest.raises(MNSServerException) as err:
        topic.publish_message(TopicMessage("x" * 5000))
    assert err.value.type == "MessageBodyTooLong"
    account.get_topic("news-2").create(TopicMeta())
    urls, marker = account.list_topic(prefix="news")
    assert [u.rsplit("/", 1)[1] for u in urls] == ["news", "news-2"] and marker == ""
    topic.delete()
    with pytest.raises(MNSServerException) as err:
        topic.get_attributes()
    assert err.value.type == "TopicNotExist"


def test_topic_message_retention_period_is_kept_and_applied(
    account: Account, server: LiveServer
) -> None:
    """The SDK cannot send MessageRetentionPeriod (it reads it back): raw signed
    requests set it, and the topic's own storage keeps messages that long."""
    base = endpoint(server)
    ns = "xmlns='http://mns.aliyuncs.com/doc/v1/'"
    doc = f"<Topic {ns}><MessageRetentionPeriod>3600</MessageRetentionPeriod></Topic>"
    assert request(base, "PUT", "/topics/kept", doc.encode()).status_code == 201
    topic = account.get_topic("kept")
    assert topic.get_attributes().message_retention_period == 3600
    processor = server.gateway.processor

    def retention_ms() -> int | None:
        caller = Caller(principal=ANONYMOUS, namespace=NAMESPACE, protocol="test")
        info = server.call(lambda: processor.describe_topic(caller, "kept"))
        return info.config.retention_ms

    assert retention_ms() == 3_600_000
    doc = f"<Topic {ns}><MessageRetentionPeriod>120</MessageRetentionPeriod></Topic>"
    updated = request(base, "PUT", "/topics/kept?metaoverride=true", doc.encode())
    assert updated.status_code == 204
    assert topic.get_attributes().message_retention_period == 120
    assert retention_ms() == 120_000
    doc = f"<Topic {ns}><MessageRetentionPeriod>10</MessageRetentionPeriod></Topic>"
    refused = request(base, "PUT", "/topics/kept?metaoverride=true", doc.encode())
    assert refused.status_code == 400 and "InvalidArgument" in refused.text
    assert account.get_topic("plain").create(TopicMeta())
    assert account.get_topic("plain").get_attributes().message_retention_period == 86400


def test_queue_subscriptions_get_one_stored_message_with_tag_filter(account: Account) -> None:
    topic = account.get_topic("events")
    topic.create(TopicMeta())
    for name in ("all-events", "red-events"):
        account.get_queue(name).create(QueueMeta())
    topic.get_subscription("all").subscribe(
        SubscriptionMeta("acs:mns:cn-local:1:queues/all-events")
    )
    topic.get_subscription("red").subscribe(
        SubscriptionMeta("acs:mns:cn-local:1:queues/red-events", filter_tag="red")
    )
    account.get_queue("xml-events").create(QueueMeta())
    topic.get_subscription("xml").subscribe(
        SubscriptionMeta("queues/xml-events", notify_content_format="XML")
    )
    urls, _ = topic.list_subscription()
    assert [u.rsplit("/", 1)[1] for u in urls] == ["all", "red", "xml"]
    attrs = topic.get_subscription("red").get_attributes()
    assert attrs.filter_tag == "red" and attrs.endpoint.endswith("queues/red-events")
    assert attrs.topic_name == "events" and attrs.notify_strategy == "BACKOFF_RETRY"

    red = topic.publish_message(TopicMessage("a red one", "red"))
    topic.publish_message(TopicMessage("a blue one", "blue"))
    assert topic.get_attributes().message_count == 2

    everything = account.get_queue("all-events")
    everything.set_encoding(False)  # topic messages are published as plain text
    got = everything.batch_receive_message(16, 1)
    assert sorted(m.message_body for m in got) == ["a blue one", "a red one"]
    reds = account.get_queue("red-events")
    reds.set_encoding(False)
    only = reds.batch_receive_message(16, 1)
    assert [m.message_body for m in only] == ["a red one"]
    # One append dispatched to both queues: the same stored message.
    assert only[0].message_id == red.message_id
    assert red.message_id in {m.message_id for m in got}
    # An XML-format queue subscription gets a <Notification> naming the message.
    notes = account.get_queue("xml-events")
    notes.set_encoding(False)
    documents = [m.message_body for m in notes.batch_receive_message(16, 1)]
    assert len(documents) == 2
    assert any(
        f"<MessageId>{red.message_id}</MessageId>" in d and "<Message>a red one</Message>" in d
        for d in documents
    )

    # A subscribed queue that is deleted no longer gets messages; the others still do.
    account.get_queue("all-events").delete()
    topic.publish_message(TopicMessage("after a queue went", "red"))
    assert reds.receive_message(0).message_body == "after a queue went"

    topic.get_subscription("red").unsubscribe()
    topic.publish_message(TopicMessage("after unsubscribe", "red"))
    with pytest.raises(MNSServerException) as err:
        reds.receive_message(0)
    assert err.value.type == "MessageNotExist"


def test_subscribing_a_missing_queue_or_topic_fails(account: Account) -> None:
    with pytest.raises(MNSServerException) as err:
        account.get_topic("nowhere").get_subscription("s").subscribe(SubscriptionMeta("queues/q"))
    assert err.value.type == "TopicNotExist"
    topic = account.get_topic("lonely")
    topic.create(TopicMeta())
    with pytest.raises(MNSServerException) as err:
        topic.get_subscription("s").subscribe(SubscriptionMeta("queues/not-created"))
    assert err.value.type == "QueueNotExist"
    with pytest.raises(MNSServerException) as err:
        topic.get_subscription("none").get_attributes()
    assert err.value.type == "SubscriptionNotExist"


def test_http_endpoint_receives_notifications(account: Account, http_endpoint: Endpoint) -> None:
    topic = account.get_topic("alerts")
    topic.create(TopicMeta())
    subscription = topic.get_subscription("hook")
    subscription.subscribe(SubscriptionMeta(http_endpoint.url, notify_content_format="XML"))
    sent = topic.publish_message(TopicMessage("disk full", "ops"))
    [(headers, body)] = http_endpoint.wait_for(1)
    text = body.decode()
    assert headers["content-type"].startswith("text/xml")
    assert "<Message>disk full</Message>" in text
    assert f"<MessageId>{sent.message_id}</MessageId>" in text
    assert "<TopicName>alerts</TopicName>" in text
    assert "<SubscriptionName>hook</SubscriptionName>" in text
    assert "<MessageTag>ops</MessageTag>" in text

    meta = SubscriptionMeta(notify_strategy="EXPONENTIAL_DECAY_RETRY")
    subscription.set_attributes(meta)
    assert subscription.get_attributes().notify_strategy == "EXPONENTIAL_DECAY_RETRY"


def test_failing_http_endpoint_is_retried(account: Account) -> None:
    endpoint = Endpoint(fail=2)
    try:
        topic = account.get_topic("flaky")
        topic.create(TopicMeta())
        topic.get_subscription("hook").subscribe(
            SubscriptionMeta(endpoint.url, notify_strategy="BACKOFF_RETRY")
        )
        sent = topic.publish_message(TopicMessage("try again"))
        attempts = endpoint.wait_for(3)
        assert all(sent.message_id.encode() in body for _, body in attempts)
    finally:
        endpoint.close()


def test_http_subscriptions_resume_after_restart(tmp_path: Path) -> None:
    endpoint = Endpoint()
    try:
        with start(tmp_path) as server:
            account = _account(server)
            topic = account.get_topic("durable")
            topic.create(TopicMeta())
            topic.get_subscription("hook").subscribe(
                SubscriptionMeta(endpoint.url, notify_content_format="SIMPLIFIED")
            )
        with start(tmp_path) as server:
            _account(server).get_topic("durable").publish_message(TopicMessage("after restart"))
            [(_, body)] = endpoint.wait_for(1)
            assert body == b"after restart"
    finally:
        endpoint.close()


def _account(server: LiveServer) -> Account:
    return Account(endpoint(server), ACCESS_KEY, SECRET_KEY)


def test_backoff_retry_gives_up_after_three_retries(account: Account, server: LiveServer) -> None:
    endpoint = Endpoint(fail=1_000)
    try:
        topic = account.get_topic("doomed")
        topic.create(TopicMeta())
        topic.get_subscription("hook").subscribe(
            SubscriptionMeta(endpoint.url, notify_content_format="JSON")
        )
        topic.publish_message(TopicMessage("never delivered"))
        attempts = endpoint.wait_for(4)
        headers, body = attempts[0]
        assert headers["content-type"].startswith("application/json")
        assert json.loads(body)["Message"] == "never delivered"
        # After the first try and 3 retries the message is dropped: nothing is pending.
        ref = QueueRef(NAMESPACE, push_topic("doomed", "hook"))
        caller = Caller(principal=ANONYMOUS, namespace=NAMESPACE, protocol="test")
        processor = server.gateway.processor

        async def pending() -> int:
            return await processor.pending_count(caller, push_group("doomed", "hook"), ref)

        deadline = time.monotonic() + 30
        while server.call(pending) and time.monotonic() < deadline:
            with endpoint.condition:
                endpoint.condition.wait(0.2)
        assert server.call(pending) == 0
        assert len(endpoint.received) == 4
    finally:
        endpoint.close()
