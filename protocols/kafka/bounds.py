"""Checking a request's declared lengths against its bytes, before kio's native reader.

kio's Rust reader reserves an array's declared element count up front, so a 23-byte
frame claiming 2^32 entries makes it ask for 34 GB, and the failed allocation aborts
the whole process (no Python exception to catch). This module walks the same kio
schema in pure Python without building anything: every array count, string or bytes
length and tagged-field size must fit in the bytes actually present (a count can never
exceed the remaining bytes over its element's smallest encoding), and null may appear
only where the schema allows it. A frame that passes holds nothing the native reader
can over-allocate for.

Tagged fields the schema does not know are skipped, as Apache Kafka skips them (KIP-482:
that is what they are for, a newer client's additions). kio's reader would refuse them
(``KeyError``), so the walk notes where each one is and :func:`check_request` hands back
a copy of the frame without them, their section's count rewritten, and the size of any
known tagged field holding them rewritten too. A frame without unknown tagged fields is
handed back as it came, not copied.

Each entity is compiled once into straight-line Python (runs of fixed-size fields
become one addition), which keeps the walk at a few microseconds for the requests
clients send all the time; see docs/kafka.md for the figures.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Callable
from dataclasses import Field, fields, is_dataclass
from typing import Any, TypeGuard

from polymq.protocols.kafka.kio_types import is_nullable, strip_none, uvarint_bytes

__all__ = ["Malformed", "check_request"]

# (bytes, offset, end, [items left, edits]) -> offset after the entity; raises
# Malformed. Edits are (start, end, replacement) of byte ranges of the frame.
Checker = Callable[[bytes, int, int, list[Any]], int]
Edit = tuple[int, int, bytes]

_FIXED: dict[str, int] = {
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float64": 8,
    "bool": 1,
    "uuid": 16,
    "error_code": 2,
    "timedelta_i32": 4,
    "timedelta_i64": 8,
    "datetime_i64": 8,
}
_VARIABLE = frozenset({"string", "bytes", "records"})

_COUNTED = [
    "c[0] -= C",
    "if c[0] < 0: raise Malformed('more array items than a request may carry')",
]

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


class Malformed(ValueError):
    """A frame whose declared sizes do not fit its bytes, or that the schema forbids."""


def _uvarint(b: bytes, o: int, n: int) -> tuple[int, int]:
    """An unsigned varint of at most 5 bytes (Kafka's limit for 32-bit values)."""
    result = 0
    for shift in range(0, 35, 7):
        if o >= n:
            raise Malformed("varint runs past the end")
        byte = b[o]
        o += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, o
    raise Malformed("varint longer than 5 bytes")


def _i16(b: bytes, o: int, n: int) -> int:
    if o + 2 > n:
        raise Malformed("length runs past the end")
    return int(_I16.unpack_from(b, o)[0])


def _i32(b: bytes, o: int, n: int) -> int:
    if o + 4 > n:
        raise Malformed("length runs past the end")
    return int(_I32.unpack_from(b, o)[0])


def _short(what: str) -> Malformed:
    return Malformed(f"{what} longer than the bytes left")


def _null(what: str) -> Malformed:
    return Malformed(f"null {what}, which the schema does not allow")


def _tags(b: bytes, o: int, n: int, c: list[Any], known: dict[int, Checker], where: str) -> int:
    """Skip an entity's tagged fields, checking each known one inside its own size and
    noting in ``c[1]`` the edits that remove the unknown ones."""
    if o < n and b[o] == 0:  # the usual case: no tagged fields
        return o + 1
    section = o
    count, o = _uvarint(b, o, n)
    section_end = o
    if count > (n - o) // 2:
        raise _short(f"{where}: tagged field count {count}")
    edits: list[Edit] = c[1]
    unknown = 0
    for _ in range(count):
        start = o
        tag, o = _uvarint(b, o, n)
        size_at = o
        size, o = _uvarint(b, o, n)
        end = o + size
        if end > n:
            raise _short(f"{where}: tagged field {tag} of {size} bytes")
        check = known.get(tag)
        if check is None:
            unknown += 1
            edits.append((start, end, b""))
        else:
            mark = len(edits)
            check(b, o, end, c)
            if len(edits) > mark:  # unknown fields inside this one's value: resize it
                change = sum(len(new) - (e - s) for s, e, new in edits[mark:])
                edits.append((size_at, o, uvarint_bytes(size + change)))
        o = end
    if unknown:
        edits.append((section, section_end, uvarint_bytes(count - unknown)))
    return o


def _apply(frame: bytes, edits: list[Edit]) -> bytes:
    """``frame`` with each edit's range replaced (edits never overlap)."""
    parts: list[bytes] = []
    at = 0
    for start, end, new in sorted(edits):
        parts.append(frame[at:start])
        parts.append(new)
        at = end
    parts.append(frame[at:])
    return b"".join(parts)


def _is_entity(tp: Any) -> TypeGuard[type[Any]]:
    return isinstance(tp, type) and is_dataclass(tp)


class _Compiler:
    """Generates one checker function per kio entity class, sharing a namespace."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {
            "_uvarint": _uvarint,
            "_i16": _i16,
            "_i32": _i32,
            "_tags": _tags,
            "_short": _short,
            "_null": _null,
            "Malformed": Malformed,
        }
        self.names: dict[tuple[type[Any], bool], str] = {}
        self.minimum: dict[tuple[type[Any], bool], int] = {}

    def entity(self, cls: type[Any], header: bool = False) -> str:
        """The name of ``cls``'s checker in the namespace, compiling it if needed."""
        key = (cls, header)
        name = self.names.get(key)
        if name is not None:
            return name
        name = f"_check_{len(self.names)}_{cls.__name__}"
        self.names[key] = name
        flexible = bool(cls.__flexible__)
        lines = [f"def {name}(b, o, n, c):"]
        pending = 0  # fixed bytes not yet added to o
        minimum = 1 if flexible else 0
        tagged: list[tuple[int, str]] = []
        for f in fields(cls):
            if "tag" in f.metadata:
                tagged.append((int(f.metadata["tag"]), self._tag_checker(cls, f)))
                continue
            kind = f.metadata.get("kafka_type")
            if kind in _FIXED and typing.get_origin(strip_none(f.type)) is not tuple:
                pending += _FIXED[kind]
                minimum += _FIXED[kind]
                continue
            if pending:
                lines.append(f"    o += {pending}")
                pending = 0
            body, size = self._field(cls, f, flexible, header and f.name == "client_id")
            lines.extend("    " + line for line in body)
            minimum += size
        if pending:
            lines.append(f"    o += {pending}")
        lines.append(f"    if o > n: raise _short({cls.__name__!r})")
        if flexible:
            table = f"{name}_tags"
            self.namespace[table] = {}
            lines.append(f"    return _tags(b, o, n, c, {table}, {cls.__name__!r})")
        else:
            lines.append("    return o")
        exec("\n".join(lines), self.namespace)  # our own generated code
        if flexible:
            self.namespace[f"{name}_tags"].update(
                {tag: self.namespace[checker] for tag, checker in tagged}
            )
        self.minimum[key] = minimum
        return name

    def _tag_checker(self, cls: type[Any], f: Field[Any]) -> str:
        """A checker for one tagged field's value, run within the field's own size."""
        name = f"_tag_{len(self.namespace)}_{cls.__name__}_{f.name}"
        kind = f.metadata.get("kafka_type")
        if kind in _FIXED and typing.get_origin(strip_none(f.type)) is not tuple:
            lines = [
                f"def {name}(b, o, n, c):",
                f"    if o + {_FIXED[kind]} > n: raise _short('tag')",
                "    return o",
            ]
        else:
            body, _ = self._field(cls, f, True, False)
            lines = [f"def {name}(b, o, n, c):", *("    " + line for line in body), "    return o"]
        exec("\n".join(lines), self.namespace)  # our own generated code
        return name

    def _field(
        self,
        cls: type[Any],
        f: Field[Any],
        flexible: bool,
        legacy_string: bool,
    ) -> tuple[list[str], int]:
        """Lines checking one non-fixed field, and its smallest encoding in bytes."""
        where = f"{cls.__name__}.{f.name}"
        nullable = is_nullable(f.type)
        tp = strip_none(f.type)
        if typing.get_origin(tp) is tuple:
            return self._array(where, f, typing.get_args(tp)[0], flexible, nullable)
        if _is_entity(tp):
            inner = self.entity(tp)
            if not nullable:
                return [f"o = {inner}(b, o, n, c)"], self.minimum[(tp, False)]
            return [
                "if o >= n: raise _short('marker')",
                "m = b[o]",
                "o += 1",
                f"if m == 1: o = {inner}(b, o, n, c)",
                f"elif m != 255: raise Malformed('bad null marker in {where}')",
            ], 1
        kind = f.metadata.get("kafka_type")
        if kind not in _VARIABLE:
            raise TypeError(f"unknown kafka type {kind!r} in {where}")
        return self._variable(where, kind, flexible and not legacy_string, nullable), (
            1 if flexible and not legacy_string else (2 if kind == "string" else 4)
        )

    @staticmethod
    def _variable(where: str, kind: str, compact: bool, nullable: bool) -> list[str]:
        """Lines checking one string or bytes value at ``o``."""
        if compact:
            lines = [
                "if o < n and b[o] < 128:",
                "    L = b[o] - 1",
                "    o += 1",
                "else:",
                "    L, o = _uvarint(b, o, n)",
                "    L -= 1",
                "if L >= 0:",
                "    o += L",
                f"    if o > n: raise _short({where!r})",
            ]
            null_test = "elif"
        else:
            read = "_i16" if kind == "string" else "_i32"
            lines = [
                f"L = {read}(b, o, n)",
                f"o += {2 if kind == 'string' else 4}",
                "if L >= 0:",
                "    o += L",
                f"    if o > n: raise _short({where!r})",
                f"elif L != -1: raise Malformed('negative length in {where}')",
            ]
            null_test = "elif"
        if not nullable:
            lines.append(f"{null_test} True: raise _null({where!r})")
        return lines

    def _array(
        self, where: str, f: Field[Any], item: Any, flexible: bool, nullable: bool
    ) -> tuple[list[str], int]:
        if flexible:
            lines = [
                "if o < n and b[o] < 128:",
                "    C = b[o] - 1",
                "    o += 1",
                "else:",
                "    C, o = _uvarint(b, o, n)",
                "    C -= 1",
            ]
            size = 1
        else:
            lines = [
                "C = _i32(b, o, n)",
                "o += 4",
                f"if C < -1: raise Malformed('negative count in {where}')",
            ]
            size = 4
        if not nullable:
            lines.append(f"if C == -1: raise _null({where!r})")
        item_nullable = is_nullable(item)
        item = strip_none(item)
        kind = f.metadata.get("kafka_type")
        if _is_entity(item):
            inner = self.entity(item)
            smallest = max(self.minimum[(item, False)], 1)
            lines += [
                f"if C > (n - o) // {smallest}: raise _short('{where}: ' + str(C) + ' items')",
                "if C > 0:",
                *("    " + line for line in _COUNTED),
                "for _ in range(C):",
                f"    o = {inner}(b, o, n, c)",
            ]
        elif kind in _FIXED:
            lines += [
                "if C > 0:",
                f"    o += C * {_FIXED[kind]}",
                f"    if o > n: raise _short('{where}: ' + str(C) + ' items')",
                *("    " + line for line in _COUNTED),
            ]
        elif kind in _VARIABLE:
            smallest = 1 if flexible else (2 if kind == "string" else 4)
            body = self._variable(where, kind, flexible, item_nullable)
            lines += [
                f"if C > (n - o) // {smallest}: raise _short('{where}: ' + str(C) + ' items')",
                "if C > 0:",
                *("    " + line for line in _COUNTED),
                "for _ in range(C):",
                *("    " + line for line in body),
            ]
        else:
            raise TypeError(f"unknown kafka type {kind!r} in {where}")
        return lines, size


_COMPILER = _Compiler()
_CHECKERS: dict[tuple[type[Any], type[Any]], tuple[Checker, Checker]] = {}


def _checkers(request_cls: type[Any], header_cls: type[Any]) -> tuple[Checker, Checker]:
    pair = _CHECKERS.get((request_cls, header_cls))
    if pair is None:
        namespace = _COMPILER.namespace
        header = namespace[_COMPILER.entity(header_cls, header=True)]
        body = namespace[_COMPILER.entity(request_cls)]
        pair = _CHECKERS[(request_cls, header_cls)] = (header, body)
    return pair


def check_request(
    frame: bytes, request_cls: type[Any], header_cls: type[Any], max_items: int | None = None
) -> bytes:
    """Raise :class:`Malformed` unless ``frame`` (a request without its size prefix)
    holds a header and a body of ``request_cls`` whose every declared size fits, with
    at most ``max_items`` array items in all (decoding time grows with them: a 32 MiB
    frame holds millions of six-byte partitions). Returns the frame for kio's reader:
    ``frame`` itself, or a copy without the tagged fields the schema does not know.

    Bytes after the body are allowed, as the decoder ignores them."""
    check_header, check_body = _checkers(request_cls, header_cls)
    n = len(frame)
    edits: list[Edit] = []
    state: list[Any] = [n if max_items is None else max_items, edits]
    offset = check_header(frame, 0, n, state)
    check_body(frame, offset, n, state)
    return _apply(frame, edits) if edits else frame
