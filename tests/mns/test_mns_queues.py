"""Every queue operation through the real aliyun-mns-sdk (signed requests, accounts
auth mode) against a live gateway."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mns.account import Account
from mns.message_property import MessagePropertyValue, PropertyType
from mns.mns_exception import MNSServerException
from mns.queue import Message, Queue, QueueMeta

from polymq.storage.model import QueueRef
from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, NAMESPACE, SECRET_KEY, endpoint, start
from tests.mns.signed import request

# The SDK marks the queue counters deprecated; the server still serves them.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def make_queue(account: Account, name: str, **meta: int) -> Queue:
    queue = account.get_queue(name)
    queue.create(QueueMeta(**meta))
    return queue


def test_send_receive_delete_with_signed_sdk(account: Account, server: LiveServer) -> None:
    queue = account.get_queue("orders")
    url = queue.create(QueueMeta())
    assert url.endswith("/queues/orders")
    sent = queue.send_message(Message("hello mns"))
    assert len(sent.message_id) > 0 and len(sent.message_body_md5) == 32

    got = queue.receive_message(1)
    assert got.message_body == b"hello mns"  # the SDK base64-encodes bodies
    assert got.message_id == sent.message_id
    assert got.message_body_md5 == sent.message_body_md5
    assert got.dequeue_count == 1
    assert got.priority == 8
    assert got.next_visible_time > got.enqueue_time
    assert got.first_dequeue_time >= got.enqueue_time
    queue.delete_message(got.receipt_handle)

    # The message is stored in the access key's namespace, in topic "orders".
    offsets = server.call(
        lambda: server.gateway.processor._storage.queue_offsets(QueueRef(NAMESPACE, "orders"))
    )
    assert offsets.latest == 1
    with pytest.raises(MNSServerException) as err:
        queue.receive_message(0)
    assert err.value.type == "MessageNotExist"


def test_queue_attributes_create_set_get_list_delete(account: Account) -> None:
    queue = account.get_queue("attrs")
    queue.create(QueueMeta(vis_timeout=40, delay_sec=0, polling_wait_sec=3, max_msg_size=2048))
    # Creating again with the same attributes succeeds; with others it conflicts.
    queue.create(QueueMeta(vis_timeout=40, delay_sec=0, polling_wait_sec=3, max_msg_size=2048))
    with pytest.raises(MNSServerException) as err:
        queue.create(QueueMeta(vis_timeout=41))
    assert err.value.type == "QueueAlreadyExist"

    meta = queue.get_attributes()
    assert (meta.visibility_timeout, meta.polling_wait_seconds) == (40, 3)
    assert meta.maximum_message_size == 2048
    assert meta.message_retention_period == 345600
    assert meta.queue_name == "attrs"
    assert meta.create_time > 0 and meta.last_modify_time >= meta.create_time

    update = QueueMeta()
    update.set_visibilitytimeout(60)
    update.set_logging_enabled(True)
    queue.set_attributes(update)
    meta = queue.get_attributes()
    assert meta.visibility_timeout == 60 and meta.logging_enabled is True
    assert meta.polling_wait_seconds == 3  # untouched

    for name in ("list-a1", "list-a2", "list-b1"):
        make_queue(account, name)
    urls, marker = account.list_queue(prefix="list-a")
    assert [u.rsplit("/", 1)[1] for u in urls] == ["list-a1", "list-a2"]
    assert marker == ""
    urls, marker = account.list_queue(prefix="list-", ret_number=2)
    assert [u.rsplit("/", 1)[1] for u in urls] == ["list-a1", "list-a2"]
    assert marker == "list-b1"
    urls, marker = account.list_queue(prefix="list-", ret_number=2, marker=marker)
    assert [u.rsplit("/", 1)[1] for u in urls] == ["list-b1"]

    queue.delete()
    with pytest.raises(MNSServerException) as err:
        queue.get_attributes()
    assert err.value.type == "QueueNotExist"


def test_active_and_inactive_counts(account: Account) -> None:
    queue = make_queue(account, "counts")
    for i in range(3):
        queue.send_message(Message(f"m{i}"))
    queue.receive_message(0)
    meta = queue.get_attributes()
    assert (meta.active_messages, meta.inactive_messages) == (2, 1)


def test_batch_send_receive_peek_delete(account: Account) -> None:
    queue = account.get_queue("batch")
    queue.create(QueueMeta())
    sent = queue.batch_send_message([Message(f"body-{i}") for i in range(16)])
    assert len(sent) == 16 and len({m.message_id for m in sent}) == 16

    peeked = queue.batch_peek_message(5)
    assert [m.message_body for m in peeked] == [f"body-{i}".encode() for i in range(5)]
    assert all(m.dequeue_count == 0 for m in peeked)
    assert queue.peek_message().message_body == b"body-0"

    received = queue.batch_receive_message(16, 1)
    assert sorted(m.message_body for m in received) == sorted(
        f"body-{i}".encode() for i in range(16)
    )
    queue.batch_delete_message([m.receipt_handle for m in received[:10]])
    # Deleting a stale handle again reports it per handle.
    with pytest.raises(MNSServerException) as err:
        queue.batch_delete_message([received[0].receipt_handle, received[10].receipt_handle])
    assert err.value.type == "ReceiptHandleError"
    assert [e["ReceiptHandle"] for e in err.value.sub_errors] == [received[0].receipt_handle]
    meta = queue.get_attributes()
    assert (meta.active_messages, meta.inactive_messages) == (0, 5)


def test_visibility_timeout_expiry_redelivers_with_dequeue_count(account: Account) -> None:
    queue = make_queue(account, "redeliver", vis_timeout=1)
    queue.send_message(Message("again"))
    first = queue.receive_message(0)
    assert first.dequeue_count == 1
    second = queue.receive_message(10)
    assert second.message_id == first.message_id
    assert second.dequeue_count == 2
    assert second.first_dequeue_time == first.first_dequeue_time
    # The first receipt is stale now.
    with pytest.raises(MNSServerException) as err:
        queue.delete_message(first.receipt_handle)
    assert err.value.type == "ReceiptHandleError"
    queue.delete_message(second.receipt_handle)


def test_change_message_visibility_gives_a_new_handle(account: Account) -> None:
    queue = make_queue(account, "visibility", vis_timeout=30)
    queue.send_message(Message("later"))
    got = queue.receive_message(0)
    changed = queue.change_message_visibility(got.receipt_handle, 1)
    assert changed.receipt_handle != got.receipt_handle
    assert int(changed.next_visible_time) < got.next_visible_time  # SDK leaves it a str
    with pytest.raises(MNSServerException) as err:
        queue.delete_message(got.receipt_handle)
    assert err.value.type == "ReceiptHandleError"
    again = queue.receive_message(10)
    assert again.message_id == got.message_id and again.dequeue_count == 2


def test_delay_seconds_hold_messages_back(account: Account) -> None:
    queue = make_queue(account, "delayed")
    queue.send_message(Message("soon", delay_seconds=2))
    with pytest.raises(MNSServerException) as err:
        queue.receive_message(0)
    assert err.value.type == "MessageNotExist"
    got = queue.receive_message(10)
    assert got.message_body == b"soon"
    assert got.enqueue_time > 0


def test_long_polling_waits_for_a_message(account: Account, server: LiveServer) -> None:
    queue = make_queue(account, "poll")
    start = time.monotonic()
    with pytest.raises(MNSServerException) as err:
        queue.receive_message(1)
    assert err.value.type == "MessageNotExist"
    assert time.monotonic() - start >= 0.9  # it waited the poll out

    results: list[bytes] = []
    receiver = threading.Thread(
        target=lambda: results.append(queue.receive_message(20).message_body)
    )
    receiver.start()
    sender = Account(endpoint(server), ACCESS_KEY, SECRET_KEY)  # its own connection
    sender.get_queue("poll").send_message(Message("woken"))
    receiver.join(30)
    assert results == [b"woken"]


def test_user_properties_priority_and_group_round_trip(account: Account) -> None:
    queue = make_queue(account, "props")
    message = Message("with props", priority=3)
    message.add_user_property("color", MessagePropertyValue(PropertyType.STRING, "blue"))
    message.add_user_property("count", MessagePropertyValue(PropertyType.NUMBER, 7))
    message.add_user_property("flag", MessagePropertyValue(PropertyType.BOOLEAN, True))
    message.add_user_property("raw", MessagePropertyValue(PropertyType.BINARY, b"\x00\xff"))
    queue.send_message(message)
    got = queue.receive_message(0)
    assert got.priority == 3
    props = got.get_user_properties()
    assert props["color"].get_string_value_by_type() == "blue"
    assert props["count"].get_data_type() == PropertyType.NUMBER
    assert props["flag"].get_data_type() == PropertyType.BOOLEAN
    assert props["raw"].get_binary_value() == b"\x00\xff"


def test_fifo_queue_orders_per_group_and_deduplicates(server: LiveServer) -> None:
    base = endpoint(server)
    body = b"<Queue xmlns='http://mns.aliyuncs.com/doc/v1/'><FifoQueue>true</FifoQueue></Queue>"
    assert request(base, "PUT", "/queues/fifo", body).status_code == 201

    def send(text: str, group: str, dedup: str) -> str:
        doc = (
            "<Message xmlns='http://mns.aliyuncs.com/doc/v1/'>"
            f"<MessageBody>{text}</MessageBody><MessageGroupId>{group}</MessageGroupId>"
            f"<MessageDeduplicationId>{dedup}</MessageDeduplicationId></Message>"
        ).encode()
        response = request(base, "POST", "/queues/fifo/messages", doc)
        assert response.status_code == 201, response.text
        return response.text

    first = send("a1", "a", "d1")
    assert send("a1", "a", "d1") == first  # the same MessageId: deduplicated
    send("a2", "a", "d2")
    send("b1", "b", "d3")
    # A FIFO queue refuses messages without a group.
    plain = (
        b"<Message xmlns='http://mns.aliyuncs.com/doc/v1/'><MessageBody>x</MessageBody></Message>"
    )
    assert request(base, "POST", "/queues/fifo/messages", plain).status_code == 400

    got = request(base, "GET", "/queues/fifo/messages?numOfMessages=16&waitseconds=1")
    assert got.status_code == 200
    bodies = [b for b in ("a1", "a2", "b1") if f"<MessageBody>{b}</MessageBody>" in got.text]
    # Group a hands out a2 only after a1 is deleted.
    assert bodies == ["a1", "b1"]


def test_dead_letter_policy_moves_messages_after_max_receives(server: LiveServer) -> None:
    base = endpoint(server)
    ns = "xmlns='http://mns.aliyuncs.com/doc/v1/'"
    assert request(base, "PUT", "/queues/dlq", f"<Queue {ns}/>".encode()).status_code == 201
    policy = (
        f"<Queue {ns}><VisibilityTimeout>1</VisibilityTimeout><DlqPolicy><Enabled>true</Enabled>"
        "<DeadLetterTargetQueue>dlq</DeadLetterTargetQueue><MaxReceiveCount>1</MaxReceiveCount>"
        "</DlqPolicy></Queue>"
    ).encode()
    missing = policy.replace(b">dlq<", b">no-such-queue<")
    assert request(base, "PUT", "/queues/work", missing).status_code == 404
    assert request(base, "PUT", "/queues/work", policy).status_code == 201
    send = f"<Message {ns}><MessageBody>poison</MessageBody></Message>".encode()
    assert request(base, "POST", "/queues/work/messages", send).status_code == 201
    assert request(base, "GET", "/queues/work/messages").status_code == 200
    # Not deleted: past its visibility timeout, the next receive moves it to the
    # dead-letter queue instead of handing it out a second time.
    assert request(base, "GET", "/queues/work/messages?waitseconds=3").status_code == 404
    got = request(base, "GET", "/queues/dlq/messages?waitseconds=10")
    assert got.status_code == 200, got.text
    assert "<MessageBody>poison</MessageBody>" in got.text
    attrs = request(base, "GET", "/queues/work")
    assert "<DeadLetterTargetQueue>dlq</DeadLetterTargetQueue>" in attrs.text


def test_queues_and_unacked_messages_survive_a_restart(tmp_path: Path) -> None:
    with start(tmp_path) as server:
        account = Account(endpoint(server), ACCESS_KEY, SECRET_KEY)
        queue = make_queue(account, "durable", vis_timeout=1, polling_wait_sec=2)
        queue.send_message(Message("kept"))
        queue.send_message(Message("taken"))
        first = queue.receive_message(0)
        queue.delete_message(first.receipt_handle)
        second = queue.receive_message(0)  # not deleted
    with start(tmp_path) as server:
        queue = Account(endpoint(server), ACCESS_KEY, SECRET_KEY).get_queue("durable")
        meta = queue.get_attributes()
        assert (meta.visibility_timeout, meta.polling_wait_seconds) == (1, 2)
        again = queue.receive_message(10)
        assert again.message_id == second.message_id and again.dequeue_count == 2
        queue.delete_message(again.receipt_handle)
        with pytest.raises(MNSServerException) as err:
            queue.receive_message(0)
        assert err.value.type == "MessageNotExist"


def test_queue_level_delay_and_polling_wait_apply_by_default(account: Account) -> None:
    queue = make_queue(account, "defaults", delay_sec=2, polling_wait_sec=1)
    queue.send_message(Message("held back"))
    start_at = time.monotonic()
    with pytest.raises(MNSServerException) as err:
        queue.receive_message()  # no waitseconds: the queue's PollingWaitSeconds
    assert err.value.type == "MessageNotExist"
    assert time.monotonic() - start_at >= 0.9
    assert queue.receive_message(10).message_body == b"held back"
