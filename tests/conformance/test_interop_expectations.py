"""The expectations table is the one source of truth: docs/interop.md shows it as it
is, and the checks it drives notice a field that went wrong."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from polymq.conformance.interop import expectations
from polymq.conformance.interop.fields import Arrived, Sent, standard_message

DOCS = Path(__file__).resolve().parents[2] / "docs" / "interop.md"


def test_docs_show_the_expectations_table_verbatim() -> None:
    assert expectations.render_markdown() in DOCS.read_text(), (
        "docs/interop.md is out of date: put conformance.interop.expectations."
        "render_markdown() between its 'generated' markers"
    )


def test_every_protocol_says_how_it_carries_every_field() -> None:
    for field, carriers in expectations.CARRIERS.items():
        assert set(carriers) == set(expectations.PROTOCOLS), field
    assert set(expectations.CHECKED_FIELDS) <= set(expectations.CARRIERS)


def _arrived_as_sent() -> tuple[Arrived, Sent]:
    sent = standard_message("kafka-amqp")
    arrived = Arrived(
        body=sent.body,
        key=sent.key,
        tag=sent.tag,
        properties=dict(sent.properties),
        content_type=sent.content_type,
        correlation_id=sent.correlation_id,
        reply_to=sent.reply_to,
    )
    return arrived, sent


def test_a_message_arriving_as_sent_passes() -> None:
    arrived, sent = _arrived_as_sent()
    assert expectations.check(arrived, sent, "kafka", "amqp") == []


def test_each_field_that_differs_is_reported() -> None:
    arrived, sent = _arrived_as_sent()
    changes: dict[str, Any] = {
        "body": b"other",
        "key": None,
        "tag": "tag-b",
        "properties": {**dict(sent.properties), "amqp.exchange": "x"},
        "content_type": "text/plain",
        "correlation_id": None,
        "reply_to": "elsewhere",
    }
    for field, value in changes.items():
        wrong = dataclasses.replace(arrived, **{field: value})
        [problem] = expectations.check(wrong, sent, "kafka", "amqp")
        assert problem.startswith(f"{field}:")
