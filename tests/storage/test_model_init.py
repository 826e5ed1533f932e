"""The model's frozen dataclasses built with ``_quick_init`` (storage/model.py) keep
what the generated ``__init__`` gave: the same parameters (names, order, keyword-only,
defaults), every field stored, immutability, equality and hashing."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from polymq.storage import model

QUICK = [
    model.QueueRef,
    model.QueueOffsets,
    model.Message,
    model.BatchEntry,
    model.AppendRequest,
    model.Placement,
    model.AppendResult,
    model.StoredMessage,
    model.StoredBatch,
    model.ReadResult,
]


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_the_signature_is_the_dataclass_one(cls: type[Any]) -> None:
    names = cls.__init__.__code__.co_names
    assert any(n.startswith("_set_") for n in names)  # the quick one is in place
    fields = dataclasses.fields(cls)
    expected = [f for f in fields if not f.kw_only] + [f for f in fields if f.kw_only]
    parameters = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in parameters] == [f.name for f in expected]
    for parameter, f in zip(parameters, expected, strict=True):
        kind = (
            inspect.Parameter.KEYWORD_ONLY if f.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        assert parameter.kind == kind
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert parameter.default == default


def test_fields_are_stored_frozen_and_compared() -> None:
    ref = model.QueueRef("ns", "t", 3)
    assert (ref.namespace, ref.topic, ref.queue_id) == ("ns", "t", 3)
    assert ref == model.QueueRef(namespace="ns", topic="t", queue_id=3)
    assert hash(ref) == hash(model.QueueRef("ns", "t", 3))
    message = model.Message(body=b"b", key=b"k", properties=(("p", b"v"),))
    assert dataclasses.asdict(message) == {
        **{f.name: f.default for f in dataclasses.fields(model.Message)},
        "body": b"b",
        "key": b"k",
        "properties": (("p", b"v"),),
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.body = b"other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        model.Message(b"positional")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        model.Placement(ref)  # type: ignore[call-arg]
    assert dataclasses.replace(message, body=b"c") == model.Message(
        body=b"c", key=b"k", properties=(("p", b"v"),)
    )
