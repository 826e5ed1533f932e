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
from xml.etree import ElementTree

__all__ = [
    "ITEM_TAGS",
    "XMLNS",
    "MalformedDocument",
    "Value",
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


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _from_element(element: ElementTree.Element) -> Any:
    children = list(element)
    name = _local(element.tag)
    if name in ITEM_TAGS:
        item = ITEM_TAGS[name]
        if any(_local(child.tag) != item for child in children):
            raise MalformedDocument(f"<{name}> may only hold <{item}> elements")
        return [_from_element(child) for child in children]
    if not children:
        return (element.text or "").strip() if name != "MessageBody" else (element.text or "")
    fields: dict[str, Any] = {}
    for child in children:
        key = _local(child.tag)
        if key in fields:
            raise MalformedDocument(f"<{key}> appears twice in <{name}>")
        fields[key] = _from_element(child)
    return fields


def decode(data: bytes, *, json_body: bool) -> tuple[str | None, Any]:
    """The root element's name (``None`` for JSON) and the document's value.

    An empty body decodes to ``(None, {})``: several MNS calls take no body."""
    if not data.strip():
        return None, {}
    if json_body:
        try:
            return None, json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MalformedDocument(f"the body is not valid JSON: {e}") from e
    # Entities are the billion-laughs door; MNS documents never need a DTD.
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise MalformedDocument("document type declarations are not accepted")
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as e:
        raise MalformedDocument(f"the body is not well-formed XML: {e}") from e
    value = _from_element(root)
    # An empty root (``<Queue/>``: create with defaults) is a document with no fields.
    return _local(root.tag), {} if value == "" else value


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
