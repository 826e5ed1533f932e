"""Offset-mode RPCs (PullMessage, UpdateOffset, GetOffset, QueryOffset) through a raw
stub: rocketmq-python-client 5.1.2 has no pull consumer."""

from __future__ import annotations

from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.storage.model import TopicConfig
from tests.live_server import LiveServer
from tests.rocketmq.conftest import create_topic, raw_message, raw_stub, signed, unique


def queue(topic: str) -> Any:
    mq = definition_pb2.MessageQueue(id=0)
    mq.topic.name = topic
    return mq


def test_pull_and_offsets(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    create_topic(server, topic, TopicConfig(queue_count=1))
    resource = definition_pb2.Resource
    with raw_stub(server) as stub:
        for i in range(3):
            request = service_pb2.SendMessageRequest(
                messages=[raw_message(topic, f"m{i}".encode())]
            )
            assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK

        def query(policy: int) -> int:
            answer = stub.QueryOffset(
                service_pb2.QueryOffsetRequest(
                    message_queue=queue(topic), query_offset_policy=policy
                ),
                metadata=signed(),
            )
            assert answer.status.code == Code.OK
            return int(answer.offset)

        assert query(definition_pb2.BEGINNING) == 0
        assert query(definition_pb2.END) == 3

        pull = service_pb2.PullMessageRequest(
            group=resource(name=group), message_queue=queue(topic), offset=1, batch_size=10
        )
        answers = list(stub.PullMessage(pull, metadata=signed(), timeout=10))
        assert answers[0].status.code == Code.OK
        bodies = [a.message.body for a in answers if a.HasField("message")]
        assert bodies == [b"m1", b"m2"]
        assert answers[-1].next_offset == 3

        get = service_pb2.GetOffsetRequest(group=resource(name=group), message_queue=queue(topic))
        assert stub.GetOffset(get, metadata=signed()).status.code == Code.OFFSET_NOT_FOUND
        update = service_pb2.UpdateOffsetRequest(
            group=resource(name=group), message_queue=queue(topic), offset=3
        )
        assert stub.UpdateOffset(update, metadata=signed()).status.code == Code.OK
        got = stub.GetOffset(get, metadata=signed())
        assert (got.status.code, got.offset) == (Code.OK, 3)

        pull.offset = 3
        pull.long_polling_timeout.nanos = 100_000_000
        answers = list(stub.PullMessage(pull, metadata=signed(), timeout=10))
        assert answers[0].status.code == Code.MESSAGE_NOT_FOUND
        assert answers[-1].next_offset == 3
