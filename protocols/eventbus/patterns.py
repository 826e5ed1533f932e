"""Event patterns: the EventBridge pattern language, compiled once and matched against
events (a CloudEvent as a JSON object, its JSON ``data`` under ``data``).

A pattern is a JSON object with the event's nesting. A field holding an object matches
the event's object field by field; a field holding an array lists the allowed values
(any one suffices: OR), every field must match (AND). Array elements are literals
(string, number, boolean, ``null``) or one-key operator objects: ``prefix``,
``suffix``, ``anything-but``, ``numeric``, ``exists``, ``cidr``, ``wildcard``,
``equals-ignore-case``, ``contains`` (Alibaba's). ``$or`` at any level takes a list
of sub-patterns, any of which must match. When the event's value is an array, it
matches if any element matches. (AWS EventBridge user guide, "Content filtering in
Amazon EventBridge event patterns"; Alibaba Cloud EventBridge, "Event patterns".)

Pure: no I/O, no asyncio. Bad patterns raise :class:`PatternError` naming the path.
"""

from __future__ import annotations

import ipaddress
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "MISSING",
    "IndexKey",
    "Pattern",
    "PatternError",
    "compile_pattern",
    "value_key",
    "values_at",
]

MAX_DEPTH: Final = 16
MAX_VALUES: Final = 1_000  # allowed values in one pattern, all fields together


class PatternError(ValueError):
    """A pattern that is not valid, with the JSON path of the offending part."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
_NOTHING: Final = (MISSING,)

Matcher = Callable[[Any], bool]
ValueKey = tuple[str, Any]
# How a rule is found without matching it: (path, "=", value key) for a literal value,
# (path, "^", text) for a case-sensitive prefix, (path, "$", text) for a suffix.
IndexKey = tuple[tuple[str, ...], str, Any]


def value_key(value: Any) -> ValueKey | None:
    """A hashable key equal for values an exact match treats as equal (``3`` and
    ``3.0``; never ``"3"`` and ``3``, nor ``true`` and ``1``); ``None`` for values no
    literal can equal (objects, arrays)."""
    if value is None:
        return ("z", None)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", float(value))
    if isinstance(value, str):
        return ("s", value)
    return None


def values_at(event: Any, path: Sequence[str]) -> Sequence[Any]:
    """The leaf values at ``path``: arrays on the way (of objects) and at the end are
    looked into element by element; ``(MISSING,)`` if nothing is there."""
    node = event
    for step in path:  # the common case, objects all the way: no generators
        if not isinstance(node, dict):
            break
        if step not in node:
            return _NOTHING
        node = node[step]
    else:
        return node if isinstance(node, list) else (node,)
    found: list[Any] = []
    for value in _walk(event, path, 0):
        if isinstance(value, list):
            found.extend(value)
        else:
            found.append(value)
    return found if found or _reached(event, path) else _NOTHING


def _reached(event: Any, path: Sequence[str]) -> bool:
    """Whether ``path`` leads anywhere (an empty array there is not a missing field)."""
    return any(True for _ in _walk(event, path, 0))


def _walk(node: Any, path: Sequence[str], i: int) -> Iterator[Any]:
    if i == len(path):
        yield node
        return
    if isinstance(node, dict):
        if path[i] in node:
            yield from _walk(node[path[i]], path, i + 1)
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, dict):
                yield from _walk(item, path, i)


@dataclass(frozen=True, slots=True)
class _Field:
    """One leaf field: its path from the pattern's root and its allowed values."""

    path: tuple[str, ...]
    matchers: tuple[Matcher, ...]
    exact: tuple[ValueKey, ...] | None  # the allowed values when all are literals
    affixes: tuple[tuple[str, str], ...] | None  # ("^" or "$", text) when all are plain
    wants_missing: bool  # ``exists: false`` among them

    def matches(self, event: Any) -> bool:
        for value in values_at(event, self.path):
            if value is MISSING:
                return self.wants_missing
            if any(m(value) for m in self.matchers):
                return True
        return False


@dataclass(frozen=True, slots=True)
class _Node:
    """An AND of fields and of ``$or`` groups (each an OR of nodes)."""

    fields: tuple[_Field, ...]
    alternatives: tuple[tuple[_Node, ...], ...]

    def matches(self, event: Any) -> bool:
        return all(f.matches(event) for f in self.fields) and all(
            any(node.matches(event) for node in group) for group in self.alternatives
        )


@dataclass(frozen=True, slots=True)
class Pattern:
    """A compiled pattern. ``index_keys``: keys one of which every event it matches
    has (:func:`_index_keys`), so a rule index finds it by them; ``None`` when there
    are none (such rules are matched against every event)."""

    source: Mapping[str, Any]
    root: _Node
    index_keys: tuple[IndexKey, ...] | None

    def matches(self, event: Mapping[str, Any]) -> bool:
        return self.root.matches(event)


def compile_pattern(pattern: Any) -> Pattern:
    """Check ``pattern`` and compile it; :class:`PatternError` if it is not valid."""
    if not isinstance(pattern, dict):
        raise PatternError("a pattern is a JSON object")
    budget = [MAX_VALUES]
    root = _compile_node(pattern, (), budget, 0)
    return Pattern(source=pattern, root=root, index_keys=_index_keys(root))


def _index_keys(node: _Node) -> tuple[IndexKey, ...] | None:
    """The keys of the node's most selective field: literal values first (fewest
    values, then the deeper path: ``source``/``type`` are shared by many rules, a
    field in ``data`` is usually the selective one), then plain prefixes or suffixes. A node
    without one is still indexed when one of its ``$or`` groups has keys in every
    alternative: it is found by any of them."""
    exact = [f for f in node.fields if f.exact is not None and not f.wants_missing]
    if exact:
        best = min(exact, key=lambda f: (len(f.exact or ()), -len(f.path)))
        return tuple((best.path, "=", key) for key in best.exact or ())
    affixed = [f for f in node.fields if f.affixes is not None and not f.wants_missing]
    if affixed:
        best = min(affixed, key=lambda f: (len(f.affixes or ()), -len(f.path)))
        return tuple((best.path, kind, text) for kind, text in best.affixes or ())
    for group in node.alternatives:
        keys: list[IndexKey] = []
        for alternative in group:
            found = _index_keys(alternative)
            if found is None:
                break
            keys.extend(found)
        else:
            return tuple(dict.fromkeys(keys))
    return None


def _where(path: tuple[str, ...]) -> str:
    return ".".join(path) or "the pattern"


def _compile_node(
    pattern: Mapping[str, Any], path: tuple[str, ...], budget: list[int], depth: int
) -> _Node:
    if depth > MAX_DEPTH:
        raise PatternError(f"{_where(path)}: nested deeper than {MAX_DEPTH} levels")
    if not pattern:
        raise PatternError(f"{_where(path)}: an empty object matches nothing")
    fields: list[_Field] = []
    alternatives: list[tuple[_Node, ...]] = []
    nodes: list[_Node] = []
    for name, value in pattern.items():
        if not isinstance(name, str):
            raise PatternError(f"{_where(path)}: field names are strings")
        if name == "$or":
            if not isinstance(value, list) or len(value) < 2:
                raise PatternError(f"{_where(path)}.$or: takes an array of at least 2 patterns")
            group = []
            for i, sub in enumerate(value):
                if not isinstance(sub, dict):
                    raise PatternError(f"{_where(path)}.$or[{i}]: each alternative is an object")
                group.append(_compile_node(sub, path, budget, depth + 1))
            alternatives.append(tuple(group))
            continue
        here = (*path, name)
        if isinstance(value, dict):
            nodes.append(_compile_node(value, here, budget, depth + 1))
        elif isinstance(value, list):
            fields.append(_compile_field(value, here, budget))
        else:
            raise PatternError(
                f"{_where(here)}: a field's allowed values are an array (or an object to "
                f"match nested fields), not {json_type(value)}"
            )
    # Nested objects are ANDed in: their fields carry full paths, so flatten them.
    for node in nodes:
        fields.extend(node.fields)
        alternatives.extend(node.alternatives)
    return _Node(fields=tuple(fields), alternatives=tuple(alternatives))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _compile_field(values: list[Any], path: tuple[str, ...], budget: list[int]) -> _Field:
    where = _where(path)
    if not values:
        raise PatternError(f"{where}: an empty array of allowed values matches nothing")
    budget[0] -= len(values)
    if budget[0] < 0:
        raise PatternError(f"{where}: more than {MAX_VALUES} values in the pattern")
    matchers: list[Matcher] = []
    exact: list[ValueKey] = []
    affixes: list[tuple[str, str]] = []
    all_exact = True
    wants_missing = False
    for value in values:
        if isinstance(value, dict):
            all_exact = False
            for name, kind in (("prefix", "^"), ("suffix", "$")):
                text = value.get(name)
                if isinstance(text, str) and text and len(value) == 1:
                    affixes.append((kind, text))
            matcher, missing = _operator(value, where)
            wants_missing = wants_missing or missing
            if matcher is not None:
                matchers.append(matcher)
            continue
        key = value_key(value)
        if key is None:
            raise PatternError(f"{where}: allowed values are literals or operators, not arrays")
        exact.append(key)
    if exact:
        allowed = frozenset(exact)

        def literal(value: Any) -> bool:
            return value_key(value) in allowed

        matchers.append(literal)
    return _Field(
        path=path,
        matchers=tuple(matchers),
        exact=tuple(dict.fromkeys(exact)) if all_exact else None,
        affixes=tuple(affixes) if affixes and len(affixes) == len(values) else None,
        wants_missing=wants_missing,
    )


_OPERATORS: Final = (
    "prefix",
    "suffix",
    "anything-but",
    "numeric",
    "exists",
    "cidr",
    "wildcard",
    "equals-ignore-case",
    "contains",
)


def _operator(spec: dict[str, Any], where: str) -> tuple[Matcher | None, bool]:
    """The matcher of one operator object, and whether it asks for a missing field
    (``exists: false``, which matches no present value)."""
    if len(spec) != 1:
        raise PatternError(f"{where}: an operator object has exactly one key, got {sorted(spec)}")
    ((name, arg),) = spec.items()
    if name not in _OPERATORS:
        raise PatternError(f"{where}: unknown operator {name!r} (known: {', '.join(_OPERATORS)})")
    here = f"{where}.{name}"
    if name == "exists":
        if not isinstance(arg, bool):
            raise PatternError(f"{here}: takes true or false")
        return (_present if arg else None), not arg
    if name in ("prefix", "suffix"):
        return _affix(name, arg, here), False
    if name == "equals-ignore-case":
        text = _string(arg, here).casefold()
        return (lambda v: isinstance(v, str) and v.casefold() == text), False
    if name == "contains":
        part = _string(arg, here)
        return (lambda v: isinstance(v, str) and part in v), False
    if name == "wildcard":
        regex = _wildcard(_string(arg, here), here)
        return (lambda v: isinstance(v, str) and regex.fullmatch(v) is not None), False
    if name == "numeric":
        return _numeric(arg, here), False
    if name == "cidr":
        return _cidr(arg, here), False
    return _anything_but(arg, here), False


def _present(value: Any) -> bool:
    return True


def _string(arg: Any, where: str) -> str:
    if not isinstance(arg, str):
        raise PatternError(f"{where}: takes a string, not {json_type(arg)}")
    return arg


def _affix(name: str, arg: Any, where: str) -> Matcher:
    folded = False
    if isinstance(arg, dict):
        if list(arg) != ["equals-ignore-case"]:
            raise PatternError(f"{where}: takes a string or {{'equals-ignore-case': string}}")
        arg = arg["equals-ignore-case"]
        folded = True
    text = _string(arg, where)
    if folded:
        text = text.casefold()
        if name == "prefix":
            return lambda v: isinstance(v, str) and v.casefold().startswith(text)
        return lambda v: isinstance(v, str) and v.casefold().endswith(text)
    if name == "prefix":
        return lambda v: isinstance(v, str) and v.startswith(text)
    return lambda v: isinstance(v, str) and v.endswith(text)


def _wildcard(text: str, where: str) -> re.Pattern[str]:
    """``*`` matches any run of characters, ``\\*`` a star; ``**`` is refused (as
    EventBridge does: it would only make the pattern slower)."""
    if "**" in text.replace("\\*", ""):
        raise PatternError(f"{where}: consecutive wildcard characters are not allowed")
    parts: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            if i + 1 < len(text) and text[i + 1] in "*\\":
                parts.append(re.escape(text[i + 1]))
                i += 2
                continue
            raise PatternError(f"{where}: a backslash escapes only '*' or '\\'")
        parts.append(".*" if ch == "*" else re.escape(ch))
        i += 1
    return re.compile("".join(parts), re.DOTALL)


_LOWER: Final[dict[str, Callable[[float, float], bool]]] = {">": operator.gt, ">=": operator.ge}
_UPPER: Final[dict[str, Callable[[float, float], bool]]] = {"<": operator.lt, "<=": operator.le}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numeric(arg: Any, where: str) -> Matcher:
    """``[op, n]`` or ``[lower-op, a, upper-op, b]``; ``=`` alone."""
    if not isinstance(arg, list) or len(arg) not in (2, 4):
        raise PatternError(f"{where}: takes [op, number] or [op, number, op, number]")
    checks: list[tuple[Callable[[float, float], bool], float]] = []
    seen: set[str] = set()
    for op, bound in zip(arg[::2], arg[1::2], strict=True):
        if not _is_number(bound) or not math.isfinite(bound):
            raise PatternError(f"{where}: {op!r} needs a finite number, not {json_type(bound)}")
        if op == "=":
            if len(arg) != 2:
                raise PatternError(f"{where}: '=' stands alone")
            checks.append((operator.eq, float(bound)))
            continue
        side = "lower" if op in _LOWER else "upper" if op in _UPPER else None
        if side is None:
            raise PatternError(f"{where}: unknown comparison {op!r} (<, <=, =, >, >=)")
        if side in seen:
            raise PatternError(f"{where}: two {side} bounds")
        seen.add(side)
        checks.append((_LOWER.get(op) or _UPPER[op], float(bound)))
    if len(arg) == 4 and seen != {"lower", "upper"}:
        raise PatternError(f"{where}: a range is one lower bound and one upper bound")

    def numeric(value: Any) -> bool:
        return _is_number(value) and all(c(float(value), b) for c, b in checks)

    return numeric


def _cidr(arg: Any, where: str) -> Matcher:
    try:
        network = ipaddress.ip_network(_string(arg, where), strict=False)
    except ValueError:
        raise PatternError(f"{where}: {arg!r} is not an IP address or CIDR block") from None

    def cidr(value: Any) -> bool:
        if not isinstance(value, str):
            return False
        try:
            return ipaddress.ip_address(value) in network
        except ValueError:
            return False

    return cidr


def _anything_but(arg: Any, where: str) -> Matcher:
    """Matches a present value none of ``arg`` matches: a literal, an array of
    strings or of numbers, or one of ``prefix``/``suffix``/``wildcard``/
    ``equals-ignore-case``."""
    inner: Matcher
    if isinstance(arg, dict):
        if len(arg) != 1:
            raise PatternError(f"{where}: takes one operator object")
        ((name, value),) = arg.items()
        if name in ("prefix", "suffix"):
            inner = _affix(name, value, f"{where}.{name}")
        elif name in ("wildcard", "equals-ignore-case"):
            texts = value if isinstance(value, list) else [value]
            if not texts:
                raise PatternError(f"{where}.{name}: takes a string or a non-empty array")
            ops = [_operator({name: _string(t, f"{where}.{name}")}, where)[0] for t in texts]
            matchers = [m for m in ops if m is not None]

            def inner(v: Any) -> bool:
                return any(m(v) for m in matchers)

        else:
            raise PatternError(
                f"{where}: takes a value, an array, or prefix/suffix/wildcard/"
                f"equals-ignore-case, not {name!r}"
            )
    else:
        values = arg if isinstance(arg, list) else [arg]
        if not values:
            raise PatternError(f"{where}: an empty array excludes nothing")
        keys = set()
        for v in values:
            if not (isinstance(v, str) or _is_number(v)):
                raise PatternError(f"{where}: excludes strings or numbers, not {json_type(v)}")
            keys.add(value_key(v))
        if len({k[0] for k in keys if k is not None}) > 1:
            raise PatternError(f"{where}: an array of strings or of numbers, not both")

        def inner(v: Any) -> bool:
            return value_key(v) in keys

    def anything_but(value: Any) -> bool:
        return not inner(value)

    return anything_but
