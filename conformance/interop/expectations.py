"""What each cell of the 5 x 5 matrix must deliver: the one source of truth.

``docs/interop.md`` embeds :func:`render_markdown`'s tables verbatim (a test checks it
does), so the written mapping and the checks cannot drift apart. A cell expects every
field it sends to arrive unchanged unless :data:`DEVIATIONS` names the field for that
pair, with what arrives instead and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from polymq.conformance.interop.fields import Arrived, Sent

__all__ = [
    "CARRIERS",
    "CHECKED_FIELDS",
    "DEVIATIONS",
    "PROTOCOLS",
    "Deviation",
    "check",
    "expected",
    "render_markdown",
]

PROTOCOLS = ("kafka", "amqp", "mqtt", "rocketmq", "mns")
CHECKED_FIELDS = (
    "body",
    "key",
    "tag",
    "properties",
    "content_type",
    "correlation_id",
    "reply_to",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Deviation:
    """A field that cannot arrive unchanged for one pair: ``arrives`` computes what
    does from what was sent, ``why`` says why (it is printed in docs/interop.md)."""

    arrives: Callable[[Sent], object]
    why: str


# How each protocol carries each model field, for producers and consumers alike. The
# first seven rows are checked by every cell; the rest are the written mapping.
CARRIERS: dict[str, dict[str, str]] = {
    "body": {
        "kafka": "record value",
        "amqp": "message body",
        "mqtt": "payload",
        "rocketmq": "body",
        "mns": "MessageBody (text; non-UTF-8 bytes arrive as U+FFFD)",
    },
    "key": {
        "kafka": "record key",
        "amqp": "routing key (another protocol's message: header `polymq.key`; "
        "its routing key is then the topic's name)",
        "mqtt": "user property `polymq.key` (default: the topic name)",
        "rocketmq": "keys (several joined by spaces)",
        "mns": "user property `polymq.key`",
    },
    "tag": {
        "kafka": "header `polymq.tag`",
        "amqp": "header `polymq.tag`",
        "mqtt": "user property `polymq.tag`",
        "rocketmq": "tag",
        "mns": "MessageTag",
    },
    "properties": {
        "kafka": "headers",
        "amqp": "headers (text, bytes, a number's decimal text, True/False)",
        "mqtt": "v5 user properties (order and repeats kept)",
        "rocketmq": "user properties (a map: order and repeats not kept)",
        "mns": "UserProperties",
    },
    "content_type": {
        "kafka": "header `content-type`",
        "amqp": "`content_type` property",
        "mqtt": "v5 content type",
        "rocketmq": "user property `content-type`",
        "mns": "user property `content-type`",
    },
    "correlation_id": {
        "kafka": "header `correlation-id`",
        "amqp": "`correlation_id` property (text)",
        "mqtt": "v5 correlation data",
        "rocketmq": "user property `correlation-id`",
        "mns": "user property `correlation-id`",
    },
    "reply_to": {
        "kafka": "header `reply-to`",
        "amqp": "`reply_to` property",
        "mqtt": "v5 response topic",
        "rocketmq": "user property `reply-to`",
        "mns": "user property `reply-to`",
    },
    "message_group": {
        "kafka": "header `polymq.message-group`",
        "amqp": "header `polymq.message-group`",
        "mqtt": "user property `polymq.message-group`",
        "rocketmq": "message group (FIFO)",
        "mns": "MessageGroupId",
    },
    "delay": {
        "kafka": "none",
        "amqp": "none",
        "mqtt": "none",
        "rocketmq": "delivery timestamp",
        "mns": "DelaySeconds",
    },
    "expiry": {
        "kafka": "none (served until retention removes it)",
        "amqp": "`expiration`, for AMQP consumers only (not the model's expiry)",
        "mqtt": "v5 message expiry interval (the remaining time when served)",
        "rocketmq": "none (not handed out once expired)",
        "mns": "the queue's MessageRetentionPeriod (not handed out once expired)",
    },
    "born timestamp": {
        "kafka": "record timestamp",
        "amqp": "`timestamp` property (whole seconds)",
        "mqtt": "none (the publish time is kept, not shown)",
        "rocketmq": "born timestamp",
        "mns": "none (the send time is kept; EnqueueTime is the store time)",
    },
    "message id": {
        "kafka": "none (the offset identifies a record)",
        "amqp": "`message_id` property, for AMQP consumers only",
        "mqtt": "none (packet ids are per session)",
        "rocketmq": "message id (the store's)",
        "mns": "MessageId (the store's)",
    },
}

# (producer, consumer, field) -> what arrives instead. Empty: every checked field of
# every pair arrives as sent.
DEVIATIONS: dict[tuple[str, str, str], Deviation] = {}


def expected(sent: Sent, producer: str, consumer: str) -> dict[str, object]:
    """Each checked field as the consumer's driver must report it."""
    values: dict[str, object] = {
        "body": sent.body,
        "key": sent.key,
        "tag": sent.tag,
        "properties": dict(sent.properties),
        "content_type": sent.content_type,
        "correlation_id": sent.correlation_id,
        "reply_to": sent.reply_to,
    }
    for field in CHECKED_FIELDS:
        deviation = DEVIATIONS.get((producer, consumer, field))
        if deviation is not None:
            values[field] = deviation.arrives(sent)
    return values


def check(arrived: Arrived, sent: Sent, producer: str, consumer: str) -> list[str]:
    """The fields that did not arrive as expected, each as a short description."""
    problems = []
    for field, want in expected(sent, producer, consumer).items():
        got = arrived.field(field)
        if got != want:
            problems.append(f"{field}: expected {want!r}, got {got!r}")
    return problems


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown() -> str:
    """The field-carrier table and the expected matrix, as docs/interop.md shows them."""
    lines = [_row(["field", *PROTOCOLS]), _row(["---"] * (len(PROTOCOLS) + 1))]
    for field, carriers in CARRIERS.items():
        lines.append(_row([field.replace("_", " "), *(carriers[p] for p in PROTOCOLS)]))
    lines += ["", _row(["producer \\ consumer", *PROTOCOLS])]
    lines.append(_row(["---"] * (len(PROTOCOLS) + 1)))
    for producer in PROTOCOLS:
        cells = []
        for consumer in PROTOCOLS:
            lost = [f for f in CHECKED_FIELDS if (producer, consumer, f) in DEVIATIONS]
            cells.append("lossless" if not lost else "differs: " + ", ".join(lost))
        lines.append(_row([producer, *cells]))
    if DEVIATIONS:
        lines.append("")
        for (producer, consumer, field), deviation in sorted(DEVIATIONS.items()):
            lines.append(f"- {producer} -> {consumer}, {field}: {deviation.why}")
    return "\n".join(lines) + "\n"
