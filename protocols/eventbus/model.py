"""Buses, rules and targets as the API takes them and storage keeps them (JSON), with
their checks, and the input transformation of a target.

Pure: no I/O. Bad documents raise :class:`DefinitionError` naming the field.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from polymq.protocols.eventbus.patterns import Pattern, PatternError, compile_pattern

__all__ = [
    "DEFAULT_BUS",
    "Bus",
    "DefinitionError",
    "Retry",
    "Rule",
    "Target",
    "Transform",
    "bus_topic",
    "check_name",
]

DEFAULT_BUS: Final = "default"
TARGET_TYPES: Final = ("topic", "queue", "http")
MAX_TARGETS: Final = 5  # as EventBridge: five targets per rule
MAX_ATTEMPTS: Final = 10
MAX_BACKOFF_MS: Final = 30_000
DEFAULT_RETENTION_MS: Final = 7 * 24 * 3600 * 1000
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")


class DefinitionError(ValueError):
    """A bus, rule or target document that is not valid."""


def check_name(kind: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        raise DefinitionError(
            f"{kind} name {name!r} is not valid: letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 127 characters"
        )
    return name


def bus_topic(bus: str) -> str:
    """The storage topic holding a bus's events (its archive too)."""
    return f"%EVENTBUS%{bus}"


def _object(document: Any, what: str) -> Mapping[str, Any]:
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise DefinitionError(f"{what} is a JSON object")
    return document


def _int(document: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = document.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DefinitionError(f"{key} must be an integer from {low} to {high}")
    return value


@dataclass(frozen=True, slots=True)
class Bus:
    """``sources``: storage topics whose messages enter the bus as events (read with
    the bus's own consumer group, beside the bus's topic)."""

    name: str
    retention_ms: int = DEFAULT_RETENTION_MS
    sources: tuple[str, ...] = ()

    @staticmethod
    def parse(name: str, document: Any) -> Bus:
        check_name("bus", name)
        doc = _object(document, "a bus")
        unknown = set(doc) - {"retention_ms", "sources"}
        if unknown:
            raise DefinitionError(f"unknown bus field(s): {sorted(unknown)}")
        retention = _int(doc, "retention_ms", DEFAULT_RETENTION_MS, 60_000, 365 * 86_400_000)
        sources = doc.get("sources", [])
        if not isinstance(sources, list) or not all(
            isinstance(s, str) and s and not s.startswith("%") for s in sources
        ):
            raise DefinitionError("sources is an array of storage topic names")
        return Bus(name=name, retention_ms=retention, sources=tuple(dict.fromkeys(sources)))

    def to_json(self) -> dict[str, Any]:
        return {"retention_ms": self.retention_ms, "sources": list(self.sources)}


@dataclass(frozen=True, slots=True)
class Retry:
    """Tries of an HTTP target: ``maximum_attempts`` in all, ``backoff_ms`` before the
    second, doubling after each failure (capped at :data:`MAX_BACKOFF_MS`)."""

    maximum_attempts: int = 3
    backoff_ms: int = 1_000

    def delay_ms(self, failed: int) -> int:
        return int(min(self.backoff_ms * 2 ** (failed - 1), MAX_BACKOFF_MS))


_PATH_STEP: Final = re.compile(r"\.([A-Za-z0-9_$-]+)|\[(\d+)\]|\['([^']*)'\]")


def parse_path(path: str) -> tuple[str | int, ...]:
    """``$``, ``$.a.b``, ``$.a[0]``, ``$['a b']``: the JSONPath subset of selections."""
    if not isinstance(path, str) or not path.startswith("$"):
        raise DefinitionError(f"a JSON path starts with '$': {path!r}")
    steps: list[str | int] = []
    at = 1
    while at < len(path):
        step = _PATH_STEP.match(path, at)
        if step is None:
            raise DefinitionError(f"JSON path {path!r}: cannot read it at {path[at:]!r}")
        name, index, quoted = step.groups()
        steps.append(int(index) if index is not None else name if name is not None else quoted)
        at = step.end()
    return tuple(steps)


def select(document: Any, steps: tuple[str | int, ...]) -> Any:
    """The value at ``steps``; ``None`` when it is not there."""
    for step in steps:
        if isinstance(step, int):
            if not isinstance(document, list) or step >= len(document):
                return None
        elif not isinstance(document, dict) or step not in document:
            return None
        document = document[step]
    return document


_PLACEHOLDER: Final = re.compile(r"<([A-Za-z0-9_]+)>")


@dataclass(frozen=True, slots=True)
class Transform:
    """An input transformation (EventBridge's input path / input transformer):
    ``path`` sends the value at one JSON path; ``paths`` names values by JSON path and
    ``template`` puts them into text at ``<name>`` (JSON-encoded when not strings);
    ``paths`` alone sends them as a JSON object. Paths run over the event's
    structured form (``$.data.x``, ``$.source``)."""

    path: tuple[str | int, ...] | None = None
    paths: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    template: str | None = None
    source: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def parse(document: Any) -> Transform | None:
        if document is None:
            return None
        doc = _object(document, "input")
        unknown = set(doc) - {"path", "paths", "template"}
        if unknown or not doc:
            raise DefinitionError("input takes 'path', or 'paths' with an optional 'template'")
        if "path" in doc:
            if len(doc) > 1:
                raise DefinitionError("input 'path' stands alone")
            return Transform(path=parse_path(doc["path"]), source=doc)
        raw_paths = _object(doc.get("paths", {}), "input paths")
        paths = {}
        for name, path in raw_paths.items():
            if not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise DefinitionError(f"input paths: {name!r} is not a valid name")
            paths[name] = parse_path(path)
        template = doc.get("template")
        if template is not None:
            if not isinstance(template, str):
                raise DefinitionError("input template is a string")
            missing = set(_PLACEHOLDER.findall(template)) - set(paths)
            if missing:
                raise DefinitionError(f"input template names unknown value(s) {sorted(missing)}")
        elif not paths:
            raise DefinitionError("input takes 'path', or 'paths' with an optional 'template'")
        return Transform(paths=paths, template=template, source=doc)

    def apply(self, structured: Mapping[str, Any]) -> tuple[bytes, str]:
        """The new data and its content type."""
        if self.path is not None:
            value = select(structured, self.path)
            return _json_bytes(value), "application/json"
        values = {name: select(structured, steps) for name, steps in self.paths.items()}
        if self.template is None:
            return _json_bytes(values), "application/json"

        def fill(match: re.Match[str]) -> str:
            value = values[match.group(1)]
            return value if isinstance(value, str) else json.dumps(value)

        text = _PLACEHOLDER.sub(fill, self.template)
        try:
            json.loads(text)
            return text.encode(), "application/json"
        except ValueError:
            return text.encode(), "text/plain; charset=utf-8"


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class Target:
    """Where a matching event goes. ``topic``: append to a storage topic; ``queue``:
    to an MNS queue (a storage topic of that name that MNS serves); ``http``: POST
    to ``endpoint`` in ``mode`` structured or binary, with ``retry``."""

    id: str
    type: str
    name: str | None = None
    endpoint: str | None = None
    mode: str = "structured"
    retry: Retry = Retry()
    input: Transform | None = None

    @staticmethod
    def parse(document: Any, where: str) -> Target:
        doc = _object(document, where)
        target_id = doc.get("id")
        if not isinstance(target_id, str) or not target_id:
            raise DefinitionError(f"{where}: 'id' is a non-empty string")
        kind = doc.get("type")
        if kind not in TARGET_TYPES:
            raise DefinitionError(f"{where}: 'type' is one of {', '.join(TARGET_TYPES)}")
        allowed = {"id", "type", "input"} | (
            {"endpoint", "mode", "retry"} if kind == "http" else {"name"}
        )
        unknown = set(doc) - allowed
        if unknown:
            raise DefinitionError(f"{where}: unknown field(s) {sorted(unknown)} for {kind}")
        try:
            transform = Transform.parse(doc.get("input"))
        except DefinitionError as e:
            raise DefinitionError(f"{where}: {e}") from None
        if kind != "http":
            name = doc.get("name")
            if not isinstance(name, str) or not name or name.startswith("%"):
                raise DefinitionError(f"{where}: 'name' is the {kind}'s name")
            return Target(id=target_id, type=kind, name=name, input=transform)
        endpoint = doc.get("endpoint")
        parts = urllib.parse.urlsplit(endpoint) if isinstance(endpoint, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise DefinitionError(f"{where}: 'endpoint' is an http:// or https:// URL")
        mode = doc.get("mode", "structured")
        if mode not in ("structured", "binary"):
            raise DefinitionError(f"{where}: 'mode' is structured or binary")
        retry_doc = _object(doc.get("retry"), f"{where}: retry")
        if set(retry_doc) - {"maximum_attempts", "backoff_ms"}:
            raise DefinitionError(f"{where}: retry takes maximum_attempts and backoff_ms")
        retry = Retry(
            maximum_attempts=_int(retry_doc, "maximum_attempts", 3, 1, MAX_ATTEMPTS),
            backoff_ms=_int(retry_doc, "backoff_ms", 1_000, 0, MAX_BACKOFF_MS),
        )
        return Target(
            id=target_id, type=kind, endpoint=endpoint, mode=mode, retry=retry, input=transform
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": self.type}
        if self.type == "http":
            out |= {
                "endpoint": self.endpoint,
                "mode": self.mode,
                "retry": {
                    "maximum_attempts": self.retry.maximum_attempts,
                    "backoff_ms": self.retry.backoff_ms,
                },
            }
        else:
            out["name"] = self.name
        if self.input is not None:
            out["input"] = dict(self.input.source)
        return out


@dataclass(frozen=True, slots=True)
class Rule:
    """A pattern and the targets of the events it matches; ``dead_letter``: a topic
    or queue target taking events an HTTP target gave up on."""

    bus: str
    name: str
    pattern: Pattern
    targets: tuple[Target, ...]
    dead_letter: Target | None = None

    @staticmethod
    def parse(bus: str, name: str, document: Any) -> Rule:
        check_name("rule", name)
        doc = _object(document, "a rule")
        unknown = set(doc) - {"pattern", "targets", "dead_letter"}
        if unknown:
            raise DefinitionError(f"unknown rule field(s): {sorted(unknown)}")
        if "pattern" not in doc:
            raise DefinitionError("a rule needs a 'pattern'")
        try:
            pattern = compile_pattern(doc["pattern"])
        except PatternError as e:
            raise DefinitionError(f"pattern: {e}") from None
        raw_targets = doc.get("targets", [])
        if not isinstance(raw_targets, list) or not 1 <= len(raw_targets) <= MAX_TARGETS:
            raise DefinitionError(f"'targets' is an array of 1 to {MAX_TARGETS} targets")
        targets = tuple(Target.parse(t, f"targets[{i}]") for i, t in enumerate(raw_targets))
        ids = [t.id for t in targets]
        if len(set(ids)) != len(ids):
            raise DefinitionError("target ids must differ")
        dead_letter = None
        if doc.get("dead_letter") is not None:
            raw = {"id": "dead-letter", **_object(doc["dead_letter"], "dead_letter")}
            dead_letter = Target.parse(raw, "dead_letter")
            if dead_letter.type == "http":
                raise DefinitionError("dead_letter is a topic or queue target")
        return Rule(bus=bus, name=name, pattern=pattern, targets=targets, dead_letter=dead_letter)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pattern": self.pattern.source,
            "targets": [t.to_json() for t in self.targets],
        }
        if self.dead_letter is not None:
            dead = self.dead_letter.to_json()
            dead.pop("id")
            out["dead_letter"] = dead
        return out
