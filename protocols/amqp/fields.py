"""AMQP 0-9-1 argument lists and field tables, decoded from peer bytes in one pass.

pamqp's decoder is written for trusted brokers, not hostile clients: it recurses once
per nested table or array (20,000 levels end in ``RecursionError`` and a dropped
socket), takes a long string or table claiming 2^31-1 bytes as whatever is there,
lets a value run past the end of its table, and copies the rest of the frame for every
entry (a 128 KiB table of 40,000 voids holds the loop for 170 ms). This decoder walks
the same grammar (spec 4.2.5 with RabbitMQ's errata types) with an explicit stack: a
bounded nesting depth, every declared length checked against the bytes actually
present, linear time. It builds the same Python values as pamqp, into pamqp's method
and property classes, so the rest of the server (and the encoder) is unchanged.

Pure: bytes in, values out; :class:`FieldError` says what was wrong and where.
"""

from __future__ import annotations

import datetime
import decimal
import struct
from collections.abc import Callable
from typing import Final

from pamqp import commands
from pamqp.base import Frame as MethodFrame
from pamqp.common import FieldArray, FieldTable, FieldValue

__all__ = [
    "FieldError",
    "decode_arguments",
    "decode_properties",
    "decode_table",
]

_U8: Final = struct.Struct(">B")
_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")
_DECIMAL: Final = struct.Struct(">Bi")

# Fixed-size field values: type octet -> (size, decode). The same Python values as
# pamqp.decode.TABLE_MAPPING ('l' and 'L' are both signed there; so here).
_FIXED: Final[dict[int, tuple[int, Callable[[bytes, int], FieldValue]]]] = {
    ord("t"): (1, lambda d, p: d[p] != 0),
    ord("b"): (1, lambda d, p: struct.unpack_from(">b", d, p)[0]),
    ord("B"): (1, lambda d, p: d[p]),
    ord("s"): (2, lambda d, p: struct.unpack_from(">h", d, p)[0]),
    ord("u"): (2, lambda d, p: struct.unpack_from(">H", d, p)[0]),
    ord("I"): (4, lambda d, p: struct.unpack_from(">l", d, p)[0]),
    ord("i"): (4, lambda d, p: struct.unpack_from(">L", d, p)[0]),
    ord("l"): (8, lambda d, p: struct.unpack_from(">q", d, p)[0]),
    ord("L"): (8, lambda d, p: struct.unpack_from(">q", d, p)[0]),
    ord("f"): (4, lambda d, p: struct.unpack_from(">f", d, p)[0]),
    ord("d"): (8, lambda d, p: struct.unpack_from(">d", d, p)[0]),
}
_TIMESTAMP: Final = ord("T")
_DECIMAL_TYPE: Final = ord("D")
_LONG_STRING: Final = ord("S")
_BYTES: Final = ord("x")
_TABLE: Final = ord("F")
_ARRAY: Final = ord("A")
_VOIDS: Final = frozenset({ord("V"), 0})


class FieldError(ValueError):
    """The peer's argument list or field table does not parse (502 SYNTAX_ERROR)."""


def _need(data: bytes, pos: int, size: int, end: int, what: str) -> None:
    if size > end - pos:
        raise FieldError(f"{what} of {size} bytes at offset {pos} overruns its {end - pos} left")


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FieldError(f"{what} is not UTF-8") from e


def _long_string(raw: bytes) -> str | bytes:
    # pamqp's rule: text when it decodes, else the bytes.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _timestamp(data: bytes, pos: int) -> datetime.datetime:
    seconds: float = _U64.unpack_from(data, pos)[0]
    if seconds > 0xFFFFFFFF:  # pamqp: past 2106, likely milliseconds
        seconds /= 1000.0
    try:
        return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError) as e:
        raise FieldError(f"timestamp {seconds} is out of range") from e


def decode_table(data: bytes, pos: int, end: int, max_depth: int) -> tuple[FieldTable, int]:
    """The field table at ``data[pos:]`` (its 4-byte size first), which must lie
    within ``end``; returns it and the offset after it. Tables and arrays may nest
    ``max_depth`` levels, this one included."""
    _need(data, pos, 4, end, "table size")
    size = _U32.unpack_from(data, pos)[0]
    pos += 4
    _need(data, pos, size, end, "field table")
    root: FieldTable = {}
    # Open containers, innermost last, each with the offset where it ends. The loop
    # is the hot path of hostile input (a frame of 40,000 tiny entries): few calls.
    stack: list[tuple[FieldTable | FieldArray, int]] = [(root, pos + size)]
    container: FieldTable | FieldArray = root
    stop = pos + size
    fixed_types, voids = _FIXED, _VOIDS
    while True:
        if pos == stop:
            stack.pop()
            if not stack:
                return root, pos
            container, stop = stack[-1]
            continue
        is_table = type(container) is dict
        key = ""
        if is_table:
            length = data[pos]
            pos += 1
            if length > stop - pos:
                _need(data, pos, length, stop, "field name")
            key = _text(data[pos : pos + length], "field name")
            pos += length
        if pos >= stop:
            _need(data, pos, 1, stop, "field type")
        kind = data[pos]
        pos += 1
        value: FieldValue
        if kind in voids:
            value = None
        elif kind in fixed_types:
            width, read = fixed_types[kind]
            if width > stop - pos:
                _need(data, pos, width, stop, f"field {chr(kind)!r}")
            value = read(data, pos)
            pos += width
        elif kind in (_LONG_STRING, _BYTES):
            _need(data, pos, 4, stop, "string size")
            length = _U32.unpack_from(data, pos)[0]
            pos += 4
            _need(data, pos, length, stop, "long string")
            raw = data[pos : pos + length]
            # Not UTF-8: a bytearray, where pamqp gives bytes, which its own encoder
            # then refuses (a TypeError when the properties are encoded again).
            text = _long_string(raw) if kind == _LONG_STRING else raw
            value = text if isinstance(text, str) else bytearray(text)
            pos += length
        elif kind in (_TABLE, _ARRAY):
            _need(data, pos, 4, stop, "nested size")
            length = _U32.unpack_from(data, pos)[0]
            pos += 4
            _need(data, pos, length, stop, "nested table" if kind == _TABLE else "field array")
            if len(stack) >= max_depth:
                raise FieldError(f"field tables and arrays nested deeper than {max_depth}")
            child: FieldTable | FieldArray = {} if kind == _TABLE else []
            if is_table:
                container[key] = child  # type: ignore[call-overload]
            else:
                container.append(child)  # type: ignore[union-attr]
            container, stop = child, pos + length
            stack.append((container, stop))
            continue
        elif kind == _TIMESTAMP:
            _need(data, pos, 8, stop, "timestamp")
            value = _timestamp(data, pos)
            pos += 8
        elif kind == _DECIMAL_TYPE:
            _need(data, pos, 5, stop, "decimal")
            places, raw_value = _DECIMAL.unpack_from(data, pos)
            value = decimal.Decimal(raw_value) * (decimal.Decimal(10) ** -places)
            pos += 5
        else:
            raise FieldError(f"unknown field type {bytes((kind,))!r}")
        if is_table:
            container[key] = value  # type: ignore[call-overload]
        else:
            container.append(value)  # type: ignore[union-attr]


def _short_string(data: bytes, pos: int, end: int) -> tuple[str, int]:
    _need(data, pos, 1, end, "short string size")
    length = data[pos]
    pos += 1
    _need(data, pos, length, end, "short string")
    return _text(data[pos : pos + length], "short string"), pos + length


def _argument(data: bytes, pos: int, end: int, kind: str, depth: int) -> tuple[object, int]:
    if kind == "shortstr":
        return _short_string(data, pos, end)
    if kind == "longstr":
        _need(data, pos, 4, end, "long string size")
        length = _U32.unpack_from(data, pos)[0]
        pos += 4
        _need(data, pos, length, end, "long string")
        return _long_string(data[pos : pos + length]), pos + length
    if kind == "table":
        return decode_table(data, pos, end, depth)
    if kind == "octet":
        _need(data, pos, 1, end, "octet")
        return data[pos], pos + 1
    if kind == "short":
        _need(data, pos, 2, end, "short")
        return _U16.unpack_from(data, pos)[0], pos + 2
    if kind == "long":
        _need(data, pos, 4, end, "long")
        return _U32.unpack_from(data, pos)[0], pos + 4
    if kind == "longlong":
        _need(data, pos, 8, end, "long long")
        return _I64.unpack_from(data, pos)[0], pos + 8
    if kind == "timestamp":
        _need(data, pos, 8, end, "timestamp")
        return _timestamp(data, pos), pos + 8
    raise FieldError(f"unknown argument type {kind}")  # not in the spec's grammar


_ARGUMENTS: Final[dict[type[MethodFrame], tuple[tuple[str, str], ...]]] = {}


def _arguments_of(cls: type[MethodFrame]) -> tuple[tuple[str, str], ...]:
    """(name, type) of each argument of ``cls``, in wire order."""
    found = _ARGUMENTS.get(cls)
    if found is None:
        found = _ARGUMENTS[cls] = tuple((name, cls.amqp_type(name)) for name in cls.__slots__)
    return found


def decode_arguments(cls: type[MethodFrame], data: bytes, pos: int, max_depth: int) -> MethodFrame:
    """A ``cls`` method from its argument list at ``data[pos:]``. Consecutive bits
    share octets (spec 4.2.5.2), as pamqp reads them."""
    method = cls()
    end = len(data)
    bit = 0  # the next bit in the current bit octet; 0: none open
    for name, kind in _arguments_of(cls):
        if kind == "bit":
            if bit == 8:
                pos, bit = pos + 1, 0
            _need(data, pos, 1, end, "bit octet")
            value: object = bool(data[pos] & (1 << bit))
            bit += 1
        else:
            if bit:
                pos, bit = pos + 1, 0
            value, pos = _argument(data, pos, end, kind, max_depth)
        setattr(method, name, value)
    return method


_PROPERTIES: Final = tuple(
    (name, commands.Basic.Properties.flags[name], getattr(commands.Basic.Properties, "_" + name))
    for name in commands.Basic.Properties.__slots__
)


def decode_properties(data: bytes, pos: int, max_depth: int) -> commands.Basic.Properties:
    """Basic properties from their flag words and list at ``data[pos:]`` (spec
    4.2.6.1): the flags in the first word name the properties present, in order."""
    end = len(data)
    _need(data, pos, 2, end, "property flags")
    flags = _U16.unpack_from(data, pos)[0]
    pos += 2
    word = flags
    while word & 1:  # continuation words: no basic property lives there; skip them
        _need(data, pos, 2, end, "property flags")
        word = _U16.unpack_from(data, pos)[0]
        pos += 2
    properties = commands.Basic.Properties()
    for name, flag, kind in _PROPERTIES:
        if flags & flag:
            value, pos = _argument(data, pos, end, kind, max_depth)
            setattr(properties, name, value)
    return properties
