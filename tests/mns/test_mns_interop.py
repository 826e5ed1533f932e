"""Messages cross between the MNS API and the storage model the other protocols use:
a queue is the storage topic of the same name, and fields map as protocols/interop.py
says."""

from __future__ import annotations

import pytest
from mns.account import Account
from mns.message_property import MessagePropertyValue, PropertyType
from mns.queue import Message as MnsMessage
from mns.queue import QueueMeta

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols import interop
from polymq.storage.model import AppendRequest, Message, QueueRef, TopicConfig
from tests.live_server import LiveServer
from tests.mns.harness import NAMESPACE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CALLER = Caller(principal=ANONYMOUS, namespace=NAMESPACE, protocol="kafka")


def test_a_kafka_style_record_is_received_over_mns(server: LiveServer, account: Account) -> None:
    processor = server.gateway.processor

    async def produce() -> None:
        await processor.create_topic(CALLER, "sensors", TopicConfig(queue_count=1))
        record = Message(
            body=b"21.5\x00\xff",
            key=b"room-1",
            content_type="text/plain",
            properties=(("unit", b"celsius"),),
        )
        await processor.append(
            CALLER, [AppendRequest(entry=record, queues=(QueueRef(NAMESPACE, "sensors"),))]
        )

    server.call(produce)
    queue = account.get_queue("sensors")  # never created through MNS: default attributes
    queue.set_encoding(False)
    got = queue.receive_message(0)
    assert got.message_body == "21.5\ufffd\ufffd"  # not text: replaced, never broken XML
    props = got.get_user_properties()
    assert props[interop.KEY].get_string_value_by_type() == "room-1"
    assert props[interop.CONTENT_TYPE].get_string_value_by_type() == "text/plain"
    assert props["unit"].get_string_value_by_type() == "celsius"
    queue.delete_message(got.receipt_handle)
    # Adopted on first use: listed, and consumed with MNS's policy (no delivery limit).
    urls, _ = account.list_queue(prefix="sensors")
    assert [u.rsplit("/", 1)[1] for u in urls] == ["sensors"]
    config = server.call(lambda: processor.get_group_config(CALLER, "mns.sensors"))
    assert config.max_delivery_attempts is None


def test_an_mns_message_is_a_model_message(server: LiveServer, account: Account) -> None:
    queue = account.get_queue("outbound")
    queue.create(QueueMeta())
    queue.set_encoding(False)
    message = MnsMessage("plain text", priority=2, message_group_id="g7")
    message.add_user_property(
        interop.CORRELATION_ID, MessagePropertyValue(PropertyType.STRING, "c-1")
    )
    message.add_user_property("trace", MessagePropertyValue(PropertyType.STRING, "t-9"))
    queue.send_message(message)

    # Priority 2 has a storage queue of its own (the default, 8, is queue 0).
    result = server.call(
        lambda: server.gateway.processor.read(CALLER, QueueRef(NAMESPACE, "outbound", 2), 0)
    )
    [stored] = result.messages
    assert stored.message.body == b"plain text"
    assert stored.message.message_group == "g7"
    assert stored.message.correlation_id == b"c-1"
    assert stored.message.property("trace") == b"t-9"
    assert stored.message.property("mns.priority") == b"2"
    assert stored.message.expiry_ms is not None  # the queue's MessageRetentionPeriod
