"""ReceiveMessage details the official clients only reach on failures or timing: a
retried receive (same attempt id) is answered with the same messages; a receive
waiting in its long poll is handed the next message of a FIFO group when the previous
one is acked."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.storage.errors import TopicNotFound
from polymq.storage.model import DEFAULT_NAMESPACE, GroupConfig
from tests.live_server import LiveServer, live_server
from tests.rocketmq.conftest import (
    TEST_OPTIONS,
    factory,
    raw_message,
    raw_stub,
    set_group,
    signed,
    unique,
    wait_until,
)

# Far longer than any wait of the test: a receive answered before it ends was woken.
_LONG_POLL_S = 600


def test_retried_attempt_gets_the_same_messages(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with raw_stub(server) as stub:
        request = service_pb2.SendMessageRequest(messages=[raw_message(topic, b"once")])
        assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK

        def receive(attempt_id: str) -> list[Any]:
            request = service_pb2.ReceiveMessageRequest(
                group=definition_pb2.Resource(name=group),
                batch_size=8,
                auto_renew=True,
                attempt_id=attempt_id,
            )
            request.message_queue.topic.name = topic
            request.long_polling_timeout.seconds = 1
            answers = stub.ReceiveMessage(request, metadata=signed(), timeout=10)
            return [a.message for a in answers if a.HasField("message")]

        [first] = receive("attempt-1")
        [again] = receive("attempt-1")  # the client lost the first answer and retries
        assert again.system_properties.message_id == first.system_properties.message_id
        assert again.system_properties.receipt_handle == first.system_properties.receipt_handle
        assert receive("attempt-2") == []  # a new attempt: the message is in flight
        assert ack(stub, group, topic, first).status.code == Code.OK


def ack(stub: Any, group: str, topic: str, message: Any) -> Any:
    return stub.AckMessage(
        service_pb2.AckMessageRequest(
            group=definition_pb2.Resource(name=group),
            topic=definition_pb2.Resource(name=topic),
            entries=[
                service_pb2.AckMessageEntry(
                    message_id=message.system_properties.message_id,
                    receipt_handle=message.system_properties.receipt_handle,
                )
            ],
        ),
        metadata=signed(),
    )


@pytest.fixture
def long_poll_server(tmp_path: Path) -> Iterator[LiveServer]:
    options = dataclasses.replace(TEST_OPTIONS, max_long_polling_ms=_LONG_POLL_S * 1000)
    with live_server(tmp_path, ("rocketmq",), factories={"rocketmq": factory(options)}) as live:
        yield live


def pop_waiting(server: LiveServer, topic: str) -> bool:
    """Whether a pop is asleep in storage on one of the topic's queues (the engine's
    own waiter lists: the one way to know the receive is parked, not just sent)."""

    async def check() -> bool:
        for engine in server.engines:
            try:
                queues = engine._state.topic(DEFAULT_NAMESPACE, topic).queues
            except TopicNotFound:
                continue  # another node's engine (the separated form)
            return any(queue.waiters for queue in queues)
        return False

    return server.call(check)


def nack(stub: Any, group: str, topic: str, message: Any) -> Any:
    """ChangeInvisibleDuration to 0: the message is visible again at once."""
    request = service_pb2.ChangeInvisibleDurationRequest(
        group=definition_pb2.Resource(name=group),
        topic=definition_pb2.Resource(name=topic),
        receipt_handle=message.system_properties.receipt_handle,
        message_id=message.system_properties.message_id,
    )
    request.invisible_duration.seconds = 0
    return stub.ChangeInvisibleDuration(request, metadata=signed())


@pytest.mark.parametrize(("release", "expected"), [("ack", b"a2"), ("nack", b"a1")])
def test_waiting_receive_is_handed_the_released_message_of_a_fifo_group(
    long_poll_server: LiveServer, release: str, expected: bytes
) -> None:
    """The receive is one long poll in storage, woken by what releases the group's
    head: the ack (the next message is due) or the nack (the same message is visible
    again). It answers with that message long before its long poll (600 s) could
    end, and never with a message behind it."""
    server = long_poll_server
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(fifo=True))

    def receive(stub: Any) -> list[Any]:
        request = service_pb2.ReceiveMessageRequest(
            group=definition_pb2.Resource(name=group), batch_size=1
        )
        request.message_queue.topic.name = topic
        request.invisible_duration.seconds = _LONG_POLL_S  # no redelivery wakes it either
        request.long_polling_timeout.seconds = _LONG_POLL_S
        answers = stub.ReceiveMessage(request, metadata=signed(), timeout=_LONG_POLL_S + 60)
        return [a.message for a in answers if a.HasField("message")]

    with raw_stub(server) as stub:
        messages = [raw_message(topic, body, message_group="A") for body in (b"a1", b"a2", b"a3")]
        request = service_pb2.SendMessageRequest(messages=messages)
        assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK
        [first] = receive(stub)
        assert first.body == b"a1"
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.extend(receive(stub)), daemon=True)
        waiter.start()
        wait_until(lambda: pop_waiting(server, topic))  # parked: a2 is held back by a1
        assert not got
        settle = ack if release == "ack" else nack
        assert settle(stub, group, topic, first).status.code == Code.OK
        waiter.join(timeout=60)
        assert not waiter.is_alive(), f"the {release} did not wake the waiting receive"
        assert [m.body for m in got] == [expected]
