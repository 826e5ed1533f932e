"""Responses written straight from the handler's dict (``codec.encode_body``, compiled per
class in protocols/kafka/response_writer.py) are byte for byte the frames of the old
path, ``encode_response(..., build(cls, body))``, for every API version we serve: the
empty body, bodies drawn from each class's fields (seeded, so a failure replays), and
the shapes the Produce and Fetch handlers answer with."""

from __future__ import annotations

import collections
import datetime
import random
import types
import typing
import uuid
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka import codec
from polymq.protocols.kafka.codec import build, encode_body, encode_response, response_class
from polymq.protocols.kafka.handlers.topics import api_versions_body
from polymq.protocols.kafka.response_writer import ResponseWriters, Uncompilable
from polymq.protocols.kafka.versions import API_VERSIONS_KEY, SUPPORTED

ONE_FORM = True  # starts no server
SERVED = [
    (key, version) for key, (low, high) in SUPPORTED.items() for version in range(low, high + 1)
]
DRAWS = 12  # random bodies per API version

_INTS = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}
_ERRORS = list(ErrorCode)
_TEXT = "aZ09 _-.üß€中文𝄞🙂"
# Milliseconds on both sides of the fast paths' bounds, and ordinary ones.
_DURATIONS = [0, 1, -1, 7, 30_000, 2**31 - 1, -(2**31), 2**47 - 1, 2**47, 2**50, -(2**48)]
_TIMES = [-1, 0, 1, 1_700_000_000_123, 2**40, 2**47 - 1, 2**47, 2**47 + 999, -(2**40) - 7]


def _old(api_key: int, version: int, correlation_id: int, body: dict[str, Any]) -> bytes:
    cls = response_class(api_key, version)
    return encode_response(api_key, version, correlation_id, build(cls, body))


def _same(api_key: int, version: int, body: dict[str, Any]) -> None:
    new = encode_body(api_key, version, 0x1234567, body)
    assert new == _old(api_key, version, 0x1234567, body), (api_key, version, body)


def _nullable(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def _inner(tp: Any) -> Any:
    return next(a for a in typing.get_args(tp) if a is not type(None)) if _nullable(tp) else tp


class _Draw:
    """Random values for a kio entity's fields, as handlers might give them: plain
    dicts mostly, sometimes a built entity, a mapping that is not a dict, an array
    that is neither list nor tuple, a timedelta where an int is usual."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def body(self, cls: type[Any], depth: int = 0) -> dict[str, Any]:
        rng = self.rng
        out: dict[str, Any] = {}
        for f in fields(cls):
            if rng.random() < 0.2:
                continue  # left out: its default or zero
            if "tag" in f.metadata and f.default is not MISSING and rng.random() < 0.2:
                out[f.name] = f.default  # set to its default: still left out of the frame
                continue
            out[f.name] = self.field(f, depth)
        if rng.random() < 0.3:
            out["not_in_this_version"] = rng.random()
        return out

    def field(self, f: Field[Any], depth: int) -> Any:
        nullable = _nullable(f.type)
        tp = _inner(f.type)
        if nullable and self.rng.random() < 0.25:
            return None
        if typing.get_origin(tp) is tuple:
            return self.array(f, _inner(typing.get_args(tp)[0]), depth)
        return self.value(f, tp, depth)

    def array(self, f: Field[Any], item: Any, depth: int) -> Any:
        rng = self.rng
        if rng.random() < 0.1:
            return None  # written as a null array, nullable or not, as kio does
        count = rng.choice([0, 1, 3] if depth < 3 else [0, 1])
        if not is_dataclass(item) and rng.random() < 0.1:
            count = 130  # a two-byte compact length
        items = [self.value(f, item, depth + 1) for _ in range(count)]
        return rng.choice([list, tuple, collections.deque])(items)

    def value(self, f: Field[Any], tp: Any, depth: int) -> Any:
        rng = self.rng
        if isinstance(tp, type) and is_dataclass(tp):
            nested = self.body(tp, depth + 1)
            roll = rng.random()
            if roll < 0.15:
                return build(tp, nested)  # already an entity: passed through as it is
            return types.MappingProxyType(nested) if roll < 0.25 else nested
        kind = f.metadata["kafka_type"]
        if kind in _INTS:
            low, high = _INTS[kind]
            return rng.choice([low, high, 0, -1 if low else 1, rng.randint(low, high)])
        if kind == "error_code":
            return rng.choice(_ERRORS)
        if kind.startswith("timedelta"):
            limit = 2**31 if kind == "timedelta_i32" else 2**62
            ms = rng.choice([d for d in _DURATIONS if -limit <= d < limit])
            if abs(ms) < 2**30 and rng.random() < 0.2:
                return datetime.timedelta(milliseconds=ms, microseconds=600)  # rounds up
            return ms
        if kind == "datetime_i64":
            ms = rng.choice(_TIMES)
            if rng.random() < 0.2:
                return datetime.datetime.fromtimestamp(abs(ms) / 1000, datetime.UTC)
            return ms
        return self.scalar(kind)

    def scalar(self, kind: str) -> Any:
        rng = self.rng
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "float64":
            return rng.uniform(-1e9, 1e9)
        if kind == "uuid":
            return uuid.UUID(int=rng.getrandbits(128))
        size = rng.choice([0, 1, 5, 126, 127, 200])
        if kind == "string":
            return "".join(rng.choice(_TEXT) for _ in range(size))
        return rng.randbytes(size)


@pytest.mark.parametrize(("api_key", "version"), SERVED)
def test_every_served_response_writes_the_old_paths_bytes(api_key: int, version: int) -> None:
    cls = response_class(api_key, version)
    _same(api_key, version, {})
    _same(api_key, version, {"error_code": ErrorCode.unsupported_version, "throttle_time": 9})
    draw = _Draw(api_key * 100 + version)
    for _ in range(DRAWS):
        _same(api_key, version, draw.body(cls))


@pytest.mark.parametrize(("api_key", "version"), SERVED)
def test_every_served_response_is_compiled(api_key: int, version: int) -> None:
    """No class falls back to build and kio's writer."""
    cls = response_class(api_key, version)
    writers = ResponseWriters(build)
    frame = writers.frame(cls, bool(cls.__flexible__) and api_key != API_VERSIONS_KEY)
    assert frame(3, {}) == _old(api_key, version, 3, {})


def _produce_answer(partitions: int, error: ErrorCode | int = ErrorCode.none) -> dict[str, Any]:
    """What handlers/produce.py answers."""
    return {
        "responses": [
            {
                "name": "orders",
                "partition_responses": [
                    {
                        "index": p,
                        "error_code": error,
                        "error_message": None if error is ErrorCode.none else "too large",
                        "base_offset": 1_000 + p if error is ErrorCode.none else -1,
                        "log_start_offset": -1,
                        "record_errors": [],
                    }
                    for p in range(partitions)
                ],
            }
        ],
        "throttle_time": 0,
    }


def _fetch_answer(
    records: bytes | memoryview, committed_only: bool, partitions: int = 1
) -> dict[str, Any]:
    """What handlers/fetch.py answers."""
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "session_id": 0,
        "responses": [
            {
                "topic": "orders",
                "partitions": [
                    {
                        "partition_index": p,
                        "error_code": ErrorCode.none,
                        "high_watermark": 42,
                        "last_stable_offset": 40,
                        "log_start_offset": 0,
                        "aborted_transactions": [{"producer_id": 7, "first_offset": 3}]
                        if committed_only
                        else None,
                        "preferred_read_replica": -1,
                        "records": records,
                    }
                    for p in range(partitions)
                ],
            }
        ],
    }


@pytest.mark.parametrize("version", range(SUPPORTED[0][0], SUPPORTED[0][1] + 1))
def test_produce_answers(version: int) -> None:
    for partitions in (0, 1, 3):
        _same(0, version, _produce_answer(partitions))
    _same(0, version, _produce_answer(2, ErrorCode.message_too_large))
    throttled = _produce_answer(1)
    throttled["throttle_time"] = 250  # as connection._answer re-encodes a throttled one
    _same(0, version, throttled)


@pytest.mark.parametrize("version", range(SUPPORTED[1][0], SUPPORTED[1][1] + 1))
def test_fetch_answers(version: int) -> None:
    rng = random.Random(version)
    for size in (0, 100, 126, 127, 20_000):
        for committed_only in (False, True):
            _same(1, version, _fetch_answer(rng.randbytes(size), committed_only))
    _same(1, version, _fetch_answer(rng.randbytes(5_000), False, partitions=3))
    _same(1, version, _fetch_answer(memoryview(rng.randbytes(100)), False))
    _same(1, version, _fetch_answer(memoryview(rng.randbytes(9_000)), False))


def test_api_versions_answers_in_header_v0() -> None:
    for version in range(SUPPORTED[18][0], SUPPORTED[18][1] + 1):
        _same(18, version, api_versions_body())
        _same(18, version, api_versions_body(ErrorCode.unsupported_version))


def test_a_set_tagged_field_is_written_and_a_default_one_left_out() -> None:
    """Fetch v12's partition tags: the current leader set, the snapshot id at its default."""
    body = _fetch_answer(b"x" * 100, False)
    partition = body["responses"][0]["partitions"][0]
    partition["current_leader"] = {"leader_id": 2, "leader_epoch": 5}
    partition["snapshot_id"] = {"end_offset": -1, "epoch": -1}
    frame = encode_body(1, 12, 1, body)
    assert frame == _old(1, 12, 1, body)
    plain = encode_body(1, 12, 1, _fetch_answer(b"x" * 100, False))
    assert len(frame) == len(plain) + 1 + 10  # tag, size, two int32 and an empty tag section


def test_int_error_codes_write_as_their_error_code() -> None:
    """Handlers may give an error code as an int (the old path needed the enum)."""
    as_int = encode_body(0, 9, 1, _produce_answer(2, 10))
    assert as_int == _old(0, 9, 1, _produce_answer(2, ErrorCode(10)))
    assert encode_body(12, 4, 1, {"error_code": 27}) == _old(
        12, 4, 1, {"error_code": ErrorCode.rebalance_in_progress}
    )


def test_a_class_that_does_not_compile_takes_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing:
        def frame(self, cls: type[Any], header_tags: bool) -> typing.NoReturn:
            raise Uncompilable(cls.__name__)

    monkeypatch.setattr(codec, "_RESPONSES", Refusing())
    monkeypatch.setattr(codec, "_FRAMES", {})
    body = _produce_answer(3)
    assert encode_body(0, 9, 5, body) == _old(0, 9, 5, body)
