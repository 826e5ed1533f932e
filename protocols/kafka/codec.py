"""Kafka request/response framing over kio's schemas, pure (no sockets, no asyncio).

A request frame is ``size int32`` then a request header (v1, or v2 for flexible
versions) and the body; a response is ``size`` then the correlation id (plus an empty
tag buffer for flexible versions, except ApiVersions, whose response header is always
v0 so that a client can read it before it knows our versions: KIP-511).

Handlers answer with plain, version-independent dicts; :func:`build` shapes them into
the kio class of the version the client asked for, dropping fields that version lacks
and zero-filling those the handler left out. :func:`encode_body` writes such a dict
straight to the same bytes, without building anything (protocols/kafka/response_writer.py).
"""

from __future__ import annotations

import datetime
import io
import logging
import struct
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from kio.index import load_entity_schema
from kio.schema.errors import ErrorCode
from kio.schema.index import api_key_map
from kio.serial import entity_reader, entity_writer
from kio.static.constants import EntityType

from polymq.protocols.kafka.bounds import check_request
from polymq.protocols.kafka.response_writer import FrameWriter, ResponseWriters, Uncompilable
from polymq.protocols.kafka.versions import API_VERSIONS_KEY, SUPPORTED

__all__ = [
    "BadRequest",
    "Request",
    "UnsupportedVersion",
    "build",
    "decode_request",
    "encode_body",
    "encode_response",
    "error_response",
    "frame_size",
    "request_class",
    "response_class",
]

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">hhi")  # api key, api version, correlation id


class BadRequest(ValueError):
    """A frame that does not decode: the connection is closed (Kafka does the same)."""


class UnsupportedVersion(ValueError):
    """An API key or version we do not serve; ApiVersions answers it with error 35."""

    def __init__(self, api_key: int, api_version: int, correlation_id: int) -> None:
        super().__init__(f"unsupported API {api_key} version {api_version}")
        self.api_key = api_key
        self.api_version = api_version
        self.correlation_id = correlation_id


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any


def frame_size(prefix: bytes) -> int:
    """The size announced by a frame's first four bytes."""
    (size,) = struct.unpack(">i", prefix)
    return int(size)


@cache
def _classes(api_key: int, api_version: int) -> tuple[type[Any], type[Any]]:
    name = api_key_map[api_key]
    request = load_entity_schema(name, api_version, EntityType.request)
    response = load_entity_schema(name, api_version, EntityType.response)
    return request, response


def request_class(api_key: int, api_version: int) -> type[Any]:
    return _classes(api_key, api_version)[0]


def response_class(api_key: int, api_version: int) -> type[Any]:
    return _classes(api_key, api_version)[1]


_READERS: dict[type[Any], Callable[[bytes, int], tuple[Any, int]]] = {}
_WRITERS: dict[type[Any], Callable[[io.BytesIO, Any], None]] = {}
_HINTS: dict[type[Any], dict[str, Any]] = {}


def _reader(cls: type[Any]) -> Callable[[bytes, int], tuple[Any, int]]:
    reader = _READERS.get(cls)
    if reader is None:
        reader = _READERS[cls] = entity_reader(cls)
    return reader


def _writer(cls: type[Any]) -> Callable[[io.BytesIO, Any], None]:
    writer = _WRITERS.get(cls)
    if writer is None:
        writer = _WRITERS[cls] = entity_writer(cls)
    return writer


def decode_request(frame: bytes, max_items: int | None = None) -> Request:
    """Decode one request frame (without its size prefix), with at most ``max_items``
    array items in all (topics, partitions, ...; unbounded when ``None``).

    Raises :class:`UnsupportedVersion` for an API or version outside
    :data:`~protocols.kafka.versions.SUPPORTED`, :class:`BadRequest` for bytes that do
    not decode."""
    if len(frame) < _PREFIX.size:
        raise BadRequest("request shorter than its header")
    api_key, api_version, correlation_id = _PREFIX.unpack_from(frame)
    span = SUPPORTED.get(api_key)
    if span is None or not span[0] <= api_version <= span[1]:
        raise UnsupportedVersion(api_key, api_version, correlation_id)
    request_cls, _ = _classes(api_key, api_version)
    header_cls = request_cls.__header_schema__
    try:
        # Before the native reader, which would abort the process on a count that
        # claims more items than the frame could hold, and refuse tagged fields it does
        # not know, which Kafka skips (see protocols/kafka/bounds.py).
        frame = check_request(frame, request_cls, header_cls, max_items)
        header, offset = _reader(header_cls)(frame, 0)
        body, _ = _reader(request_cls)(frame, offset)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # Any failure of a pure decoder is the frame's fault: bad UTF-8, an error code
        # or timestamp out of range, even a panic in the native reader (pyo3 raises
        # those as BaseException).
        raise BadRequest(f"cannot decode API {api_key} v{api_version}: {e}") from e
    # Bytes after the body are ignored, as Apache Kafka's request parser does:
    # librdkafka 2.16 sends three extra ones in an all-topics Metadata v12.
    return Request(api_key, api_version, correlation_id, header.client_id, body)


def encode_response(api_key: int, api_version: int, correlation_id: int, body: Any) -> bytes:
    """A response frame, size prefix included."""
    buffer = io.BytesIO()
    buffer.write(b"\x00\x00\x00\x00")
    buffer.write(struct.pack(">i", correlation_id))
    if type(body).__flexible__ and api_key != API_VERSIONS_KEY:
        buffer.write(b"\x00")  # response header v1: no tagged fields
    _writer(type(body))(buffer, body)
    data = buffer.getbuffer()
    struct.pack_into(">i", data, 0, len(data) - 4)
    return bytes(data)


def encode_body(
    api_key: int, api_version: int, correlation_id: int, body: Mapping[str, Any]
) -> bytes:
    """The response frame of a handler's plain dict: the bytes of
    ``encode_response(api_key, api_version, correlation_id, build(cls, body))``, written
    without building kio entities (encoding was ~15 % of a Kafka message's CPU)."""
    frame = _FRAMES.get((api_key, api_version))
    if frame is None:
        frame = _FRAMES[(api_key, api_version)] = _frame_writer(api_key, api_version)
    return frame(correlation_id, body)


def _frame_writer(api_key: int, api_version: int) -> FrameWriter:
    cls = response_class(api_key, api_version)
    try:
        return _RESPONSES.frame(cls, bool(cls.__flexible__) and api_key != API_VERSIONS_KEY)
    except Uncompilable as e:
        log.warning("kafka: API %d v%d responses take the slow path: %s", api_key, api_version, e)

    def old_path(correlation_id: int, body: Mapping[str, Any]) -> bytes:
        return encode_response(api_key, api_version, correlation_id, build(cls, body))

    return old_path


def error_response(api_key: int, api_version: int, error: ErrorCode) -> Any:
    """A response of any API carrying ``error`` in its top-level error code, if it has
    one (for APIs we know the shape of but do not serve)."""
    return build(response_class(api_key, api_version), {"error_code": error})


# -- shaping plain dicts into versioned kio classes ------------------------------------


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _zero(tp: Any) -> Any:
    """The value a field of type ``tp`` left out of the mapping takes. Constant for
    every type but an entity (built afresh each time), so remembered per type."""
    if isinstance(tp, type) and is_dataclass(tp):
        return build(tp, {})
    zero = _ZEROS.get(tp, MISSING)
    if zero is MISSING:
        zero = _ZEROS[tp] = _zero_of(tp)
    return zero


def _zero_of(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        return None
    if origin is tuple:
        return ()
    if isinstance(tp, type):
        if issubclass(tp, ErrorCode):
            return ErrorCode.none
        if issubclass(tp, bool):
            return False
        if issubclass(tp, int):
            return tp(0)
        if issubclass(tp, float):
            return tp(0.0)
        if issubclass(tp, str):
            return ""
        if issubclass(tp, bytes):
            return b""
        if issubclass(tp, datetime.timedelta):
            return datetime.timedelta(0)
        if issubclass(tp, uuid.UUID):
            return uuid.UUID(int=0)
    raise TypeError(f"no zero value for {tp!r}")


_ZEROS: dict[Any, Any] = {}

Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, Converter] = {}


def _as_is(value: Any) -> Any:
    return value


def _converter(tp: Any) -> Converter:
    """How to shape a value for a field of type ``tp``, worked out once per type: every
    response is built from plain mappings, and inspecting the type hints afresh for
    each field of each response was an eighth of a Kafka request's CPU."""
    converter = _CONVERTERS.get(tp)
    if converter is None:
        converter = _CONVERTERS[tp] = _make_converter(tp)
    return converter


def _make_converter(tp: Any) -> Converter:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _converter(inner[0]) if len(inner) == 1 else _as_is
    if origin is tuple:
        item = _converter(args[0])
        if item is _as_is:
            return lambda value: None if value is None else tuple(value)
        return lambda value: None if value is None else tuple(item(one) for one in value)
    if isinstance(tp, type):
        if is_dataclass(tp):
            entity: type[Any] = tp
            return lambda value: build(entity, value) if isinstance(value, Mapping) else value
        if issubclass(tp, datetime.timedelta):
            return lambda value: (
                datetime.timedelta(milliseconds=value) if isinstance(value, int) else value
            )
        if issubclass(tp, datetime.datetime):
            return lambda value: (
                datetime.datetime.fromtimestamp(value / 1000, datetime.UTC)
                if isinstance(value, int)
                else value
            )
    return _as_is


def _convert(tp: Any, value: Any) -> Any:
    return _converter(tp)(value)


# Per entity class: (field name, its converter, its type if it has no default).
_Plan = tuple[tuple[str, Converter, Any], ...]
_PLANS: dict[type[Any], _Plan] = {}


def _plan(cls: type[Any]) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _hints(cls)
        plan = _PLANS[cls] = tuple(
            (
                f.name,
                _converter(hints[f.name]),
                hints[f.name] if f.default is MISSING and f.default_factory is MISSING else None,
            )
            for f in fields(cls)
        )
    return plan


def build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    """``cls`` (a kio entity of some version) from a plain mapping: nested mappings
    become nested entities, millisecond ints become timedeltas, keys the version lacks
    are ignored, and fields left out take their default or a zero value."""
    kwargs: dict[str, Any] = {}
    for name, convert, required in _plan(cls):
        if name in data:
            value = data[name]
            kwargs[name] = None if value is None else convert(value)
        elif required is not None:
            kwargs[name] = _zero(required)
    return cls(**kwargs)


_RESPONSES = ResponseWriters(build)
_FRAMES: dict[tuple[int, int], FrameWriter] = {}


def ms(value: datetime.timedelta | int) -> int:
    """Milliseconds of a kio duration field."""
    if isinstance(value, datetime.timedelta):
        return int(value.total_seconds() * 1000)
    return int(value)
