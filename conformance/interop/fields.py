"""The message every cell sends, and what a consumer saw, in one normalized shape.

Each protocol carries the model's fields in its own constructs (a Kafka record key, an
AMQP routing key, an MQTT user property named ``polymq.key``...). A driver translates
both ways, so the matrix compares like with like: ``Arrived`` holds what the consumer's
client showed, already read back through that protocol's documented names.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Arrived", "Sent", "standard_message"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Sent:
    """What a producer driver sends: the fields issue 9 names (body, key, tag, user
    properties, content type) and the two request/reply fields every protocol carries."""

    body: bytes
    key: str
    tag: str
    properties: tuple[tuple[str, str], ...]
    content_type: str
    correlation_id: str
    reply_to: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Arrived:
    """What a consumer's client showed. ``properties`` are the user properties /
    headers left after the driver took out the names that carry model fields
    (``polymq.key``, ``polymq.tag``, ``content-type``...)."""

    body: bytes
    key: str | None
    tag: str | None
    properties: dict[str, str]
    content_type: str | None
    correlation_id: str | None
    reply_to: str | None

    def field(self, name: str) -> object:
        value: object = getattr(self, name)
        return value


def standard_message(cell: str) -> Sent:
    """The message of one cell: UTF-8 text (MNS bodies are text), a key and a tag every
    protocol accepts (RocketMQ keys split on spaces, tags may not hold ``|``), two user
    properties, one of them naming the cell so a stray message cannot pass; the
    reply-to is a valid MQTT topic name (MQTT's response topic)."""
    return Sent(
        body=f'{{"cell": "{cell}", "text": "h\u00e9llo \u2713"}}'.encode(),
        key=f"key-{cell}",
        tag="tag-a",
        properties=(("color", "blue"), ("cell", cell)),
        content_type="application/json",
        correlation_id=f"corr-{cell}",
        reply_to=f"replies/{cell}",
    )
