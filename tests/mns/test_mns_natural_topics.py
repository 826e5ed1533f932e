"""Natural names (docs/interop.md): MNS topic ``T`` is storage topic ``T`` both ways.
What Kafka or MQTT store in ``T`` reaches MNS topic ``T``'s queue and HTTP
subscriptions (tag filters applied) once each, across two gateways, with the real
aliyun-mns-sdk, kafka-python and paho-mqtt; MNS's own publishes are not doubled."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from kafka import KafkaProducer
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Queue, QueueMeta
from mns.subscription import SubscriptionMeta
from mns.topic import TopicMessage, TopicMeta
from paho.mqtt.enums import CallbackAPIVersion

from polymq.gateway.assembly import protocol_listeners
from tests.live_server import LiveServer, live_gateways
from tests.mns.harness import fast_retry_listener
from tests.mns.test_mns_topics import Endpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WAIT_S = 30.0


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[list[LiveServer]]:
    factories = {**protocol_listeners(), "http": fast_retry_listener}
    with live_gateways(
        tmp_path_factory.mktemp("mns-natural"), ("http", "kafka", "mqtt"), 2, factories=factories
    ) as servers:
        yield servers


def _account(server: LiveServer) -> Account:
    host, port = server.address("http")
    return Account(f"http://{host}:{port}", "any", "any")


def _bodies(queue: Queue, want: int, settle_s: float = 2.0) -> list[str]:
    """Every body the queue hands out: ``want`` of them, then ``settle_s`` more to
    see any duplicate arrive."""
    queue.set_encoding(False)
    got: list[str] = []
    deadline = time.monotonic() + WAIT_S
    quiet_until: float | None = None
    while time.monotonic() < deadline:
        try:
            for message in queue.batch_receive_message(16, 1):
                got.append(message.message_body)
                queue.delete_message(message.receipt_handle)
            continue
        except MNSServerException as e:
            assert e.type == "MessageNotExist", e
        if len(got) >= want:
            if quiet_until is None:
                quiet_until = time.monotonic() + settle_s
            elif time.monotonic() >= quiet_until:
                break
    return sorted(got)


def test_other_protocols_reach_the_topics_subscriptions_once_each(
    gateways: list[LiveServer],
) -> None:
    account = _account(gateways[0])
    run = uuid.uuid4().hex[:8]
    name = f"news-{run}"
    topic = account.get_topic(name)
    topic.create(TopicMeta())
    every, reds = f"all-{run}", f"red-{run}"
    for queue in (every, reds):
        account.get_queue(queue).create(QueueMeta())
    topic.get_subscription("all").subscribe(SubscriptionMeta(f"queues/{every}"))
    topic.get_subscription("red").subscribe(SubscriptionMeta(f"queues/{reds}", filter_tag="red"))
    http = Endpoint()
    try:
        topic.get_subscription("web").subscribe(
            SubscriptionMeta(http.url, notify_content_format="SIMPLIFIED")
        )
        producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{gateways[1].port('kafka')}")
        try:
            producer.send(name, key=b"k1", value=b"kafka red", headers=[("polymq.tag", b"red")])
            producer.send(name, key=b"k2", value=b"kafka blue")
            producer.flush(timeout=WAIT_S)
        finally:
            producer.close()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        client.connect("127.0.0.1", gateways[1].port("mqtt"))
        client.loop_start()
        try:
            client.publish(f"{name}/eu", b"mqtt plain", qos=1).wait_for_publish(WAIT_S)
        finally:
            client.loop_stop()
            client.disconnect()
        topic.publish_message(TopicMessage("mns red", "red"))
        want = ["kafka blue", "kafka red", "mns red", "mqtt plain"]
        assert _bodies(account.get_queue(every), 4) == want
        assert _bodies(account.get_queue(reds), 2) == ["kafka red", "mns red"]
        received = http.wait_for(4)
        time.sleep(1.0)  # a duplicate would come now
        assert sorted(body.decode() for _, body in http.received) == want
        assert len(received) == 4
    finally:
        http.close()
