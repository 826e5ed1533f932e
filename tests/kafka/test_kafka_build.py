"""Responses are built from plain mappings (``codec.build``) for every request; how each
field's value is shaped is worked out once per entity class and type, since inspecting
the type hints per field per response cost more than the rest of a fetch's answer."""

from __future__ import annotations

import datetime
import typing

import pytest
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka import codec
from polymq.protocols.kafka.codec import build, encode_response, response_class

FETCH, FETCH_VERSION = 1, 11


def _fetch_answer(records: bytes) -> dict[str, typing.Any]:
    return {
        "throttle_time": 7,
        "error_code": ErrorCode.none,
        "session_id": 0,
        "responses": [
            {
                "topic": "t",
                "partitions": [
                    {
                        "partition_index": 0,
                        "error_code": ErrorCode.none,
                        "high_watermark": 5,
                        "last_stable_offset": 5,
                        "log_start_offset": 0,
                        "aborted_transactions": None,
                        "records": records,
                    }
                ],
            }
        ],
    }


def test_nested_mappings_become_entities_and_left_out_fields_their_zero() -> None:
    cls = response_class(FETCH, FETCH_VERSION)
    body = build(cls, _fetch_answer(b"abc"))
    assert body.throttle_time == datetime.timedelta(milliseconds=7)
    (topic,) = body.responses
    (partition,) = topic.partitions
    assert type(partition).__name__ == "PartitionData"
    assert partition.records == b"abc" and partition.aborted_transactions is None
    assert partition.preferred_read_replica == -1  # its default
    empty = build(cls, {})
    assert empty.responses == () and empty.error_code is ErrorCode.none
    # an entity left out is built afresh each time, never shared between responses
    assert build(cls, {}) == empty


def test_types_are_inspected_once_per_class(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = response_class(FETCH, FETCH_VERSION)
    first = encode_response(FETCH, FETCH_VERSION, 1, build(cls, _fetch_answer(b"one")))

    def inspected(*_: object) -> typing.NoReturn:
        raise AssertionError("type hints inspected again for a class already built")

    monkeypatch.setattr(typing, "get_origin", inspected)
    monkeypatch.setattr(typing, "get_args", inspected)
    monkeypatch.setattr(typing, "get_type_hints", inspected)
    monkeypatch.setattr(codec, "fields", inspected)
    again = encode_response(FETCH, FETCH_VERSION, 1, build(cls, _fetch_answer(b"one")))
    assert again == first
