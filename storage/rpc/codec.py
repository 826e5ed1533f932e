"""The storage RPC's wire format: length-prefixed msgpack frames, pure (no I/O).

A frame is a 4-byte big-endian length, then one msgpack array:

* request ``[0, id, method, args, kwargs]``
* result ``[1, id, value]``
* error ``[2, id, code, message, extras]`` (``code``: a ``StorageError`` code)
* cancel ``[3, id]`` (client to server: stop working on that request)

Values are msgpack plus extension types, so the storage model crosses the network
unchanged: registered dataclasses (their fields in declaration order) and StrEnums,
tuples (a plain array decodes as a list, so a tuple must say it is one: the model's
tuples must come back hashable and equal), frozensets. Each travels as an array whose
first item is an empty extension value naming the type. Dict keys may be any of these
(``dict[QueueRef, CommittedOffset]``, ``dict[tuple[str, str], str]``).

The reader (:class:`FrameDecoder`) is fed bytes as they arrive and returns whole frames;
anything it cannot make sense of raises :class:`CodecError`, on which the connection
(and only it) is closed, since the stream can no longer be trusted.

A storage node is a listener like any other, so decoding is bounded before anything is
allocated: a frame's declared size is checked against the limit from its 4-byte prefix,
before its body is buffered; inside a frame no string, binary, array or map may claim
more items or bytes than the frame holds (each array or map item takes at least one
byte, so a 5-byte header claiming 2^32 items is refused, not allocated), extension
values must be empty, and arrays and maps nest at most :data:`MAX_NESTING` deep (in C,
on msgpack's own stack: no Python recursion, whatever the depth sent).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_NESTING",
    "Cancel",
    "CodecError",
    "Error",
    "Frame",
    "FrameDecoder",
    "Request",
    "Result",
    "decode",
    "encode",
    "encode_cancel",
    "encode_error",
    "encode_request",
    "encode_result",
    "register",
]

DEFAULT_MAX_FRAME_BYTES = 256 << 20  # above any append the engine accepts (16 MiB bodies)
# msgpack's unpacker keeps its own stack of open containers, this deep (not settable):
# deeper input fails with its StackError, a CodecError here. The model needs five.
MAX_NESTING = 1024

_REQUEST, _RESULT, _ERROR, _CANCEL = 0, 1, 2, 3
_LENGTH = struct.Struct(">I")

# Extension codes 0..15 are the codec's own; registered classes use 16..127.
_EXT_TUPLE = 1
_EXT_FROZENSET = 2
_FIRST_REGISTERED = 16


class CodecError(ValueError):
    """The bytes are not a frame of this protocol (or hold a value it cannot rebuild)."""


# -- values ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Registered:
    cls: type
    code: int
    to_wire: Callable[[Any], list[Any]]
    from_wire: Callable[[list[Any]], Any]


class _Marker:
    """What an empty extension value decodes to: the tag at the head of an array."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


_BY_CLASS: dict[type, _Registered] = {}
_BY_CODE: dict[int, _Registered] = {}
_MARKERS = {code: _Marker(code) for code in range(128)}
_TAGS = {code: msgpack.ExtType(code, b"") for code in range(128)}


def register(cls: type, code: int) -> None:
    """Make instances of ``cls`` (a dataclass or a StrEnum) encodable as extension type
    ``code``. Both ends must register the same classes under the same codes;
    registering a class again under its own code is harmless. Taken: 16..47 for
    :mod:`storage.model`, 48..63 for :mod:`storage.routes`; 64..127 are free."""
    if not _FIRST_REGISTERED <= code <= 127:
        raise ValueError(f"extension code must be {_FIRST_REGISTERED}..127, got {code}")
    known = _BY_CODE.get(code)
    if known is not None and known.cls is not cls:
        raise ValueError(f"extension code {code} is taken by {known.cls.__name__}")
    if isinstance(cls, type) and issubclass(cls, StrEnum):
        entry = _Registered(cls, code, lambda member: [str(member)], lambda values: cls(*values))
    elif dataclasses.is_dataclass(cls):
        entry = _dataclass_entry(cls, code)
    else:
        raise TypeError(f"only dataclasses and StrEnums can be registered, not {cls!r}")
    _BY_CLASS[cls] = entry
    _BY_CODE[code] = entry


def _dataclass_entry(cls: type, code: int) -> _Registered:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def to_wire(obj: Any) -> list[Any]:
        return [getattr(obj, name) for name in names]

    # cls(**dict(zip(names, values))) costs twice as much as keyword arguments spelt out
    arguments = ", ".join(f"{name}=v[{i}]" for i, name in enumerate(names))
    build = eval(f"lambda cls, v: cls({arguments})")  # field names only: safe

    def from_wire(values: list[Any]) -> Any:
        if len(values) != len(names):
            raise CodecError(f"{cls.__name__} needs {len(names)} fields, got {len(values)}")
        return build(cls, values)

    return _Registered(cls, code, to_wire, from_wire)


# A value msgpack has no type for travels as an array headed by an empty extension
# value naming its type: [tag, field...]. Packing it so (rather than as an extension
# value holding packed bytes) keeps the whole frame one pass of msgpack's C packer;
# the reader's list hook turns tagged arrays back into objects as they complete.


def _default(obj: Any) -> list[Any]:
    """msgpack calls this for whatever it does not pack itself (``strict_types``: also
    tuples and subclasses of builtins such as StrEnums)."""
    entry = _BY_CLASS.get(type(obj))
    if entry is not None:
        return [_TAGS[entry.code], *entry.to_wire(obj)]
    if type(obj) is tuple:
        return [_TAGS[_EXT_TUPLE], *obj]
    if type(obj) is frozenset:
        return [_TAGS[_EXT_FROZENSET], *obj]
    raise TypeError(f"cannot encode a {type(obj).__name__} for the storage RPC")


def _ext_hook(code: int, data: bytes) -> _Marker:
    if data:
        raise CodecError(f"extension type {code} must be empty")
    return _MARKERS[code]


def _list_hook(values: list[Any]) -> Any:
    if not values or type(values[0]) is not _Marker:
        return values
    code = values[0].code
    del values[0]
    if code == _EXT_TUPLE:
        return tuple(values)
    if code == _EXT_FROZENSET:
        return frozenset(values)
    entry = _BY_CODE.get(code)
    if entry is None:
        raise CodecError(f"unknown extension type {code}")
    return entry.from_wire(values)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)  # type: ignore[no-any-return]


def _unpack(data: bytes | memoryview) -> Any:
    size = len(data)
    return msgpack.unpackb(
        data,
        ext_hook=_ext_hook,
        list_hook=_list_hook,
        raw=False,
        strict_map_key=False,
        # What one frame can hold at most; msgpack would derive the same from the
        # input's size, but the bounds are part of the protocol, so they are said here.
        max_str_len=size,
        max_bin_len=size,
        max_array_len=size,
        max_map_len=size,
        max_ext_len=0,
    )


def encode(value: Any) -> bytes:
    """One value as msgpack bytes. ``TypeError`` if it holds something unregistered."""
    return _pack(value)


def decode(data: bytes | memoryview) -> Any:
    """The value :func:`encode` made. ``CodecError`` if ``data`` is not one."""
    try:
        return _unpack(data)
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises a handful of unrelated types
        raise CodecError(f"undecodable value: {exc or type(exc).__name__}") from exc


# -- frames ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Result:
    id: int
    value: Any


@dataclass(frozen=True, slots=True)
class Error:
    id: int
    code: str
    message: str
    extras: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Cancel:
    id: int


Frame = Request | Result | Error | Cancel


def _frame(body: list[Any]) -> bytes:
    payload = _pack(body)
    return _LENGTH.pack(len(payload)) + payload


def encode_request(id: int, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    return _frame([_REQUEST, id, method, list(args), dict(kwargs)])


def encode_result(id: int, value: Any) -> bytes:
    return _frame([_RESULT, id, value])


def encode_error(id: int, code: str, message: str, extras: Mapping[str, Any] = {}) -> bytes:
    return _frame([_ERROR, id, code, message, dict(extras)])


def encode_cancel(id: int) -> bytes:
    return _frame([_CANCEL, id])


def _parse(body: Any) -> Frame:
    if not isinstance(body, list) or not body or type(body[0]) is not int:
        raise CodecError("a frame must be an array starting with its kind")
    kind = body[0]
    if len(body) < 2 or type(body[1]) is not int:
        raise CodecError("a frame's id must be an integer")
    if kind == _REQUEST and len(body) == 5:
        _, id, method, args, kwargs = body
        if (
            isinstance(method, str)
            and isinstance(args, list)
            and isinstance(kwargs, dict)
            and all(isinstance(key, str) for key in kwargs)
        ):
            return Request(id, method, args, kwargs)
    elif kind == _RESULT and len(body) == 3:
        return Result(body[1], body[2])
    elif kind == _ERROR and len(body) == 5:
        _, id, code, message, extras = body
        if isinstance(code, str) and isinstance(message, str) and isinstance(extras, dict):
            return Error(id, code, message, extras)
    elif kind == _CANCEL and len(body) == 2:
        return Cancel(body[1])
    raise CodecError(f"malformed frame of kind {kind}")


class FrameDecoder:
    """Splits a byte stream into frames (h11's ``receive_data`` / ``next_event`` shape,
    folded into one call since every frame stands alone)."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data``, in order. After a ``CodecError`` the
        stream is broken: stop feeding."""
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        start = 0
        end = len(buffer)
        with memoryview(buffer) as view:  # frames decoded in place, not copied out
            while end - start >= 4:
                (length,) = _LENGTH.unpack_from(view, start)
                if length > self._max:
                    raise CodecError(f"frame of {length} bytes exceeds the {self._max} byte limit")
                if end - start - 4 < length:
                    break
                frames.append(_parse(decode(view[start + 4 : start + 4 + length])))
                start += 4 + length
        if start:
            del buffer[:start]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buffer)


# -- the model's types -----------------------------------------------------------------


def _register_model() -> None:
    """Codes are part of the wire format: never renumber, only add."""
    from polymq.storage import model as m
    from polymq.storage import routes as ns

    for code, cls in enumerate(
        (
            m.MessageType,
            m.TopicConfig,
            m.QueueRef,
            m.QueueOffsets,
            m.TopicInfo,
            m.Message,
            m.BatchEntry,
            m.AppendRequest,
            m.Placement,
            m.AppendResult,
            m.StoredMessage,
            m.StoredBatch,
            m.ReadResult,
            m.CommittedOffset,
            m.GroupConfig,
            m.HalfMessage,
        ),
        start=_FIRST_REGISTERED,
    ):
        register(cls, code)
    for code, cls in enumerate((ns.NodeHeartbeat, ns.NodeStatus, ns.RouteTable), start=48):
        register(cls, code)


_register_model()
