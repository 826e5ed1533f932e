"""MNS documents: request bodies in, response bodies out, as XML or JSON. Pure: bytes and
plain Python values only, no HTTP and no asyncio.

MNS speaks XML in the namespace ``http://mns.aliyuncs.com/doc/v1/`` (the
aliyun-mns-sdk's ``XMLNS``). Every document is one root element holding either leaf
elements with text, or repeated item elements (``<Messages><Message>...``). A parsed
document is plain data: a leaf is a ``str``, an element with children a ``dict``, and
a known list container (:data:`ITEM_TAGS`) a ``list`` of its items, even with one
item. JSON bodies (for curl) carry the same shapes without the root element.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from xml.parsers import expat

__all__ = [
    "ITEM_TAGS",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "XMLNS",
    "MalformedDocument",
    "Value",
    "XmlReader",
    "decode",
    "encode",
]

XMLNS = "http://mns.aliyuncs.com/doc/v1/"

# List containers and the tag of their items, as the MNS API reference names them.
ITEM_TAGS: Mapping[str, str] = {
    "Messages": "Message",
    "ReceiptHandles": "ReceiptHandle",
    "Queues": "Queue",
    "Topics": "Topic",
    "Subscriptions": "Subscription",
    "Errors": "Error",
    "UserProperties": "PropertyValue",
    "SystemProperties": "SystemPropertyValue",
}

Value = str | int | bool | None | Mapping[str, Any] | Sequence[Any]


class MalformedDocument(ValueError):
    """The body is not a well-formed MNS document (MNS's ``MalformedXML``)."""


# Documents are small (a batch is 16 messages of a few fields); these bounds keep a
# hostile one from costing more than a legitimate one (the request reader passes
# limits.max_nesting_depth and limits.max_batch_items).
MAX_DEPTH = 64
MAX_ITEMS = 10_000


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _refuse_dtd(*_: object) -> None:
    raise MalformedDocument("document type declarations are not accepted")


class _Open:
    """An element being read: its local name, text, and children as (name, value)."""

    __slots__ = ("children", "name", "text")

    def __init__(self, name: str) -> None:
        self.name = name
        self.text: list[str] = []
        self.children: list[tuple[str, Any]] = []

    def value(self) -> Any:
        name, children = self.name, self.children
        if name in ITEM_TAGS:
            item = ITEM_TAGS[name]
            if any(tag != item for tag, _ in children):
                raise MalformedDocument(f"<{name}> may only hold <{item}> elements")
            return [value for _, value in children]
        if not children:
            text = "".join(self.text)
            return text if name == "MessageBody" else text.strip()
        fields: dict[str, Any] = {}
        for key, value in children:
            if key in fields:
                raise MalformedDocument(f"<{key}> appears twice in <{name}>")
            fields[key] = value
        return fields


class XmlReader:
    """Builds the plain-data document from expat's events, with an explicit stack:
    no recursion, whatever the nesting, and parsing stops at the first element past
    ``max_depth`` or ``max_items`` and at any DTD (entities are the billion-laughs
    door; MNS documents never need one). Fed in pieces, so that a caller can hand
    the event loop back between them: each element costs a few microseconds here."""

    def __init__(self, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> None:
        self._max_depth = max_depth
        self._max_items = max_items
        self._elements = 0
        self._stack: list[_Open] = []
        self.root: tuple[str, Any] | None = None
        parser = expat.ParserCreate(namespace_separator="}")
        parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        parser.buffer_text = True
        parser.StartDoctypeDeclHandler = _refuse_dtd
        parser.EntityDeclHandler = _refuse_dtd
        parser.StartElementHandler = self._start
        parser.EndElementHandler = self._end
        parser.CharacterDataHandler = self._text
        self._parser = parser

    def _start(self, tag: str, _attributes: object) -> None:
        self._elements += 1
        if self._elements > self._max_items:
            raise MalformedDocument(f"the document has more than {self._max_items} elements")
        if len(self._stack) >= self._max_depth:
            raise MalformedDocument(f"the document nests deeper than {self._max_depth}")
        self._stack.append(_Open(_local(tag)))

    def _end(self, _tag: str) -> None:
        done = self._stack.pop()
        value = done.value()
        if self._stack:
            self._stack[-1].children.append((done.name, value))
        else:
            self.root = (done.name, value)

    def _text(self, text: str) -> None:
        if self._stack:
            self._stack[-1].text.append(text)

    def feed(self, data: bytes) -> None:
        self._parse(data, final=False)

    def close(self) -> tuple[str, Any]:
        """The root's name and value (``{}`` for an empty root: ``<Queue/>`` creates
        with defaults)."""
        self._parse(b"", final=True)
        if self.root is None:  # expat refuses a document without a root; to be sure
            raise MalformedDocument("the body has no root element")
        name, value = self.root
        return name, {} if value == "" else value

    def _parse(self, data: bytes, *, final: bool) -> None:
        try:
            self._parser.Parse(data, final)
        except expat.ExpatError as e:
            raise MalformedDocument(f"the body is not well-formed XML: {e}") from None
        except (LookupError, ValueError) as e:
            # encoding="..." that Python does not know (LookupError), or a multi-byte
            # one expat cannot take from Python (utf-7, shift_jis: ValueError).
            raise MalformedDocument(f"the body's encoding is not supported: {e}") from None


def _check_json_shape(value: Any, max_depth: int, max_items: int) -> None:
    """Nesting and entries of a parsed JSON document, walked without recursion; each
    container's length is counted before it is looked into, so the walk costs at
    most ``max_items`` steps."""
    items = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > max_depth:
            raise MalformedDocument(f"the document nests deeper than {max_depth}")
        items += len(container)
        if items > max_items:
            raise MalformedDocument(f"the document has more than {max_items} entries")
        children = container.values() if isinstance(container, dict) else container
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _decode_json(data: bytes, max_depth: int, max_items: int) -> Any:
    try:
        value = json.loads(data)
    except RecursionError:
        # json's C scanner stops at the interpreter's recursion limit (about 1,000
        # levels, cheaply); anything that deep is far past max_depth anyway.
        raise MalformedDocument(f"the document nests deeper than {max_depth}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedDocument(f"the body is not valid JSON: {e}") from None
    if isinstance(value, dict | list):
        _check_json_shape(value, max_depth, max_items)
    return value


def decode(
    data: bytes,
    *,
    json_body: bool,
    max_depth: int = MAX_DEPTH,
    max_items: int = MAX_ITEMS,
) -> tuple[str | None, Any]:
    """The root element's name (``None`` for JSON) and the document's value.

    An empty body decodes to ``(None, {})``: several MNS calls take no body. Anything
    not well-formed, nested deeper than ``max_depth`` or holding more than
    ``max_items`` elements (XML) or entries (JSON) is :class:`MalformedDocument`."""
    if not data.strip():
        return None, {}
    if json_body:
        return None, _decode_json(data, max_depth, max_items)
    reader = XmlReader(max_depth, max_items)
    reader.feed(data)
    return reader.close()


def _xml_text(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


def _escape(text: str) -> str:
    """Character data as ``ElementTree`` escapes it."""
    if "&" in text:
        text = text.replace("&", "&amp;")
    if "<" in text:
        text = text.replace("<", "&lt;")
    if ">" in text:
        text = text.replace(">", "&gt;")
    return text


def _element(out: list[str], tag: str, children: list[str]) -> None:
    if children:
        out.append(f"<{tag}>")
        out.extend(children)
        out.append(f"</{tag}>")
    else:
        out.append(f"<{tag} />")


def _to_xml(out: list[str], tag: str, value: Any) -> None:
    """Append ``value`` as element(s) named ``tag``: byte for byte what ``ElementTree``
    writes for the same tree, built as strings (several times faster, and every MNS
    response goes through here)."""
    if value is None:
        return
    if isinstance(value, Mapping):
        children: list[str] = []
        for key, child in value.items():
            _to_xml(children, key, child)
        _element(out, tag, children)
    elif isinstance(value, list | tuple):
        item = ITEM_TAGS.get(tag)
        if item is None:  # a repeated element: <Queue>..</Queue><Queue>..</Queue>
            for entry in value:
                _to_xml(out, tag, entry)
        else:
            items: list[str] = []
            for entry in value:
                _to_xml(items, item, entry)
            _element(out, tag, items)
    else:
        text = _xml_text(value)
        out.append(f"<{tag}>{_escape(text)}</{tag}>" if text else f"<{tag} />")


_DECLARATION = "<?xml version='1.0' encoding='utf-8'?>\n"


def encode(root: str, value: Mapping[str, Any] | Sequence[Any], *, as_json: bool) -> bytes:
    """Render a response document. A mapping becomes the root's children; a sequence
    the root's items (``encode("Messages", [...])``). In JSON the root element is
    dropped for a mapping, and names the list for a sequence (``{"Messages": [...]}``)
    or for a mapping's repeated items (``{"Queues": [...], "NextMarker": ...}``);
    ``None`` fields are left out in both."""
    if as_json:
        if not isinstance(value, Mapping):
            return json.dumps({root: list(value)}).encode()
        fields = {k: v for k, v in value.items() if v is not None}
        item = ITEM_TAGS.get(root)
        if item is not None and isinstance(fields.get(item), list | tuple):
            # <Queues><Queue/>...<NextMarker/></Queues> reads {"Queues": [...], "NextMarker"}
            fields = {root: fields.pop(item), **fields}
        return json.dumps(fields).encode()
    children: list[str] = []
    if isinstance(value, Mapping):
        for key, child in value.items():
            _to_xml(children, key, child)
    else:
        item = ITEM_TAGS[root]
        for entry in value:
            _to_xml(children, item, entry)
    head = f'{_DECLARATION}<{root} xmlns="{XMLNS}"'
    text = f"{head}>{''.join(children)}</{root}>" if children else f"{head} />"
    return text.encode("utf-8", "xmlcharrefreplace")
