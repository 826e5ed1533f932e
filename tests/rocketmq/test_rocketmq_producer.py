"""rocketmq-python-client's Producer against polymq: normal, async, FIFO, delay,
recall and transactions (commit, rollback, check-back)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq import TransactionChecker, TransactionResolution
from rocketmq.v5.exception import ClientException

from polymq.storage.model import GroupConfig, MessageType, QueueRef, TopicConfig
from tests.live_server import LiveServer, live_server
from tests.rocketmq.conftest import (
    ADMIN,
    TEST_OPTIONS,
    create_topic,
    factory,
    message,
    producer,
    receive_all,
    set_group,
    simple_consumer,
    unique,
    wait_until,
)


def test_send_carries_tag_keys_properties(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        sent = message(topic, b"hello", tag="a", keys="k1", properties={"p": "v"})
        receipt = p.send(sent)
        assert receipt.message_id
        [got] = receive_all(c, 1)
        c.ack(got)
    assert got.body == b"hello"
    assert got.tag == "a"
    assert "k1" in got.keys
    assert got.properties["p"] == "v"
    assert got.message_id == receipt.message_id
    assert got.delivery_attempt == 1
    assert got.born_host
    info = server.call(lambda: server.gateway.processor.describe_topic(ADMIN, topic))
    assert info.config.queue_count == 8
    assert info.config.message_type is MessageType.NORMAL


def test_send_async_many(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        futures = [p.send_async(message(topic, f"m{i}".encode())) for i in range(50)]
        ids = {f.result(timeout=30).message_id for f in futures}
        assert len(ids) == 50
        got = receive_all(c, 50)
        for m in got:
            c.ack(m)
    assert sorted(m.body for m in got) == sorted(f"m{i}".encode() for i in range(50))
    assert {m.message_id for m in got} == ids


def test_fifo_group_held_until_ack(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(fifo=True))
    with producer(server, topic) as p:
        for i in range(3):
            p.send(message(topic, f"a{i}".encode(), message_group="A"))
            p.send(message(topic, f"b{i}".encode(), message_group="B"))
    info = server.call(lambda: server.gateway.processor.describe_topic(ADMIN, topic))
    assert info.config.message_type is MessageType.FIFO
    order: dict[str, list[bytes]] = {"A": [], "B": []}
    with simple_consumer(server, group, topic) as c:
        for _ in range(3):
            batch = receive_all(c, 2)
            # one message per group at a time: the next waits for the ack
            assert sorted(m.message_group for m in batch) == ["A", "B"]
            for m in batch:
                order[m.message_group].append(m.body)
                c.ack(m)
    assert order == {"A": [b"a0", b"a1", b"a2"], "B": [b"b0", b"b1", b"b2"]}


def test_delay_message_visible_at_its_time(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        due_s = int(time.time()) + 2
        receipt = p.send(message(topic, b"later", delivery_timestamp=due_s))
        assert receipt.recall_handle
        [got] = receive_all(c, 1)
        assert time.time() >= due_s - 0.05  # never before its time (ms precision)
        assert got.delivery_timestamp == due_s * 1000
        c.ack(got)
    info = server.call(lambda: server.gateway.processor.describe_topic(ADMIN, topic))
    assert info.config.message_type is MessageType.DELAY


def test_recall_delayed_message(server: LiveServer) -> None:
    topic = unique("t")
    with producer(server, topic) as p:
        receipt = p.send(message(topic, b"never", delivery_timestamp=int(time.time()) + 3600))
        assert p.recall_message(topic, receipt.recall_handle) == receipt.message_id
        with pytest.raises(ClientException):
            p.recall_message(topic, receipt.recall_handle)  # nothing pending any more
    pending = server.call(
        lambda: server.gateway.processor.cancel_delayed(ADMIN, receipt.message_id)
    )
    assert pending is False


class Checker(TransactionChecker):  # type: ignore[misc]
    def __init__(self, resolution: Any) -> None:
        self.resolution = resolution
        self.checked: list[str] = []
        self.event = threading.Event()

    def check(self, message: Any) -> Any:
        self.checked.append(message.message_id)
        self.event.set()
        return self.resolution


@pytest.fixture
def no_check_server(tmp_path: Path) -> Iterator[LiveServer]:
    """Check-backs far off, so only the producer decides."""
    options = dataclasses.replace(TEST_OPTIONS, transaction_check_interval_ms=3_600_000)
    with live_server(tmp_path, ("rocketmq",), factories={"rocketmq": factory(options)}) as live:
        yield live


@pytest.mark.parametrize("commit", [True, False])
def test_transaction_commit_and_rollback(no_check_server: LiveServer, commit: bool) -> None:
    server = no_check_server
    topic, group = unique("t"), unique("g")
    checker = Checker(TransactionResolution.ROLLBACK)
    with producer(server, topic, checker=checker) as p, simple_consumer(server, group, topic) as c:
        tx = p.begin_transaction()
        p.send(message(topic, b"half"), tx)
        assert c.receive(32, 5) == []  # a half is invisible
        if commit:
            tx.commit()
            [got] = receive_all(c, 1)
            assert got.body == b"half"
            c.ack(got)
        else:
            tx.rollback()
            assert c.receive(32, 5) == []
    assert checker.checked == []
    undecided = server.call(lambda: server.gateway.processor.list_undecided(ADMIN))
    assert undecided == []
    info = server.call(lambda: server.gateway.processor.describe_topic(ADMIN, topic))
    assert info.config.message_type is MessageType.TRANSACTION


def test_transaction_check_back_commits(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    checker = Checker(TransactionResolution.COMMIT)
    with producer(server, topic, checker=checker) as p, simple_consumer(server, group, topic) as c:
        tx = p.begin_transaction()
        receipt = p.send(message(topic, b"orphan"), tx)  # neither committed nor rolled back
        assert checker.event.wait(30)
        assert checker.checked[0] == receipt.message_id
        [got] = receive_all(c, 1)
        assert got.body == b"orphan"
        c.ack(got)


def test_transaction_check_back_unknown_then_rolled_back(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    unknown = TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED
    checker = Checker(unknown)
    with producer(server, topic, checker=checker) as p, simple_consumer(server, group, topic) as c:
        tx = p.begin_transaction()
        p.send(message(topic, b"undecided"), tx)
        # asked again after each "unknown", then given up on (3 checks in the tests)
        wait_until(lambda: not server.call(lambda: server.gateway.processor.list_undecided(ADMIN)))
        wait_until(lambda: len(checker.checked) >= 3)
        assert len(checker.checked) == 3
        assert c.receive(32, 5) == []  # rolled back, never delivered


def test_sent_message_as_other_protocols_read_it(server: LiveServer) -> None:
    topic = unique("t")
    create_topic(server, topic, TopicConfig(queue_count=1))
    with producer(server, topic) as p:
        fields = {"content-type": "text/plain", "correlation-id": "c-9", "app": "x"}
        p.send(message(topic, b"out", tag="t1", keys="k1", properties=fields))
    result = server.call(
        lambda: server.gateway.processor.read(ADMIN, QueueRef("default", topic, 0), 0)
    )
    [stored] = result.messages
    sent = stored.message
    assert (sent.body, sent.tag, sent.key) == (b"out", "t1", b"k1")
    assert (sent.content_type, sent.correlation_id) == ("text/plain", b"c-9")
    assert sent.properties == (("app", b"x"),)
    assert sent.born_host and sent.born_timestamp_ms
