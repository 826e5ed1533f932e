"""The pure codecs under the gRPC server: HTTP/2 frames (``frames``) and gRPC's wire
(``wire``), checked against RFC 9113, RFC 7541 (through the ``hpack`` library's
decoder) and grpc's PROTOCOL-HTTP2.md."""

from __future__ import annotations

import struct
from urllib.parse import unquote_to_bytes

import hpack
import pytest

from polymq.protocols.grpc_server.frames import (
    ErrorCode,
    Flag,
    FrameError,
    FrameType,
    cut_frames,
    data_frames,
    frame,
    goaway,
    headers_block,
    headers_frames,
    strip_padding,
)
from polymq.protocols.grpc_server.wire import (
    RESPONSE_HEADERS,
    MessageTooLarge,
    cut_messages,
    message_bytes,
    metadata,
    parse_timeout,
    status_block,
)

# -- frames ----------------------------------------------------------------------------


def test_cut_frames_waits_for_whole_frames_at_every_split() -> None:
    stream = frame(FrameType.PING, 0, 0, b"12345678") + frame(FrameType.DATA, 1, 3, b"abc")
    whole = [(FrameType.PING, 0, 0, b"12345678"), (FrameType.DATA, 1, 3, b"abc")]
    for split in range(len(stream) + 1):
        cut, used = cut_frames(bytearray(stream[:split]), 16_384)
        expected = whole[: (split >= 17) + (split == len(stream))]
        assert cut == expected, split
        assert used == sum(9 + len(payload) for *_, payload in expected)


def test_cut_frames_ignores_the_reserved_bit_of_the_stream_id() -> None:
    raw = struct.pack(">I", 0)[1:] + bytes((FrameType.HEADERS, 0)) + struct.pack(">I", 0x80000005)
    assert cut_frames(raw, 16_384) == ([(FrameType.HEADERS, 0, 5, b"")], 9)


def test_cut_frames_refuses_an_oversized_frame_from_its_head_alone() -> None:
    head = struct.pack(">I", 16_385)[1:] + bytes((FrameType.DATA, 0)) + struct.pack(">I", 1)
    with pytest.raises(FrameError) as refused:
        cut_frames(head, 16_384)  # no payload yet: refused before it is awaited
    assert refused.value.code == ErrorCode.FRAME_SIZE_ERROR
    exactly = frame(FrameType.DATA, 0, 1, b"x" * 16_384)
    assert cut_frames(exactly, 16_384) == ([(FrameType.DATA, 0, 1, b"x" * 16_384)], 16_393)


def test_strip_padding() -> None:
    padded = bytes((3,)) + b"body" + b"\0\0\0"
    assert strip_padding(Flag.PADDED, padded) == b"body"
    assert strip_padding(0, b"body") == b"body"
    assert strip_padding(Flag.PADDED, bytes((4,)) + b"\0" * 4) == b""
    priority = b"\x80\0\0\x01\x10"
    assert strip_padding(Flag.PRIORITY, priority + b"block", priority=True) == b"block"
    assert strip_padding(Flag.PRIORITY, priority + b"block") == priority + b"block"  # DATA
    both = bytes((2,)) + priority + b"block" + b"\0\0"
    assert strip_padding(Flag.PADDED | Flag.PRIORITY, both, priority=True) == b"block"


@pytest.mark.parametrize(
    ("flags", "payload", "priority"),
    [
        (Flag.PADDED, b"", False),  # no pad length
        (Flag.PADDED, bytes((5,)) + b"abcd", False),  # padding longer than the frame
        (Flag.PADDED, bytes((1,)), False),
        (Flag.PRIORITY, b"\0\0\0", True),  # the priority fields cut short
        (Flag.PADDED | Flag.PRIORITY, bytes((1,)) + b"\0" * 5, True),
    ],
)
def test_strip_padding_refuses(flags: int, payload: bytes, priority: bool) -> None:
    with pytest.raises(FrameError) as refused:
        strip_padding(flags, payload, priority=priority)
    assert refused.value.code == ErrorCode.PROTOCOL_ERROR


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 254, 255, 16_383, 16_384, 100_000])
def test_headers_block_decodes_with_hpack(size: int) -> None:
    """Lengths around the 7-bit prefix (127) and beyond need HPACK's multi-byte
    integers."""
    headers = [
        (b"grpc-status", b"0"),
        (b"x-" + b"n" * size, b"v"),
        (b"x-value", bytes(range(256)) * (size // 256) + b"z" * (size % 256)),
    ]
    decoder = hpack.Decoder(max_header_list_size=1 << 22)
    assert decoder.decode(headers_block(headers), raw=True) == headers
    # literals without indexing: the decoder's table is untouched
    assert decoder.decode(headers_block(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0


@pytest.mark.parametrize(("size", "frames"), [(10, 1), (100, 1), (101, 2), (200, 2), (201, 3)])
@pytest.mark.parametrize("end_stream", [False, True])
def test_headers_frames_split_into_continuation(size: int, frames: int, end_stream: bool) -> None:
    block = bytes(i % 251 for i in range(size))
    out, used = cut_frames(headers_frames(7, block, 100, end_stream=end_stream), 100)
    assert used == len(headers_frames(7, block, 100, end_stream=end_stream))
    assert len(out) == frames
    assert [kind for kind, *_ in out] == [FrameType.HEADERS] + [FrameType.CONTINUATION] * (
        frames - 1
    )
    assert all(stream == 7 for _, _, stream, _ in out)
    assert b"".join(payload for *_, payload in out) == block
    # END_HEADERS on the last frame only; END_STREAM on the HEADERS frame only
    assert [bool(flags & Flag.END_HEADERS) for _, flags, _, _ in out] == [False] * (frames - 1) + [
        True
    ]
    assert bool(out[0][1] & Flag.END_STREAM) == end_stream
    assert not any(flags & Flag.END_STREAM for _, flags, _, _ in out[1:])


def test_data_frames_respect_the_frame_size() -> None:
    data = bytes(range(256)) * 100
    out, _ = cut_frames(data_frames(3, data, 1000), 1000)
    assert [len(p) for *_, p in out] == [1000] * 25 + [600]
    assert b"".join(p for *_, p in out) == data
    assert all(kind == FrameType.DATA and flags == 0 for kind, flags, _, _ in out)
    assert cut_frames(data_frames(3, memoryview(b"ab"), 1000), 1000)[0] == [(0, 0, 3, b"ab")]


def test_goaway_carries_the_last_stream_and_code() -> None:
    (out,), _ = cut_frames(goaway(9, ErrorCode.PROTOCOL_ERROR, "x" * 1000), 16_384)
    assert out[:3] == (FrameType.GOAWAY, 0, 0)
    assert struct.unpack_from(">II", out[3]) == (9, ErrorCode.PROTOCOL_ERROR)
    assert len(out[3]) == 8 + 256  # the debug text is cut


# -- wire ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"1H", 3600.0),
        (b"2M", 120.0),
        (b"30S", 30.0),
        (b"1500m", 1.5),
        (b"250000u", 0.25),
        (b"5000000n", 0.005),
        (b"0S", 0.0),
        (b"99999999S", 99_999_999.0),  # 8 digits: the most grpc allows
        (b"00000001m", 0.001),
    ],
)
def test_parse_timeout(value: bytes, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [b"", b"S", b"1", b"1x", b"1s", b"-1S", b"1.5S", b" 1S", b"1S ", b"123456789S", b"\xb2S"],
)
def test_parse_timeout_refuses(value: bytes) -> None:
    assert parse_timeout(value) is None


def test_cut_messages_keeps_what_is_not_whole() -> None:
    stream = message_bytes(b"one") + message_bytes(b"") + message_bytes(b"three")
    for split in range(len(stream) + 1):
        buffer = bytearray(stream[:split])
        messages, compressed = cut_messages(buffer, 100)
        assert not compressed
        taken = b"".join(message_bytes(m) for m in messages)
        assert messages == [b"one", b"", b"three"][: len(messages)]
        assert bytes(buffer) == stream[len(taken) : split]  # the rest stays for later
        buffer += stream[split:]
        rest, _ = cut_messages(buffer, 100)
        assert messages + rest == [b"one", b"", b"three"]
        assert not buffer


def test_cut_messages_reports_compression() -> None:
    buffer = bytearray(message_bytes(b"plain") + b"\x01" + struct.pack(">I", 2) + b"zz")
    assert cut_messages(buffer, 100) == ([b"plain", b"zz"], True)


def test_cut_messages_refuses_an_oversized_prefix_before_its_bytes() -> None:
    with pytest.raises(MessageTooLarge):
        cut_messages(bytearray(b"\0" + struct.pack(">I", 101)), 100)
    assert cut_messages(bytearray(message_bytes(b"x" * 100)), 100)[0] == [b"x" * 100]
    with pytest.raises(MessageTooLarge):  # after a whole one
        cut_messages(bytearray(message_bytes(b"ok") + b"\0" + struct.pack(">I", 1 << 31)), 100)


def _decoded(block: bytes) -> dict[bytes, bytes]:
    return dict(hpack.Decoder().decode(block, raw=True))


def test_status_block_percent_encodes_its_message() -> None:
    fields = _decoded(status_block(13, 'café: 100% "done"\n'))
    assert fields[b"grpc-status"] == b"13"
    message = fields[b"grpc-message"]
    assert message == b'caf%C3%A9: 100%25 "done"%0A'
    assert all(0x20 <= b <= 0x7E for b in message)
    assert unquote_to_bytes(message).decode() == 'café: 100% "done"\n'
    assert _decoded(status_block(2, "100%41"))[b"grpc-message"] == b"100%2541"  # all ASCII
    assert _decoded(status_block(0)) == {b"grpc-status": b"0"}
    assert _decoded(status_block(5, "plain text")) == {
        b"grpc-status": b"5",
        b"grpc-message": b"plain text",
    }


def test_status_block_trailers_only_carries_the_response_headers() -> None:
    fields = hpack.Decoder().decode(status_block(12, "no", trailers_only=True), raw=True)
    assert fields == [
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
        (b"grpc-status", b"12"),
        (b"grpc-message", b"no"),
    ]
    assert hpack.Decoder().decode(RESPONSE_HEADERS, raw=True) == fields[:2]


def test_metadata_leaves_out_the_transport_and_decodes_bin_values() -> None:
    headers = [
        (b":path", b"/a/b"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"grpc-timeout", b"1S"),
        (b"grpc-encoding", b"identity"),
        (b"grpc-accept-encoding", b"gzip"),
        (b"user-agent", b"grpc-python"),
        (b"x-text", b"caf\xc3\xa9"),
        (b"x-latin", b"caf\xe9"),
        (b"x-data-bin", b"AP8"),  # unpadded base64, as grpc sends it
        (b"x-padded-bin", b"AP8="),
        (b"x-broken-bin", b"A"),  # no base64 length: left out
        (b"x-garbage-bin", b"!!!!"),  # not base64 at all: left out, not read as b""
        (b"x-text", b"again"),
    ]
    assert metadata(headers) == (
        ("x-text", "café"),
        ("x-latin", "café"),
        ("x-data-bin", b"\x00\xff"),
        ("x-padded-bin", b"\x00\xff"),
        ("x-text", "again"),
    )
