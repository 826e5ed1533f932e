"""The storage RPC's wire format: every model type survives a round trip exactly (type,
equality, hashability), and bytes that are not frames fail with ``CodecError`` only."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import types
import typing
from enum import StrEnum
from typing import Any, get_args, get_origin, get_type_hints

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nameserver import model as ns
from storage import model as m
from storage.rpc import codec

# Every dataclass of both models: a new one that is not registered fails here.
MODEL_TYPES: tuple[type, ...] = tuple(
    cls
    for module in (m, ns)
    for cls in (getattr(module, name) for name in module.__all__)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
)

INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a model field's type, ints kept to msgpack's 64 bits."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is int:
        return INTS
    if hint is str:
        return st.text(max_size=12)
    if hint is bytes:
        return st.binary(max_size=24)
    if hint is bool:
        return st.booleans()
    if hint is float:
        return st.floats(allow_nan=False)
    if hint is type(None):
        return st.none()
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return st.sampled_from(list(hint))
    if dataclasses.is_dataclass(hint):
        return instances(hint)  # type: ignore[arg-type]
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*(strategy_for(arg) for arg in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(arg) for arg in args))
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=3)
    raise AssertionError(f"no strategy for {hint!r}")


def instances(cls: type) -> st.SearchStrategy[Any]:
    hints = get_type_hints(cls, vars(m) | vars(ns))
    fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


def assert_same(a: Any, b: Any) -> None:
    """Equal, and of the same types all the way down (a tuple is not a list)."""
    assert type(a) is type(b), (a, b)
    if dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


@pytest.mark.parametrize("cls", MODEL_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_model_types_round_trip(cls: type, data: st.DataObject) -> None:
    value = data.draw(instances(cls))
    assert_same(codec.decode(codec.encode(value)), value)


@given(st.lists(instances(m.StoredMessage), max_size=4), st.frozensets(st.text(max_size=5)))
@settings(max_examples=30, deadline=None)
def test_containers_keep_their_types(messages: list[m.StoredMessage], tags: frozenset[str]) -> None:
    value = {"list": messages, "tuple": tuple(messages), "tags": tags, "none": None}
    assert_same(codec.decode(codec.encode(value)), value)


def test_dataclass_and_tuple_keys_stay_hashable_keys() -> None:
    offsets = {m.QueueRef("ns", "t", 2): m.CommittedOffset(offset=7, metadata="x")}
    routes = ns.RouteTable(version=3, topics={("ns", "t"): "node-a"}, homes={"ns": "node-b"})
    assert_same(codec.decode(codec.encode(offsets)), offsets)
    assert_same(codec.decode(codec.encode(routes)), routes)


def test_message_type_comes_back_as_the_enum() -> None:
    decoded = codec.decode(codec.encode(m.TopicConfig(message_type=m.MessageType.FIFO)))
    assert decoded.message_type is m.MessageType.FIFO


@given(
    st.recursive(
        st.none() | st.booleans() | INTS | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=12,
    )
)
@settings(max_examples=60, deadline=None)
def test_json_values_round_trip(value: Any) -> None:
    """Metadata values (``meta_put``) are JSON: lists stay lists, dicts stay dicts."""
    assert_same(codec.decode(codec.encode(value)), value)


def test_unregistered_types_are_refused_when_encoding() -> None:
    with pytest.raises(TypeError):
        codec.encode(object())
    with pytest.raises(TypeError):
        codec.encode({1, 2})  # a set: only frozensets travel


def test_register_checks_codes_and_kinds() -> None:
    @dataclasses.dataclass(frozen=True)
    class Extra:
        n: int

    with pytest.raises(ValueError, match="taken"):
        codec.register(Extra, 16)
    with pytest.raises(ValueError):
        codec.register(Extra, 3)
    with pytest.raises(TypeError):
        codec.register(int, 120)
    codec.register(Extra, 127)
    try:
        assert codec.decode(codec.encode([Extra(5)])) == [Extra(5)]
    finally:  # leave the registry as other tests expect it
        del codec._BY_CLASS[Extra], codec._BY_CODE[127]


# -- frames ----------------------------------------------------------------------------


def test_frames_round_trip_through_the_decoder_in_any_split() -> None:
    stream = b"".join(
        (
            codec.encode_request(1, "read", [m.QueueRef("a", "b")], {"wait_ms": 5}),
            codec.encode_result(1, m.QueueOffsets(0, 9)),
            codec.encode_error(2, "offset_out_of_range", "below", {"earliest": 3}),
            codec.encode_cancel(3),
        )
    )
    expected = [
        codec.Request(1, "read", [m.QueueRef("a", "b")], {"wait_ms": 5}),
        codec.Result(1, m.QueueOffsets(0, 9)),
        codec.Error(2, "offset_out_of_range", "below", {"earliest": 3}),
        codec.Cancel(3),
    ]
    for step in (1, 3, 7, len(stream)):
        decoder = codec.FrameDecoder()
        frames = []
        for start in range(0, len(stream), step):
            frames += decoder.feed(stream[start : start + step])
        assert frames == expected
        assert decoder.buffered == 0


def frame_of(value: Any) -> bytes:
    payload: bytes = msgpack.packb(value)
    return struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(
    "data",
    [
        frame_of([9, 1]),  # unknown kind
        frame_of({"a": 1}),  # not an array
        frame_of([]),
        frame_of([0, "id", "m", [], {}]),  # id not an integer
        frame_of([0, 1, "m", [], {1: 2}]),  # keyword names not strings
        frame_of([0, 1, 5, [], {}]),  # method not a string
        frame_of([1, 1]),  # result without a value
        frame_of([0, 1, "m", [msgpack.ExtType(99, b"")], {}]),  # unknown extension
        frame_of([0, 1, "m", [msgpack.ExtType(1, b"x")], {}]),  # extension with a payload
        frame_of([0, 1, "m", [[msgpack.ExtType(17, b""), "only-one-field"]], {}]),
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        struct.pack(">I", 2) + msgpack.packb(1) * 2,  # extra bytes after the value
        struct.pack(">I", 2**31),  # larger than allowed
    ],
)
def test_malformed_frames_raise_codec_error(data: bytes) -> None:
    with pytest.raises(codec.CodecError):
        codec.FrameDecoder(max_frame_bytes=1 << 20).feed(data)


@given(st.binary(max_size=64))
@settings(max_examples=200, deadline=None)
def test_random_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    with contextlib.suppress(codec.CodecError):
        codec.FrameDecoder(max_frame_bytes=1 << 16).feed(struct.pack(">I", len(data)) + data)
