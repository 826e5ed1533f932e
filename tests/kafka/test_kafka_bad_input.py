"""Bad input gets Kafka's own error, closes at most its own connection, and the server
keeps serving everyone else."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka.listener import kafka_listener
from polymq.protocols.kafka.records import KafkaRecord, encode_batch
from tests.kafka.raw import RawKafka, batch_with_body
from tests.live_server import LiveServer, live_server


def _still_serving(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as client:
        response = client.request(
            18, 3, {"client_software_name": "t", "client_software_version": "1"}
        )
        assert response.error_code is ErrorCode.none
        assert {k.api_key for k in response.api_keys} >= {0, 1, 2, 3, 18}


def _produce(client: RawKafka, topic: str, records: bytes, acks: int = -1) -> Any:
    body = {
        "transactional_id": None,
        "acks": acks,
        "timeout": 5000,
        "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": records}]}],
    }
    return client.request(0, 9, body)


def _metadata(client: RawKafka, topic: str, create: bool) -> object:
    body = {"topics": [{"name": topic}], "allow_auto_topic_creation": create}
    return client.request(3, 12, body)


def _batch() -> bytes:
    return encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=1, key=None, value=b"x")])


def test_garbage_closes_only_that_connection(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as bad:
        bad.send_bytes(struct.pack(">i", 12) + b"\xff" * 12)
        assert bad.closed_by_server()
    _still_serving(server)


def test_oversized_frame_closes_the_connection(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as bad:
        bad.send_bytes(struct.pack(">i", 2**31 - 1) + b"\x00" * 16)
        assert bad.closed_by_server()
    _still_serving(server)


def test_truncated_request_closes_the_connection(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as bad:
        frame = bad.frame(3, 12, {"topics": None, "allow_auto_topic_creation": False})
        # The size counts one byte fewer than the body: the request does not decode.
        bad.send_bytes(struct.pack(">i", len(frame) - 5) + frame[4:-1])
        assert bad.closed_by_server()
    with RawKafka(*server.address("kafka")) as half:
        half.send_bytes(struct.pack(">i", 100) + b"\x00\x03\x00")  # then the peer goes away
    _still_serving(server)


def test_unknown_api_versions(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as client:
        # ApiVersions of a version from the future: answered in v0 with error 35.
        frame = bytearray(client.frame(18, 3, {}))
        struct.pack_into(">h", frame, 6, 99)
        client.send_bytes(bytes(frame))
        response = client.response(18, 0)
        assert response.error_code is ErrorCode.unsupported_version
        assert any(k.api_key == 0 for k in response.api_keys)
        # A version kio knows but we do not serve: the API's own error field says 35.
        # (AlterPartitionReassignments v0: its response has a top-level error code.)
        assert client.request(45, 0, {}).error_code is ErrorCode.unsupported_version
    with RawKafka(*server.address("kafka")) as client:
        frame = bytearray(client.frame(18, 0, {}))
        struct.pack_into(">h", frame, 4, 999)  # an API key nobody knows
        client.send_bytes(bytes(frame))
        assert client.closed_by_server()
    _still_serving(server)


def test_corrupt_crc_is_corrupt_message(server: LiveServer, topic: str) -> None:
    batch = bytearray(_batch())
    batch[-1] ^= 0xFF
    with RawKafka(*server.address("kafka")) as client:
        _metadata(client, topic, True)
        response = _produce(client, topic, bytes(batch))
        partition = response.responses[0].partition_responses[0]
        assert partition.error_code is ErrorCode.corrupt_message
        bad_records = _produce(client, topic, batch_with_body(4, b"not zstd", 1))
        assert bad_records.responses[0].partition_responses[0].error_code is (
            ErrorCode.corrupt_message
        )
        # The connection goes on: a good batch after it is stored.
        good = _produce(client, topic, _batch()).responses[0].partition_responses[0]
        assert good.error_code is ErrorCode.none and good.base_offset == 0


def test_acks_zero_gets_no_response(server: LiveServer, topic: str) -> None:
    with RawKafka(*server.address("kafka")) as client:
        _metadata(client, topic, True)
        client.send_bytes(
            client.frame(
                0,
                9,
                {
                    "acks": 0,
                    "timeout": 5000,
                    "topic_data": [
                        {"name": topic, "partition_data": [{"index": 0, "records": _batch()}]}
                    ],
                },
            )
        )
        metadata = client.request(
            3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": False}
        )
        assert metadata.topics[0].error_code is ErrorCode.none
        listed = client.request(
            2,
            7,
            {
                "replica_id": -1,
                "isolation_level": 0,
                "topics": [
                    {"name": topic, "partitions": [{"partition_index": 0, "timestamp": -1}]}
                ],
            },
        )
        assert listed.topics[0].partitions[0].offset == 1


@pytest.fixture(scope="module")
def strict_server(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("kafka-strict")
    with live_server(
        data_dir,
        ("kafka",),
        overrides={"kafka.auto_create_topics": "false", "kafka.default_partitions": "3"},
        factories={"kafka": kafka_listener},
    ) as live:
        yield live


def test_unknown_topic_with_auto_create_off(strict_server: LiveServer, topic: str) -> None:
    with RawKafka(*strict_server.address("kafka")) as client:
        metadata = client.request(
            3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True}
        )
        assert metadata.topics[0].error_code is ErrorCode.unknown_topic_or_partition
        response = _produce(client, topic, _batch())
        partition = response.responses[0].partition_responses[0]
        assert partition.error_code is ErrorCode.unknown_topic_or_partition
    _still_serving(strict_server)


def test_invalid_acks_is_refused(server: LiveServer, topic: str) -> None:
    with RawKafka(*server.address("kafka")) as client:
        _metadata(client, topic, True)
        partition = _produce(client, topic, _batch(), acks=2).responses[0].partition_responses[0]
        assert partition.error_code is ErrorCode.invalid_required_acks


def test_topics_of_other_protocols_are_not_listed(server: LiveServer) -> None:
    engine = server.gateway.storage
    server.call(lambda: engine.create_topic("default", "amqp:orders"))
    with RawKafka(*server.address("kafka")) as client:
        listed = client.request(3, 12, {"topics": None, "allow_auto_topic_creation": False})
        assert "amqp:orders" not in {t.name for t in listed.topics}
        asked: Any = _metadata(client, "amqp:orders", False)
        assert asked.topics[0].error_code is ErrorCode.none  # still reachable by name


def test_default_partitions_apply_to_created_topics(strict_server: LiveServer, topic: str) -> None:
    with RawKafka(*strict_server.address("kafka")) as client:
        body = {
            "topics": [{"name": topic, "num_partitions": -1, "replication_factor": -1}],
            "timeout": 5000,
        }
        created = client.request(19, 7, body).topics[0]
        assert (created.error_code, created.num_partitions) == (ErrorCode.none, 3)
        metadata: Any = _metadata(client, topic, False)
        assert len(metadata.topics[0].partitions) == 3


def test_out_of_range_session_timeout(server: LiveServer) -> None:
    with RawKafka(*server.address("kafka")) as client:
        body = {
            "group_id": "g-bad-timeout",
            "session_timeout": 10,
            "rebalance_timeout": 10,
            "member_id": "",
            "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b""}],
        }
        assert client.request(11, 7, body).error_code is ErrorCode.invalid_session_timeout
