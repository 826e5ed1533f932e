"""CloudEvents 1.0: the event, its checks, and its HTTP content modes.

The spec (github.com/cloudevents/spec, v1.0.2): ``spec.md`` for the attributes and
their types, ``formats/json-format.md`` for structured and batched mode,
``bindings/http-protocol-binding.md`` for binary mode (``ce-`` headers, the body as
``data``, ``Content-Type`` as ``datacontenttype``). Every problem raises
:class:`EventError` naming the attribute (and the event's index in a batch).

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "BATCH_TYPE",
    "STRUCTURED_TYPE",
    "CloudEvent",
    "EventError",
    "is_json_type",
    "parse_batch",
    "parse_binary",
    "parse_structured",
]

STRUCTURED_TYPE: Final = "application/cloudevents+json"
BATCH_TYPE: Final = "application/cloudevents-batch+json"
SPEC_VERSION: Final = "1.0"
REQUIRED: Final = ("id", "source", "specversion", "type")
# Context attributes the spec defines (spec.md "Context Attributes"); others are
# extensions. "data"/"data_base64" are the JSON format's members for the data.
CONTEXT: Final = (*REQUIRED, "datacontenttype", "dataschema", "subject", "time")
_NAME: Final = re.compile(r"[a-z0-9]{1,20}")
_MAX_INT: Final = 2**31 - 1  # spec.md "Type System": Integer is 32-bit signed
_RFC3339: Final = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
)

Attribute = str | int | bool


class EventError(ValueError):
    """An event that is not a valid CloudEvent; the message says which attribute and
    why, prefixed with the event's index in a batch."""


@dataclass(frozen=True, slots=True)
class CloudEvent:
    """One event. ``attributes``: context attributes and extensions by name (values
    of the spec's types: strings, integers, booleans); ``data``: the data as bytes
    (``None`` when absent); ``data_json``: the data as JSON when it is JSON (what
    event patterns look into)."""

    attributes: Mapping[str, Attribute]
    data: bytes | None = None
    data_json: Any = field(default=None)
    has_json: bool = False

    @property
    def id(self) -> str:
        return str(self.attributes["id"])

    @property
    def content_type(self) -> str | None:
        value = self.attributes.get("datacontenttype")
        return None if value is None else str(value)

    def view(self) -> dict[str, Any]:
        """The event as event patterns see it: the attributes at the top, the data
        under ``data`` (its JSON, else its text, else absent)."""
        out: dict[str, Any] = dict(self.attributes)
        if self.has_json:
            out["data"] = self.data_json
        elif self.data is not None:
            with contextlib.suppress(UnicodeDecodeError):
                out["data"] = self.data.decode()
        return out

    def to_json(self) -> dict[str, Any]:
        """The structured-mode JSON object (json-format.md: JSON data as ``data``,
        text as a string, other bytes as ``data_base64``)."""
        out: dict[str, Any] = dict(self.attributes)
        if self.has_json:
            out["data"] = self.data_json
        elif self.data is not None:
            try:
                if self.content_type is None or self.content_type.startswith("text/"):
                    out["data"] = self.data.decode()
                else:
                    raise UnicodeDecodeError("utf-8", b"", 0, 1, "binary type")
            except UnicodeDecodeError:
                out["data_base64"] = base64.b64encode(self.data).decode()
        return out


def is_json_type(content_type: str | None) -> bool:
    """``application/json``, ``text/json`` or any ``+json`` type (json-format.md 3.1)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")


def check_attributes(raw: Mapping[str, Any], where: str = "") -> dict[str, Attribute]:
    """The attributes of ``raw`` checked against spec.md: required ones present and
    non-empty, ``specversion`` 1.0, each defined attribute of its type, extension
    names lowercase letters and digits, at most 20 characters."""
    out: dict[str, Attribute] = {}
    for name, value in raw.items():
        if name in ("data", "data_base64"):
            continue
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise EventError(
                f"{where}attribute name {name!r} is not valid: lowercase letters and digits "
                "only, at most 20 characters (spec.md, Attribute Naming Convention)"
            )
        if value is None:
            continue  # json-format.md: null is the same as absent
        out[name] = _check_value(name, value, where)
    for name in REQUIRED:
        if name not in out:
            raise EventError(f"{where}required attribute {name!r} is missing")
    if out["specversion"] != SPEC_VERSION:
        raise EventError(
            f"{where}specversion {out['specversion']!r} is not supported: only '1.0' is"
        )
    return out


def _check_value(name: str, value: Any, where: str) -> Attribute:
    if name in CONTEXT:
        if not isinstance(value, str):
            raise EventError(f"{where}attribute {name!r} must be a string, not {_kind(value)}")
        if name in ("id", "source", "type", "subject", "specversion") and not value:
            raise EventError(f"{where}attribute {name!r} must not be empty")
        if name == "time":
            _check_time(value, where)
        elif name == "dataschema":
            if not urllib.parse.urlsplit(value).scheme:
                raise EventError(f"{where}dataschema {value!r} must be an absolute URI")
        elif name == "source" and any(c.isspace() for c in value):
            raise EventError(f"{where}source {value!r} is not a URI-reference")
        return value
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if not -_MAX_INT - 1 <= value <= _MAX_INT:
            raise EventError(f"{where}extension {name!r}: integers are 32-bit signed")
        return value
    raise EventError(
        f"{where}extension {name!r} must be a string, an integer or a boolean, not {_kind(value)}"
    )


def _check_time(value: str, where: str) -> None:
    if not _RFC3339.fullmatch(value):
        raise EventError(f"{where}time {value!r} is not an RFC 3339 timestamp")
    try:
        datetime.datetime.fromisoformat(value.replace("z", "Z").replace("t", "T"))
    except ValueError:
        raise EventError(f"{where}time {value!r} is not a valid date and time") from None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def from_json_object(raw: Any, where: str = "") -> CloudEvent:
    """One event of the JSON format (json-format.md)."""
    if not isinstance(raw, dict):
        raise EventError(f"{where}an event is a JSON object, not {_kind(raw)}")
    attributes = check_attributes(raw, where)
    content_type = attributes.get("datacontenttype")
    if "data" in raw and "data_base64" in raw:
        raise EventError(f"{where}an event has 'data' or 'data_base64', not both")
    if "data_base64" in raw:
        encoded = raw["data_base64"]
        if not isinstance(encoded, str):
            raise EventError(f"{where}data_base64 must be a string")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise EventError(f"{where}data_base64 is not valid base64") from None
        return _with_data(attributes, data, where)
    if "data" not in raw:
        return CloudEvent(attributes=attributes)
    value = raw["data"]
    if isinstance(value, str) and content_type is not None and not is_json_type(str(content_type)):
        return CloudEvent(attributes=attributes, data=value.encode())  # text data
    # JSON data: kept as JSON; its bytes are its JSON text.
    if content_type is None:
        attributes = {**attributes, "datacontenttype": "application/json"}
    encoded_json = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return CloudEvent(attributes=attributes, data=encoded_json, data_json=value, has_json=True)


def _with_data(attributes: dict[str, Attribute], data: bytes, where: str) -> CloudEvent:
    content_type = attributes.get("datacontenttype")
    if is_json_type(str(content_type) if content_type else None) and data:
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise EventError(f"{where}data is not valid JSON as {content_type} says") from None
        return CloudEvent(attributes=attributes, data=data, data_json=parsed, has_json=True)
    return CloudEvent(attributes=attributes, data=data)


def _load(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise EventError(f"the body is not valid JSON: {e}") from None


def parse_structured(body: bytes) -> CloudEvent:
    """``application/cloudevents+json``: one event."""
    return from_json_object(_load(body))


def parse_batch(body: bytes, *, max_events: int) -> list[CloudEvent]:
    """``application/cloudevents-batch+json``: a JSON array of events (may be empty)."""
    raw = _load(body)
    if not isinstance(raw, list):
        raise EventError(f"a batch is a JSON array of events, not {_kind(raw)}")
    if len(raw) > max_events:
        raise EventError(f"a batch holds at most {max_events} events, got {len(raw)}")
    return [from_json_object(item, f"event {i}: ") for i, item in enumerate(raw)]


def parse_binary(headers: Iterable[tuple[str, str]], body: bytes) -> CloudEvent:
    """Binary mode: attributes in ``ce-`` headers (values percent-decoded, http
    binding 3.1.3.2), ``Content-Type`` as ``datacontenttype``, the body as data."""
    raw: dict[str, Any] = {}
    content_type: str | None = None
    for name, value in headers:
        lower = name.lower()
        if lower == "content-type":
            content_type = value
        elif lower.startswith("ce-"):
            attribute = lower[3:]
            if attribute in raw:
                raise EventError(f"header ce-{attribute} is repeated")
            raw[attribute] = urllib.parse.unquote(value)
    if "specversion" not in raw:
        raise EventError(
            "not a CloudEvent: binary mode needs ce-specversion (and ce-id, ce-source, "
            f"ce-type) headers; structured mode needs Content-Type {STRUCTURED_TYPE}"
        )
    if content_type is not None:
        raw["datacontenttype"] = content_type
    attributes = check_attributes(raw)
    # Header values are strings; extensions keep that type (the binding has no other).
    if not body:
        return CloudEvent(attributes=attributes)
    if content_type is None and body.lstrip()[:1] in (b"{", b"["):
        # No Content-Type (SDKs send none for JSON data): JSON if it parses.
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return CloudEvent(attributes=attributes, data=body)
        return CloudEvent(attributes=attributes, data=body, data_json=parsed, has_json=True)
    return _with_data(attributes, body, "")
