"""Hostile or broken HTTP/2 peers on raw sockets (:mod:`tests.grpc_server.raw`): each
gets the connection error RFC 9113 names (a GOAWAY with its code, or the connection
closed), a refused stream or flow control's back-pressure; none logs a traceback, and
grpcio's client is served normally afterwards."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from polymq.protocols.grpc_server.connection import Limits
from polymq.protocols.grpc_server.frames import (
    CONNECTION_PREFACE,
    ErrorCode,
    Flag,
    FrameType,
    frame,
    settings,
    window_update,
)
from tests.grpc_server.harness import COUNT, ECHO, HOLD, SINK, WAIT_S, Served, serving, wait_until
from tests.grpc_server.raw import RawH2, grpc_message

MAX_MESSAGE = 64 << 10
CHUNK = 16_384 - 5  # a message's payload filling one DATA frame of the default size


def _limits(**overrides: Any) -> Limits:
    values: dict[str, Any] = {"max_message_bytes": MAX_MESSAGE, "handshake_timeout_s": WAIT_S}
    return Limits(**(values | overrides))


@pytest.fixture(autouse=True)
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO)
    yield
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.fixture
def served() -> Iterator[Served]:
    with serving(_limits()) as server:
        yield server
        server.assert_serving()


def _goaway_after(served: Served, *frames: bytes) -> tuple[int, int]:
    with RawH2(served.port) as raw:
        raw.handshake()
        raw.send(*frames)
        return raw.read_goaway()


# -- the handshake ---------------------------------------------------------------------


def test_not_a_preface_is_closed(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        raw.read_to_close()
        assert raw.goaway is None or raw.goaway[1] == ErrorCode.PROTOCOL_ERROR


def test_a_first_frame_that_is_not_settings_is_a_protocol_error(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.send(CONNECTION_PREFACE, frame(FrameType.PING, 0, 0, b"12345678"))
        assert raw.read_goaway() == (0, ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize("sent", [b"", CONNECTION_PREFACE, CONNECTION_PREFACE[:10]])
def test_no_settings_in_time_is_closed(sent: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with serving(_limits(handshake_timeout_s=0.3)) as served:
        with RawH2(served.port) as raw:
            raw.send(sent)
            said = raw.read_to_close()  # (cut: no GOAWAY)
            assert [kind for kind, *_ in said] == [FrameType.SETTINGS, FrameType.WINDOW_UPDATE]
        wait_until(lambda: served.server.connections == 0, "the connection to be forgotten")
        assert "no HTTP/2 preface in time" in caplog.text
        served.assert_serving()


# -- malformed frames ------------------------------------------------------------------


def test_a_frame_longer_than_our_frame_size_is_a_frame_size_error(served: Served) -> None:
    head = struct.pack(">I", 16_385)[1:] + bytes((FrameType.DATA, 0)) + struct.pack(">I", 1)
    assert _goaway_after(served, head) == (0, ErrorCode.FRAME_SIZE_ERROR)


def test_a_frame_of_exactly_our_frame_size_is_taken(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        raw.open(1, ECHO)
        raw.send_data(1, grpc_message(b"x" * CHUNK), end_stream=True)
        raw.finish(1)
        assert raw.status(1) == 0
        assert bytes(raw.data[1]) == grpc_message(b"x" * CHUNK)


def test_a_header_block_hpack_cannot_decode_is_a_compression_error(served: Served) -> None:
    # an indexed field naming entry 63: past the static table, and the dynamic one is empty
    block = b"\xbf"
    headers = frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, 1, block)
    assert _goaway_after(served, headers) == (0, ErrorCode.COMPRESSION_ERROR)


def test_data_beyond_the_windows_is_a_flow_control_error(served: Served) -> None:
    """A handler that reads nothing: its client, keeping to the windows, uses every
    byte they grant (an error there would be an off-by-one) until they shut; one
    byte more is refused (the stream reset, or the connection ended, with
    FLOW_CONTROL_ERROR)."""
    with RawH2(served.port) as raw:
        raw.handshake()
        advertised = raw.send_window  # the connection window the server opened
        raw.open(1, SINK)
        sent = raw.fill(1, grpc_message(b"s" * CHUNK), cap=4 * advertised)
        assert not raw.resets and raw.goaway is None
        assert sent < 4 * advertised, "the windows never shut"
        raw.send_data(1, b"\0")
        raw.wait(lambda: bool(raw.resets) or raw.goaway is not None)
        if raw.goaway is not None:
            assert raw.goaway == (1, ErrorCode.FLOW_CONTROL_ERROR)
        else:
            assert raw.resets == {1: ErrorCode.FLOW_CONTROL_ERROR}


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([(FrameType.CONTINUATION, Flag.END_HEADERS, 1)], id="alone"),
        pytest.param(
            [(FrameType.HEADERS, 0, 1), (FrameType.DATA, 0, 1)], id="data-inside-a-header-block"
        ),
        pytest.param(
            [(FrameType.HEADERS, 0, 1), (FrameType.CONTINUATION, Flag.END_HEADERS, 3)],
            id="on-another-stream",
        ),
        pytest.param(
            [(FrameType.HEADERS, 0, 1), (FrameType.PING, 0, 0)], id="ping-inside-a-header-block"
        ),
    ],
)
def test_a_continuation_out_of_place_is_a_protocol_error(
    served: Served, frames: list[tuple[int, int, int]]
) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        block = raw.header_block(ECHO)
        payloads = {
            FrameType.HEADERS: block[:5],
            FrameType.CONTINUATION: block[5:],
            FrameType.DATA: grpc_message(b"x"),
            FrameType.PING: b"12345678",
        }
        raw.send(*(frame(kind, flags, s, payloads[kind]) for kind, flags, s in frames))
        assert raw.read_goaway()[1] == ErrorCode.PROTOCOL_ERROR


def test_a_header_block_split_into_continuations_is_taken(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        block = raw.header_block(ECHO, [("x-padding", "p" * 300)])
        parts = [block[i : i + 100] for i in range(0, len(block), 100)]
        raw.send(
            frame(FrameType.HEADERS, 0, 1, parts[0]),
            *(frame(FrameType.CONTINUATION, 0, 1, part) for part in parts[1:-1]),
            frame(FrameType.CONTINUATION, Flag.END_HEADERS, 1, parts[-1]),
        )
        raw.send_data(1, grpc_message(b"split"), end_stream=True)
        raw.finish(1)
        assert (raw.status(1), bytes(raw.data[1])) == (0, grpc_message(b"split"))


def test_a_stream_id_going_backwards_is_a_protocol_error(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        assert raw.call(5, ECHO, b"first") == (0, grpc_message(b"first"))
        raw.open(3, ECHO, end_stream=True)
        assert raw.read_goaway() == (5, ErrorCode.PROTOCOL_ERROR)


def test_an_even_stream_id_is_a_protocol_error(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        raw.open(2, ECHO, end_stream=True)
        assert raw.read_goaway() == (0, ErrorCode.PROTOCOL_ERROR)


# -- limits ----------------------------------------------------------------------------


def test_streams_over_the_limit_are_refused() -> None:
    with serving(_limits(max_concurrent_streams=2)) as served, RawH2(served.port) as raw:
        raw.handshake()
        assert raw.server_settings[0x3] == 2  # SETTINGS_MAX_CONCURRENT_STREAMS
        raw.open(1, ECHO)  # open until their requests end
        raw.open(3, HOLD)
        raw.open(5, ECHO)
        raw.wait(lambda: 5 in raw.resets)
        assert raw.resets == {5: ErrorCode.REFUSED_STREAM}
        raw.send_data(1, grpc_message(b"one"), end_stream=True)
        raw.finish(1)
        assert (raw.status(1), bytes(raw.data[1])) == (0, grpc_message(b"one"))
        # stream 1's end leaves room for one more; stream 3 still holds its place
        assert raw.call(7, ECHO, b"seven") == (0, grpc_message(b"seven"))
        raw.open(9, ECHO)
        raw.open(11, ECHO, end_stream=True)
        raw.finish(11)
        assert raw.resets[11] == ErrorCode.REFUSED_STREAM and not raw.over(9)
        served.assert_serving()


def test_a_handler_that_reads_nothing_stops_its_client_by_flow_control() -> None:
    """A bidi handler that reads none of its requests: a client keeping to the windows
    is stopped (a PING answered with no window opening shows the server gives no
    more), so what the server holds is bounded, within the window it advertised.
    Once the handler reads, the windows open again and the call ends normally."""
    message = grpc_message(b"m" * CHUNK)
    with serving(_limits()) as served, RawH2(served.port) as raw:
        raw.handshake()
        advertised = raw.send_window  # the connection window the server opened
        raw.open(1, SINK)
        wait_until(served.probe.entered.is_set, "the handler to start")
        sent = raw.fill(1, message, cap=2 * advertised)
        assert 0xFFFF < sent <= advertised
        served.release()
        rest = -sent % len(message)  # the rest of the last message
        raw.wait(lambda: raw.room(1) >= rest)
        raw.send_data(1, message[len(message) - rest :], end_stream=True)
        raw.finish(1)
        assert raw.status(1) == 0
        assert bytes(raw.data[1]) == grpc_message(b"%d" % ((sent + rest) // len(message)))
        served.assert_serving()


def test_concurrent_large_requests_all_complete() -> None:
    """Three requests of 2 MiB sent side by side, in turns of one frame, as HTTP/2
    clients interleave streams: together more than the connection window (4 MiB),
    each less than the largest message. A client keeping to the windows finishes them
    all. (Once the server gave its window back only when a unary request was whole:
    the partial messages filled it and none completed; grpcio's client hung the same
    way, 4 echoes of 3 MiB on a channel already used stalling until their deadline.)"""
    body = b"b" * ((2 << 20) - 5)
    with serving(_limits(max_message_bytes=2 << 20)) as served, RawH2(served.port) as raw:
        raw.handshake()
        assert raw.send_window < 3 * (2 << 20)  # the connection window the server opened
        streams = {stream: memoryview(grpc_message(body)) for stream in (1, 3, 5)}
        for stream in streams:
            raw.open(stream, ECHO)
        while streams:
            moved = False
            for stream, rest in list(streams.items()):
                size = min(16_384, len(rest), raw.room(stream))
                if size <= 0:
                    continue
                raw.send_data(stream, bytes(rest[:size]), end_stream=size == len(rest))
                streams[stream] = rest[size:]
                if size == len(rest):
                    del streams[stream]
                moved = True
            if not moved:
                raw.sync()
                assert any(raw.room(stream) > 0 for stream in streams), (
                    f"stalled: the windows are shut with {sorted(streams)} unfinished"
                )
        raw.finish(1, 3, 5)
        assert all(raw.status(stream) == 0 for stream in (1, 3, 5))


@pytest.mark.parametrize(
    ("stream_window", "connection_window"),
    [pytest.param(1000, 1 << 20, id="stream-window"), pytest.param(1 << 20, 0xFFFF, id="window")],
)
@pytest.mark.parametrize(
    ("path", "request_", "answer_bytes"),
    [
        pytest.param(ECHO, b"e" * 200_000, 200_005, id="unary"),
        pytest.param(COUNT, b"4:40000", 4 * 40_006, id="streaming"),
    ],
)
def test_answers_wait_for_the_clients_windows(
    stream_window: int,
    connection_window: int,
    path: str,
    request_: bytes,
    answer_bytes: int,
) -> None:
    """The server sends no more of its answers than the client's windows allow (a
    PING shows all it sent), and the rest as the client opens them, in steps."""
    with serving(_limits(max_message_bytes=1 << 20)) as served, RawH2(served.port) as raw:
        raw.handshake(stream_window=stream_window, connection_window=connection_window)
        raw.open(1, path)
        raw.send_data(1, grpc_message(request_), end_stream=True)
        granted = [stream_window, connection_window]
        while True:
            allowed = min(min(granted), answer_bytes)
            raw.received(1, allowed)
            raw.sync()
            assert len(raw.data[1]) == allowed
            if allowed == answer_bytes:
                break
            raw.send(window_update(1, 25_000), window_update(0, 25_000))
            granted = [granted[0] + 25_000, granted[1] + 25_000]
        raw.finish(1)
        assert raw.status(1) == 0 and len(raw.data[1]) == answer_bytes


def test_a_client_that_stops_reading_is_cut_after_the_write_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with serving(_limits(write_timeout_s=0.3)) as served, RawH2(served.port) as raw:
        raw.handshake()
        raw.open(1, COUNT)
        raw.send_data(1, grpc_message(b"256:262144"), end_stream=True)  # 64 MiB of answers
        wait_until(lambda: served.server.connections == 0, "the connection to be cut")
        assert "stopped reading its answers" in caplog.text
        served.assert_serving()


def test_settings_after_the_handshake_are_acknowledged(served: Served) -> None:
    with RawH2(served.port) as raw:
        raw.handshake()
        raw.send(settings(((0x5, 1 << 20),)))  # a larger frame size for the server's answers
        acks = [f for f in raw.sync() if f[0] == FrameType.SETTINGS and f[1] & Flag.ACK]
        assert acks
        assert raw.call(1, ECHO, b"after") == (0, grpc_message(b"after"))


def test_a_peer_that_answers_no_ping_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    """Silent for ``keepalive_s``, it is pinged; the ping unanswered for
    ``ping_timeout_s``, the connection is cut (a peer gone without a word)."""
    with serving(_limits(keepalive_s=0.3, ping_timeout_s=0.3)) as served:
        with RawH2(served.port) as raw:
            raw.handshake()
            frames = raw.read_to_close()  # answering nothing the server sends
            pings = [f for f in frames if f[0] == FrameType.PING and not f[1] & Flag.ACK]
            assert pings, f"closed without a ping: {frames}"
        wait_until(lambda: served.server.connections == 0, "the connection to be cut")
        assert "answers no ping" in caplog.text
        served.assert_serving()


def test_a_peer_that_answers_its_pings_is_kept() -> None:
    limits = _limits(keepalive_s=0.2, ping_timeout_s=0.2)
    with serving(limits) as served, RawH2(served.port) as raw:
        raw.handshake()
        for _ in range(3):  # three pings in turn, each answered
            (ping,) = (
                f
                for f in raw.read_until(
                    lambda kind, flags, *_: kind == FrameType.PING and not flags & Flag.ACK
                )
                if f[0] == FrameType.PING and not f[1] & Flag.ACK
            )
            raw.send(frame(FrameType.PING, Flag.ACK, 0, ping[3]))
        assert raw.call(1, ECHO, b"still here") == (0, grpc_message(b"still here"))
        assert served.server.connections == 1


def test_trailers_crossing_our_reset_are_ignored(served: Served) -> None:
    """A call refused before the client finished it is reset; the client's trailers
    sent before it read the reset are ignored (RFC 9113 §5.1), not a connection error."""
    with RawH2(served.port) as raw:
        raw.handshake()
        raw.open(1, "/test.Grpc/Nothing")  # not ended: the refusal resets it
        raw.finish(1)
        raw.sync()  # (the reset follows the trailers)
        assert raw.status(1) == 12 and raw.resets.get(1) == ErrorCode.NO_ERROR
        raw.send(frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, 1, b""))
        assert raw.call(3, ECHO, b"after") == (0, grpc_message(b"after"))
        assert raw.goaway is None
