"""MNS message priority through the real aliyun-mns-sdk: a higher priority (1 is the
highest, 16 the lowest, 8 the default) is received before lower ones already waiting,
with peeks, counters and space reclaim spanning the levels."""

from __future__ import annotations

import threading

import pytest
from mns.account import Account
from mns.queue import Message, Queue, QueueMeta

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols.mns.priority import PRIORITY
from polymq.protocols.mns.reclaim import RECLAIM_EVERY
from polymq.storage.model import AppendRequest, QueueOffsets, QueueRef, TopicConfig
from polymq.storage.model import Message as ModelMessage
from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, NAMESPACE, SECRET_KEY, endpoint
from tests.mns.signed import request

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CALLER = Caller(principal=ANONYMOUS, namespace=NAMESPACE, protocol="kafka")


def make_queue(account: Account, name: str) -> Queue:
    queue = account.get_queue(name)
    queue.create(QueueMeta())
    return queue


def send_all(queue: Queue, priorities: list[int]) -> None:
    for priority in priorities:
        queue.send_message(Message(f"p{priority}", priority=priority))


def test_higher_priority_is_received_first(account: Account) -> None:
    queue = make_queue(account, "prio")
    send_all(queue, [16, 8, 12, 1, 8, 3])
    got = queue.batch_receive_message(16, 0)
    assert [m.message_body for m in got] == [b"p1", b"p3", b"p8", b"p8", b"p12", b"p16"]
    assert [m.priority for m in got] == [1, 3, 8, 8, 12, 16]
    for m in got:
        queue.delete_message(m.receipt_handle)

    # One at a time, too: a later high-priority message overtakes those waiting.
    send_all(queue, [9, 10])
    assert queue.receive_message(0).message_body == b"p9"
    send_all(queue, [2])
    assert queue.receive_message(0).message_body == b"p2"
    assert queue.receive_message(0).message_body == b"p10"


def test_peek_and_counters_span_the_levels(account: Account) -> None:
    queue = make_queue(account, "prio-state")
    send_all(queue, [16, 8, 1])
    late = Message("late", priority=4)
    late.set_delayseconds(60)
    queue.send_message(late)
    assert queue.peek_message().message_body == b"p1"
    assert [m.message_body for m in queue.batch_peek_message(16)] == [b"p1", b"p8", b"p16"]
    meta = queue.get_attributes()
    assert (meta.active_messages, meta.inactive_messages, meta.delay_messages) == (3, 0, 1)
    first = queue.receive_message(0)
    assert first.message_body == b"p1"
    meta = queue.get_attributes()
    assert (meta.active_messages, meta.inactive_messages) == (2, 1)
    queue.delete_message(first.receipt_handle)
    assert queue.peek_message().message_body == b"p8"


def test_long_poll_wakes_for_any_level(account: Account, server: LiveServer) -> None:
    queue = make_queue(account, "prio-poll")
    # The SDK's client holds one connection: the sender needs its own.
    sender = Account(endpoint(server), ACCESS_KEY, SECRET_KEY).get_queue("prio-poll")
    timer = threading.Timer(0.5, lambda: send_all(sender, [13]))
    timer.start()
    try:
        assert queue.receive_message(10).message_body == b"p13"
    finally:
        timer.join()


def test_a_queue_grows_its_levels_on_the_first_prioritised_message(
    account: Account, server: LiveServer
) -> None:
    """A queue starts with one storage queue (as queues made before priorities have):
    what is stored there stays, at the default level, when a message of another
    priority grows it to a storage queue per level."""
    processor = server.gateway.processor
    queue = make_queue(account, "grown")
    queue.set_encoding(False)  # the body stored below is not base64
    send_all(queue, [8])
    old = ModelMessage(body=b"stored before", properties=((PRIORITY, b"16"),))
    server.call(
        lambda: processor.append(
            CALLER, [AppendRequest(entry=old, queues=(QueueRef(NAMESPACE, "grown"),))]
        )
    )
    assert len(server.call(lambda: processor.describe_topic(CALLER, "grown")).queues) == 1
    send_all(queue, [12, 1])
    assert len(server.call(lambda: processor.describe_topic(CALLER, "grown")).queues) == 16
    got = queue.batch_receive_message(16, 0)
    assert [(m.message_body, m.priority) for m in got] == [
        ("p1", 1),
        ("p8", 8),
        ("stored before", 16),  # at the default level, its priority still reported
        ("p12", 12),
    ]


def test_another_protocols_topic_of_several_queues_stays_unprioritised(
    account: Account, server: LiveServer
) -> None:
    processor = server.gateway.processor
    server.call(lambda: processor.create_topic(CALLER, "shared", TopicConfig(queue_count=3)))
    queue = account.get_queue("shared")
    send_all(queue, [16, 1])
    assert len(server.call(lambda: processor.describe_topic(CALLER, "shared")).queues) == 3
    got = queue.batch_receive_message(16, 0)
    assert [(m.message_body, m.priority) for m in got] == [(b"p16", 16), (b"p1", 1)]


def test_fifo_queues_ignore_priority(server: LiveServer) -> None:
    base = endpoint(server)
    body = b"<Queue xmlns='http://mns.aliyuncs.com/doc/v1/'><FifoQueue>true</FifoQueue></Queue>"
    assert request(base, "PUT", "/queues/prio-fifo", body).status_code == 201
    for text, priority in (("g1", 16), ("g2", 1)):
        doc = (
            "<Message xmlns='http://mns.aliyuncs.com/doc/v1/'>"
            f"<MessageBody>{text}</MessageBody><MessageGroupId>g</MessageGroupId>"
            f"<Priority>{priority}</Priority></Message>"
        ).encode()
        assert request(base, "POST", "/queues/prio-fifo/messages", doc).status_code == 201
    got = request(base, "GET", "/queues/prio-fifo/messages?numOfMessages=16")
    assert got.status_code == 200
    assert "<MessageBody>g1</MessageBody>" in got.text  # the group's order, not priority
    assert "<MessageBody>g2</MessageBody>" not in got.text


def test_deletes_reclaim_every_level(account: Account, server: LiveServer) -> None:
    queue = make_queue(account, "prio-reclaim")
    half = RECLAIM_EVERY // 2
    for start in range(0, RECLAIM_EVERY, 16):
        priority = 1 if start < half else 8
        queue.batch_send_message([Message(f"m{start + i}", priority=priority) for i in range(16)])
    deleted = 0
    while deleted < RECLAIM_EVERY:
        got = queue.batch_receive_message(16, 1)
        queue.batch_delete_message([m.receipt_handle for m in got])
        deleted += len(got)
    storage = server.gateway.processor._storage

    def offsets(queue_id: int) -> QueueOffsets:
        return server.call(
            lambda: storage.queue_offsets(QueueRef(NAMESPACE, "prio-reclaim", queue_id))
        )

    assert offsets(1) == QueueOffsets(half, half)  # priority 1
    assert offsets(0) == QueueOffsets(half, half)  # the default, 8
