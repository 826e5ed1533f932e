"""Writing a handler's plain dict straight to a Kafka response frame.

Handlers answer with plain, version-independent dicts. The old way to the wire shaped
each into kio dataclasses (:func:`protocols.kafka.codec.build`: phantom-type calls,
converters, timedelta objects), then ran kio's generic serializer over them (a closure
per field, a ``BytesIO``, a temporary ``BytesIO`` per flexible entity for its tagged
fields). A py-spy profile of the loop at 1,000 Kafka messages/s put that encoding at
~15 % of a message's CPU. Here each kio response class is compiled once, as
``protocols/kafka/bounds.py`` compiles the request checks, into straight-line Python
that reads the dict and appends to one ``bytearray``: runs of fixed-size fields become
one ``struct`` call, and a field the handler left out is a constant worked out at
compile time.

The bytes are exactly those of ``encode_response(..., build(cls, body))``, with every
rule of ``build``: keys the version lacks are ignored, fields left out take their
default or zero value, nested dicts become entities (a kio entity instance given
instead is written by kio's own writer), ints are milliseconds for duration and time
fields, ``None`` stays null; an error code may also be a plain int (kio's writer
wanted the enum). The rules are not restated here but taken from ``build``
and kio themselves wherever a value is not on the fast path: a field left out is
written once, at compile time, by kio's writer for the value ``build`` gives it; a
tagged field the handler sets (rare: none of the hot responses' handlers do) is shaped
by ``build`` and written by kio's tagged-field writer; milliseconds outside the range
where the shortcut is provably exact are converted as ``build`` converts them. A class
whose ``{}`` does not come out as the old path's bytes is refused at compile time
(:class:`Uncompilable`), and its responses take the old path.

tests/kafka/test_kafka_response_writer.py compares both paths over every API version
served; see docs/kafka.md for the figures.
"""

from __future__ import annotations

import datetime
import io
import struct
import threading
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any

from kio.serial import entity_writer
from kio.serial._implicit_defaults import get_tagged_field_default
from kio.serial._serialize import get_field_writer
from kio.serial.writers import write_tagged_field

from polymq.protocols.kafka.kio_types import is_nullable, strip_none, uvarint_bytes

__all__ = ["FrameWriter", "ResponseWriters", "Uncompilable"]

# build(cls, mapping) -> an instance of the kio entity cls (codec.build).
Build = Callable[[type[Any], Mapping[str, Any]], Any]
# (correlation id, handler's dict) -> the response frame, size prefix included.
FrameWriter = Callable[[int, Mapping[str, Any]], bytes]

_FORMATS: dict[str, str] = {
    "int8": "b",
    "int16": "h",
    "int32": "i",
    "int64": "q",
    "uint8": "B",
    "uint16": "H",
    "uint32": "I",
    "uint64": "Q",
    "float64": "d",
    "bool": "?",
    "error_code": "h",
    "timedelta_i32": "i",
    "timedelta_i64": "q",
    "datetime_i64": "q",
    "uuid": "16s",
}
_VARIABLE = frozenset({"string", "bytes", "records"})

# Milliseconds in these ranges come out of build's timedelta / datetime and kio's
# rounding unchanged (the float error stays far below half a millisecond).
_TIMEDELTA_FAST = 2**47
_DATETIME_LOW, _DATETIME_HIGH = -(2**40), 2**47

# Bytes values from this size on are joined into the frame rather than copied into it
# and copied again: a 1 MiB fetch took 74 µs copied twice, 41 joined.
_LARGE = 2048

_ZERO_UUID = bytes(16)
_I32 = struct.Struct(">i")


class Uncompilable(TypeError):
    """A response class this module will not write; its responses take the old path."""


class _Absent:
    """The marker for a key the handler left out (``None`` is a value: null)."""


_ABSENT = _Absent()


def _timedelta_ms(value: Any) -> int:
    """A duration field's milliseconds, the slow way: build's conversion, kio's rounding."""
    if isinstance(value, int):
        value = datetime.timedelta(milliseconds=value)
    seconds: float = value.total_seconds()
    return round(seconds * 1000)


def _datetime_ms(value: Any) -> int:
    """A time field's milliseconds, the slow way: build's conversion, kio's rounding."""
    if isinstance(value, int):
        value = datetime.datetime.fromtimestamp(value / 1000, datetime.UTC)
    seconds: float = value.timestamp()
    return round(seconds * 1000)


def _nullable_datetime_ms(value: Any) -> int:
    return -1 if value is None else _datetime_ms(value)


def _kio_bytes(write: Callable[[Any, Any], None], value: Any) -> bytes:
    buffer = io.BytesIO()
    write(buffer, value)
    return buffer.getvalue()


def _joined(out: bytearray, large: list[tuple[int, Any]]) -> bytes:
    """The frame: ``out`` with each large value inserted at its offset, size set."""
    size = len(out) - 4 + sum(memoryview(value).nbytes for _, value in large)
    _I32.pack_into(out, 0, size)
    view = memoryview(out)
    parts: list[Any] = []
    at = 0
    for offset, value in large:
        parts += (view[at:offset], value)
        at = offset
    parts.append(view[at:])
    return b"".join(parts)


def _as_entity(cls: type[Any], value: Any, out: bytearray) -> None:
    """A value that is not a mapping, as build passes it on: kio writes it as a ``cls``."""
    out += _kio_bytes(entity_writer(cls), value)


@dataclass(frozen=True, slots=True)
class _Shape:
    """A field as kio's serializer classifies it."""

    kind: str | None  # kafka_type; None for entities
    entity: type[Any] | None
    array: bool
    nullable: bool


def _shape(f: Field[Any]) -> _Shape:
    nullable = is_nullable(f.type)
    tp = strip_none(f.type)
    array = typing.get_origin(tp) is tuple
    if array:
        tp = strip_none(typing.get_args(tp)[0])
    if isinstance(tp, type) and is_dataclass(tp):
        return _Shape(None, tp, array, nullable)
    kind = f.metadata.get("kafka_type")
    if kind not in _FORMATS and kind not in _VARIABLE:
        raise Uncompilable(f"kafka type {kind!r} of {f.name}")
    return _Shape(kind, None, array, nullable)


def _value(kind: str, nullable: bool, var: str) -> str:
    """The expression turning a fixed field's value in ``var`` into what is packed."""
    if kind.startswith("timedelta"):
        fast = f"{var}.__class__ is int and -{_TIMEDELTA_FAST} < {var} < {_TIMEDELTA_FAST}"
        return f"({var} if {fast} else _timedelta_ms({var}))"
    if kind == "datetime_i64":
        slow = "_nullable_datetime_ms" if nullable else "_datetime_ms"
        fast = f"{var}.__class__ is int and {_DATETIME_LOW} < {var} < {_DATETIME_HIGH}"
        return f"({var} if {fast} else {slow}({var}))"
    if kind == "uuid":
        return f"(_ZERO_UUID if {var} is None else {var}.bytes)"
    return var


def _indent(lines: list[str], by: str = "    ") -> list[str]:
    return [by + line for line in lines]


class _Compiler:
    """Generates one writer function per kio entity class, sharing a namespace."""

    def __init__(self, build: Build) -> None:
        self.build = build
        self.namespace: dict[str, Any] = {
            "_ABSENT": _ABSENT,
            "_Mapping": Mapping,
            "_as_entity": _as_entity,
            "_timedelta_ms": _timedelta_ms,
            "_datetime_ms": _datetime_ms,
            "_nullable_datetime_ms": _nullable_datetime_ms,
            "_uvarint": uvarint_bytes,
            "_ZERO_UUID": _ZERO_UUID,
            "_h": struct.Struct(">h").pack,
            "_i": _I32.pack,
            "_pack": struct.pack,
        }
        self.names: dict[type[Any], str] = {}

    def _const(self, value: Any, hint: str = "c") -> str:
        """A name in the namespace holding ``value``."""
        name = f"_{hint}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def entity(self, cls: type[Any]) -> str:
        """The name of ``cls``'s writer ``(value, out, large)`` in the namespace,
        compiling it if needed."""
        name = self.names.get(cls)
        if name is not None:
            return name
        name = f"_write_{len(self.names)}_{cls.__name__}"
        self.names[cls] = name
        try:
            self._compile(cls, name)
        except Exception:
            del self.names[cls]
            raise
        return name

    def _compile(self, cls: type[Any], name: str) -> None:
        flexible = bool(cls.__flexible__)
        absent = self.build(cls, {})
        plain = [f for f in fields(cls) if "tag" not in f.metadata]
        tagged = sorted((f for f in fields(cls) if "tag" in f.metadata), key=_tag)
        if tagged and not flexible:
            raise Uncompilable(f"tagged fields in {cls.__name__}, not flexible")
        lines = [
            f"def {name}(d, o, L):",
            "    if d.__class__ is not dict and not isinstance(d, _Mapping):",
            f"        _as_entity({self._const(cls, 'cls')}, d, o)",
            "        return",
            "    g = d.get",
        ]
        run: list[tuple[Field[Any], _Shape]] = []
        for f in plain:
            shape = _shape(f)
            if shape.kind in _FORMATS and not shape.array:
                run.append((f, shape))
                continue
            lines += _indent(self._run(run, absent, pad=False))
            run = []
            lines += _indent(self._field(f, shape, flexible, getattr(absent, f.name)))
        # A flexible entity without tagged fields ends with a zero count: one pad byte.
        lines += _indent(self._run(run, absent, pad=flexible and not tagged))
        if tagged:
            lines += _indent(self._tags(cls, tagged, absent))
        elif flexible and not run:
            lines.append("    o.append(0)")
        exec("\n".join(lines), self.namespace)  # our own generated code

    def _run(self, run: list[tuple[Field[Any], _Shape]], absent: Any, pad: bool) -> list[str]:
        """One ``struct`` call for consecutive fixed-size fields."""
        if not run:
            return []
        lines: list[str] = []
        fmt = ">"
        args: list[str] = []
        for f, shape in run:
            assert shape.kind is not None
            code = _FORMATS[shape.kind]
            fmt += code
            raw = self._raw_absent(f, shape, code, getattr(absent, f.name))
            get = f"g({f.name!r}, {raw})"
            var = f"x{len(args)}"
            value = _value(shape.kind, shape.nullable, var)
            if value == var:
                args.append(get)
            else:
                lines.append(f"{var} = {get}")
                args.append(value)
        if pad:
            fmt += "x"
        pack = self._const(struct.Struct(fmt).pack, "s")
        return [*lines, f"o += {pack}({', '.join(args)})"]

    def _raw_absent(self, f: Field[Any], shape: _Shape, code: str, value: Any) -> str:
        """An expression for the raw value (an int in milliseconds, say) that writes as
        kio writes the value build gives a left-out field."""
        assert shape.kind is not None
        data = _kio_bytes(get_field_writer(f, True, False, False), value)
        if shape.kind == "uuid":
            return "None" if data == _ZERO_UUID else self._const(uuid.UUID(bytes=data))
        (raw,) = struct.unpack(">" + code, data)
        return repr(raw) if isinstance(raw, int) else self._const(raw)

    def _field(self, f: Field[Any], shape: _Shape, flexible: bool, absent: Any) -> list[str]:
        """Lines writing one field that is not a fixed-size scalar."""
        left_out = _kio_bytes(get_field_writer(f, flexible, False, False), absent)
        null: bytes | None = None
        if shape.array:
            null = b"\x00" if flexible else b"\xff\xff\xff\xff"
            body = self._array(shape, flexible)
        elif shape.entity is not None:
            inner = self.entity(shape.entity)
            null = b"\xff" if shape.nullable else None
            body = ["o.append(1)"] if shape.nullable else []
            body.append(f"{inner}(v, o, L)")
        else:
            assert shape.kind is not None
            if shape.nullable:
                null = b"\x00" if flexible else b"\xff" * (2 if shape.kind == "string" else 4)
            body = _variable(shape.kind, flexible, "v")
        lines = [f"v = g({f.name!r}, _ABSENT)"]
        if null == left_out:
            lines.append(f"if v is _ABSENT or v is None: o += {null!r}")
        else:
            lines.append(f"if v is _ABSENT: o += {left_out!r}")
            if null is not None:
                lines.append(f"elif v is None: o += {null!r}")
        return [*lines, "else:", *_indent(body)]

    def _array(self, shape: _Shape, flexible: bool) -> list[str]:
        """Lines writing the items of the array in ``v`` (a list, tuple or iterable)."""
        if flexible:
            count = ["if n < 127: o.append(n + 1)", "else: o += _uvarint(n + 1)"]
        else:
            count = ["o += _i(n)"]
        # Any iterable, as build takes it: one without a length is made a tuple first.
        lines = ["try: n = len(v)", "except TypeError:", "    v = tuple(v)", "    n = len(v)"]
        lines += count
        if shape.entity is not None:
            return [*lines, "for e in v:", f"    {self.entity(shape.entity)}(e, o, L)"]
        assert shape.kind is not None
        if shape.kind in _FORMATS:
            code = _FORMATS[shape.kind]
            value = _value(shape.kind, False, "e")
            if value == "e":
                return [*lines, f"o += _pack('>' + str(n) + {code!r}, *v)"]
            pack = self._const(struct.Struct(">" + code).pack, "s")
            return [*lines, "for e in v:", f"    o += {pack}({value})"]
        return [*lines, "for e in v:", *_indent(_variable(shape.kind, flexible, "e"))]

    def _tags(self, cls: type[Any], tagged: list[Field[Any]], absent: Any) -> list[str]:
        """Lines writing the tagged fields section: those set to something other than
        their default, sorted by tag, each in its own size."""
        lines = ["T = None"]
        for f in tagged:
            emit, left_out = _tagged_field(self.build, cls, f, getattr(absent, f.name))
            lines += [
                f"v = g({f.name!r}, _ABSENT)",
                "if v is not _ABSENT:",
                f"    e = {self._const(emit, 'tag')}(v)",
                "    if e is not None:",
                "        if T is None: T = [e]",
                "        else: T.append(e)",
            ]
            if left_out is not None:
                lines += [
                    "else:",
                    f"    if T is None: T = [{left_out!r}]",
                    f"    else: T.append({left_out!r})",
                ]
        return [
            *lines,
            "if T is None: o.append(0)",
            "else:",
            "    o += _uvarint(len(T))",
            "    o += b''.join(T)",
        ]


def _tag(f: Field[Any]) -> int:
    return int(f.metadata["tag"])


def _variable(kind: str, flexible: bool, var: str) -> list[str]:
    """Lines writing the string or bytes in ``var`` with its length, as kio does (a
    compact field encodes a ``str``; a legacy string field always encodes). Large
    bytes (records) are noted in ``L`` rather than copied in, to be joined once."""
    if kind == "string" and not flexible:
        return [f"b = {var}.encode()", "o += _h(len(b))", "o += b"]
    if flexible:
        lines = [
            f"b = {var}.encode() if isinstance({var}, str) else {var}",
            "n = len(b)",
            "if n < 127: o.append(n + 1)",
            "else: o += _uvarint(n + 1)",
        ]
    else:
        lines = [f"b = {var}", "n = len(b)", "o += _i(n)"]
    if kind == "string":
        return [*lines, "o += b"]
    return [*lines, f"if n < {_LARGE}: o += b", "else: L.append((len(o), b))"]


def _tagged_field(
    build: Build, cls: type[Any], f: Field[Any], absent: Any
) -> tuple[Callable[[Any], bytes | None], bytes | None]:
    """How a tagged field the handler set is written, as kio's entity writer writes it
    once build has shaped it (``None``: left out as equal to its default); and the
    bytes it takes when the handler leaves it out (``None`` when none, the usual case)."""
    write = get_field_writer(f, True, False, True)
    default = f.default
    implicit = get_tagged_field_default(f)
    tag = _tag(f)
    name = f.name

    def emit(value: Any) -> bytes | None:
        shaped = getattr(build(cls, {name: value}), name)
        if shaped == default or (default == MISSING and shaped == implicit):
            return None
        buffer = io.BytesIO()
        write_tagged_field(buffer, tag, write, shaped)  # type: ignore[arg-type]
        return buffer.getvalue()

    return emit, emit(absent)


class ResponseWriters:
    """Compiled frame writers, one per response class, shaping values with ``build``
    wherever they leave the fast path."""

    def __init__(self, build: Build) -> None:
        self._build = build
        self._compiler = _Compiler(build)
        # A class's name is registered before its function exists (nested classes
        # refer to it): a second thread must not use it in between.
        self._compiling = threading.Lock()

    def frame(self, cls: type[Any], header_tags: bool) -> FrameWriter:
        """A writer of ``cls`` responses after a correlation id and, if ``header_tags``,
        the header's empty tag buffer. Raises :class:`Uncompilable` for a class whose
        empty response does not come out exactly as kio writes it, or that kio or
        build cannot handle."""
        with self._compiling:
            try:
                write = self._compiler.namespace[self._compiler.entity(cls)]
            except Exception as e:
                raise Uncompilable(f"{cls.__name__}: {e}") from e
        head = struct.Struct(">iix" if header_tags else ">ii").pack
        size_into = _I32.pack_into

        def frame(correlation_id: int, body: Mapping[str, Any]) -> bytes:
            out = bytearray(head(0, correlation_id))
            large: list[tuple[int, Any]] = []
            write(body, out, large)
            if large:
                return _joined(out, large)
            size_into(out, 0, len(out) - 4)
            return bytes(out)

        expected = _kio_bytes(entity_writer(cls), self._build(cls, {}))
        got = frame(0, {})[9 if header_tags else 8 :]
        if got != expected:
            raise Uncompilable(f"{cls.__name__}: the empty response differs from kio's")
        return frame
