"""A server killed with SIGKILL keeps what MNS acknowledged: every message whose
SendMessage returned, every DeleteMessage, and a ChangeMessageVisibility (the message
received but not deleted comes back when its new visibility runs out)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message, QueueMeta

from tests.crash_server import crash_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUEUE = "crash-durable"
COUNT = 10
DELETED = 3
TIMEOUT_S = 30.0


def _account(port: int) -> Account:
    # The server runs in open auth mode: any access key, signature unchecked.
    return Account(f"http://127.0.0.1:{port}", "crash-ak", "crash-sk")


def test_sent_and_deleted_messages_survive_a_sigkill(tmp_path: Path) -> None:
    with crash_server(tmp_path, "http") as port:
        queue = _account(port).get_queue(QUEUE)
        queue.create(QueueMeta(vis_timeout=60))
        sent = {queue.send_message(Message(f"m{i}")).message_id for i in range(COUNT)}
        received = [queue.receive_message(1) for _ in range(DELETED + 1)]
        for message in received[:DELETED]:
            queue.delete_message(message.receipt_handle)
        kept = received[DELETED]
        queue.change_message_visibility(kept.receipt_handle, 1)
        # killed here: DELETED gone, one received and due back in a second, the rest ready
    deleted = {message.message_id for message in received[:DELETED]}
    with crash_server(tmp_path, "http") as port:
        queue = _account(port).get_queue(QUEUE)
        got: dict[str, int] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < COUNT - DELETED and time.monotonic() < deadline:
            try:
                message = queue.receive_message(1)
            except MNSServerException as e:
                assert e.type == "MessageNotExist", e
                continue
            got[message.message_id] = message.dequeue_count
            queue.delete_message(message.receipt_handle)
        with pytest.raises(MNSServerException) as empty:
            queue.receive_message(1)
        assert empty.value.type == "MessageNotExist"
    assert set(got) == sent - deleted
    assert got[kept.message_id] == 2
