"""What storage's queue state gives MNS queues, through the real aliyun-mns-sdk: an
exact PeekMessage head, DelayMessages, unmetered peeks, and space reclaimed after
deletes."""

from __future__ import annotations

import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message, Queue, QueueMeta

from polymq.protocols.mns.reclaim import RECLAIM_EVERY
from polymq.storage.model import QueueOffsets, QueueRef
from tests.live_server import LiveServer
from tests.mns.harness import NAMESPACE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def make_queue(account: Account, name: str, **meta: int) -> Queue:
    queue = account.get_queue(name)
    queue.create(QueueMeta(**meta))
    return queue


def offsets(server: LiveServer, name: str) -> QueueOffsets:
    storage = server.gateway.processor._storage
    return server.call(lambda: storage.queue_offsets(QueueRef(NAMESPACE, name)))


def test_peek_starts_at_the_first_message_not_deleted(account: Account) -> None:
    queue = make_queue(account, "peek-head")
    for body in ("a", "b", "c"):
        queue.send_message(Message(body))
    first = queue.receive_message(0)
    second = queue.receive_message(0)
    assert (first.message_body, second.message_body) == (b"a", b"b")
    queue.delete_message(second.receipt_handle)  # out of order: "a" is still there
    assert queue.peek_message().message_body == b"a"
    queue.delete_message(first.receipt_handle)
    assert [m.message_body for m in queue.batch_peek_message(16)] == [b"c"]
    queue.delete_message(queue.receive_message(0).receipt_handle)
    with pytest.raises(MNSServerException) as err:
        queue.peek_message()
    assert err.value.type == "MessageNotExist"


def test_peeks_are_not_metered_as_deliveries(account: Account, server: LiveServer) -> None:
    queue = make_queue(account, "peek-meter")
    queue.batch_send_message([Message(f"m{i}") for i in range(4)])
    assert len(queue.batch_peek_message(4)) == 4
    queue.peek_message()

    def delivered() -> int:
        return sum(
            u.messages_out
            for u in server.gateway.metering.snapshot()
            if u.namespace == NAMESPACE and u.protocol == "http"
        )

    assert delivered() == 0
    queue.receive_message(0)
    assert delivered() == 1


def test_delay_messages_counts_messages_not_yet_due(account: Account) -> None:
    queue = make_queue(account, "delays")
    queue.send_message(Message("now"))
    late = Message("later")
    late.set_delayseconds(60)
    queue.send_message(late)
    queue.batch_send_message([Message("later too", delay_seconds=120)])
    meta = queue.get_attributes()
    assert (meta.active_messages, meta.delay_messages) == (1, 2)


def test_deletes_reclaim_the_queue_prefix(account: Account, server: LiveServer) -> None:
    queue = make_queue(account, "reclaim")
    total = RECLAIM_EVERY + 16
    for start in range(0, total, 16):
        queue.batch_send_message([Message(f"m{start + i}") for i in range(16)])
    deleted = 0
    while deleted < RECLAIM_EVERY - 16:
        got = queue.batch_receive_message(16, 1)
        queue.batch_delete_message([m.receipt_handle for m in got])
        deleted += len(got)
    assert offsets(server, "reclaim") == QueueOffsets(0, total)  # not per delete
    for m in queue.batch_receive_message(16, 1):
        queue.delete_message(m.receipt_handle)  # single deletes count as well
        deleted += 1
    assert deleted == RECLAIM_EVERY
    assert offsets(server, "reclaim") == QueueOffsets(RECLAIM_EVERY, total)
    # What is left is whole and still in order.
    assert queue.peek_message().message_body == f"m{RECLAIM_EVERY}".encode()
    assert queue.get_attributes().active_messages == 16
