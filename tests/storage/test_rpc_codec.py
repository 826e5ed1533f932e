"""The storage RPC's wire format: every model type survives a round trip exactly (type,
equality, hashability), and bytes that are not frames fail with ``CodecError`` only."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import struct
import tracemalloc
import types
import typing
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polymq.storage import errors
from polymq.storage import model as m
from polymq.storage import routes as ns
from polymq.storage.rpc import RpcClient, RpcServer, codec

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


# -- hostile input (issue 14): bounded before anything is allocated --------------------


def test_an_oversized_frame_is_refused_from_its_prefix_alone() -> None:
    """The 4-byte prefix is enough: the decoder does not wait for (nor buffer) a body
    it would refuse."""
    decoder = codec.FrameDecoder(max_frame_bytes=1 << 20)
    with pytest.raises(codec.CodecError, match="exceeds"):
        decoder.feed(struct.pack(">I", (1 << 20) + 1))
    assert decoder.buffered == 4


@pytest.mark.parametrize(
    "head",
    [
        b"\xdd\xff\xff\xff\xff",  # array of 2^32-1 items
        b"\xdf\xff\xff\xff\xff",  # map of 2^32-1 pairs
        b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
        b"\xc9\x7f\xff\xff\xff\x10",  # ext of 2 GiB
    ],
    ids=["array", "map", "str", "bin", "ext"],
)
def test_declared_sizes_beyond_the_frame_are_refused_not_allocated(head: bytes) -> None:
    # A request whose only argument claims more than the frame holds.
    payload = b"\x95\x00\x01\xa1m\x91" + head + b"\x00" * 16 + b"\x80"
    tracemalloc.start()
    try:
        with pytest.raises(codec.CodecError):
            codec.FrameDecoder(max_frame_bytes=1 << 20).feed(
                struct.pack(">I", len(payload)) + payload
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_nesting_is_bounded_without_python_recursion() -> None:
    deepest = b"\x91" * codec.MAX_NESTING + b"\x00"
    value = codec.decode(deepest)
    for _ in range(codec.MAX_NESTING):
        value = value[0]
    assert value == 0
    # 100,000 levels in 100 KB: refused by msgpack's own stack, not a RecursionError
    with pytest.raises(codec.CodecError):
        codec.decode(b"\x91" * 100_000 + b"\x00")
    payload = b"\x93\x01\x01" + b"\x91" * 100_000 + b"\x00"
    with pytest.raises(codec.CodecError):
        codec.FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)


def test_regression_inputs_of_the_fuzz_target_fail_cleanly() -> None:
    """Every input the storage_rpc fuzz target was ever seeded or crashed with."""
    root = Path(__file__).resolve().parents[1] / "fuzz"
    files = [
        path
        for folder in (root / "corpus" / "storage_rpc", root / "regressions" / "storage_rpc")
        if folder.is_dir()
        for path in sorted(folder.iterdir())
    ]
    assert files
    for path in files:
        data = path.read_bytes()[1:]  # the target's first byte says where it splits
        with contextlib.suppress(codec.CodecError):
            codec.FrameDecoder(max_frame_bytes=1 << 20).feed(data)


async def test_arguments_a_method_does_not_take_are_invalid_argument_in_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer's wrong arguments are its mistake: InvalidArgument, a one-line warning,
    no traceback (a TypeError inside the handler stays a logged bug)."""

    async def one(x: int) -> int:
        return x

    async def buggy(x: int) -> int:
        raise TypeError("our own bug")

    server = RpcServer({"one": one, "buggy": buggy})
    await server.start()
    client = RpcClient(*server.address)
    try:
        with caplog.at_level(logging.INFO, logger="polymq.storage.rpc.peer"):
            with pytest.raises(errors.InvalidArgument, match="bad arguments for one"):
                await client.call("one", 1, 2)
            with pytest.raises(errors.InvalidArgument, match="bad arguments for one"):
                await client.call("one", y=3)
        records = [r for r in caplog.records if r.name == "polymq.storage.rpc.peer"]
        assert len(records) == 2
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
        caplog.clear()
        with (
            caplog.at_level(logging.INFO, logger="polymq.storage.rpc.peer"),
            pytest.raises(errors.StorageError, match="our own bug") as raised,
        ):
            await client.call("buggy", 1)
        assert not isinstance(raised.value, errors.InvalidArgument)
        assert any(r.exc_info for r in caplog.records if r.name == "polymq.storage.rpc.peer")
        assert await client.call("one", 5) == 5  # the connection stays
    finally:
        await client.close()
        await server.close()
