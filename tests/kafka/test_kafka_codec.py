"""The framing codec: every API version we advertise has a response we can build from
a partial dict and that decodes back; request headers decode; bad frames are typed."""

from __future__ import annotations

import io
import struct
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

from polymq.protocols.kafka.codec import (
    BadRequest,
    UnsupportedVersion,
    build,
    decode_request,
    encode_response,
    request_class,
    response_class,
)
from polymq.protocols.kafka.versions import SUPPORTED

ADVERTISED = [
    (key, version) for key, (low, high) in SUPPORTED.items() for version in range(low, high + 1)
]


@pytest.mark.parametrize(("api_key", "version"), ADVERTISED)
def test_every_advertised_response_builds_and_decodes(api_key: int, version: int) -> None:
    cls = response_class(api_key, version)
    body = build(cls, {"error_code": ErrorCode.none, "throttle_time": 0})
    frame = encode_response(api_key, version, 7, body)
    (size, correlation) = struct.unpack_from(">ii", frame)
    assert size == len(frame) - 4 and correlation == 7
    offset = 8 + (1 if cls.__flexible__ and api_key != 18 else 0)
    decoded, used = entity_reader(cls)(frame, offset)
    assert decoded == body and offset + used == len(frame)


@pytest.mark.parametrize(("api_key", "version"), ADVERTISED)
def test_every_advertised_request_decodes(api_key: int, version: int) -> None:
    cls: Any = request_class(api_key, version)
    header_cls = cls.__header_schema__
    header = build(
        header_cls,
        {"request_api_key": api_key, "request_api_version": version, "correlation_id": 3},
    )
    buffer = io.BytesIO()
    entity_writer(header_cls)(buffer, header)
    entity_writer(cls)(buffer, build(cls, {}))
    request = decode_request(buffer.getvalue())
    assert (request.api_key, request.api_version, request.correlation_id) == (api_key, version, 3)
    assert request.body == build(cls, {})


def test_unknown_versions_and_bad_bytes_are_typed() -> None:
    with pytest.raises(UnsupportedVersion) as raised:
        decode_request(struct.pack(">hhi", 18, 99, 5) + b"\x00\x00")
    assert (raised.value.api_key, raised.value.correlation_id) == (18, 5)
    with pytest.raises(BadRequest):
        decode_request(b"\x00\x03")
    with pytest.raises(BadRequest):
        decode_request(struct.pack(">hhi", 3, 12, 1) + b"\xff\xff\xff")
