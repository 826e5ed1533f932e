"""ReceiveMessage details the official clients only reach on failures: a retried
receive (same attempt id) is answered with the same messages."""

from __future__ import annotations

from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from tests.live_server import LiveServer
from tests.rocketmq.conftest import raw_message, raw_stub, signed, unique


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
        ack = stub.AckMessage(
            service_pb2.AckMessageRequest(
                group=definition_pb2.Resource(name=group),
                topic=definition_pb2.Resource(name=topic),
                entries=[
                    service_pb2.AckMessageEntry(
                        message_id=first.system_properties.message_id,
                        receipt_handle=first.system_properties.receipt_handle,
                    )
                ],
            ),
            metadata=signed(),
        )
        assert ack.status.code == Code.OK
