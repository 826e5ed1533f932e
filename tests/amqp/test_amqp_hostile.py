"""Hostile AMQP peers (issue 14): field tables nested thousands deep or claiming more
bytes than they hold, oversized frames before login, handshakes and frames that never
finish, frames declared but not sent. Each gets Connection.Close with the spec's reply
code (read off a raw socket) or a closed socket, one log line and no traceback, and a
pika client on another connection keeps publishing and consuming."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pamqp import commands, encode

from polymq.protocols.amqp.codec import PROTOCOL_HEADER, method_frame
from polymq.protocols.amqp.fields import FieldError, decode_table
from tests.amqp.conftest import FACTORIES, WAIT_S, connect, start, unique, wait_for
from tests.amqp.test_amqp_bad_input import RawClient
from tests.live_server import LiveServer, live_server

FRAME_MAX = 1 << 20  # room for 20,000 levels of nesting in one frame


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with live_server(
        tmp_path_factory.mktemp("amqp-hostile"),
        ("amqp",),
        factories=FACTORIES,
        overrides={"amqp.frame_max": str(FRAME_MAX), "amqp.heartbeat_s": "0"},
    ) as live:
        yield live


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO)
    return caplog


def _still_serving(server: LiveServer) -> None:
    """Another client publishes and consumes as before."""
    queue = unique("alive")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"still here")
        got: list[bytes] = []

        def received() -> bool:
            method, _, body = ch.basic_get(queue, auto_ack=True)
            if method is not None:
                got.append(body)
            return bool(got)

        wait_for(received)
        assert got == [b"still here"]


def _one_line(logs: pytest.LogCaptureFixture, text: str) -> None:
    """Bad input is logged once, as information: no traceback, no error."""
    assert [r for r in logs.records if r.levelno >= logging.ERROR or r.exc_info] == []
    assert sum(text in r.getMessage() for r in logs.records) == 1, [
        r.getMessage() for r in logs.records
    ]


def _shortstr(text: str) -> bytes:
    return bytes((len(text),)) + text.encode()


def _declare(arguments: bytes, queue: str = "q") -> bytes:
    """queue.declare's argument list with ``arguments`` as its (raw) table."""
    return struct.pack(">HHH", 50, 10, 0) + _shortstr(queue) + b"\x00" + arguments


def _method(channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def _nested(depth: int, kind: bytes) -> bytes:
    """A table whose one value nests ``depth`` tables (``F``) or arrays (``A``)."""
    inner = b""
    for _ in range(depth - 1):
        entry = kind + struct.pack(">I", len(inner)) + inner
        inner = (b"\x00" + entry) if kind == b"F" else entry
    value = kind + struct.pack(">I", len(inner)) + inner
    table = b"\x01k" + value
    return struct.pack(">I", len(table)) + table


def _opened(server: LiveServer) -> RawClient:
    client = RawClient(server)
    client.open()
    client.send(1, commands.Channel.Open())
    assert isinstance(client.next().value, commands.Channel.OpenOk)
    return client


@pytest.mark.parametrize("kind", [b"F", b"A"])
def test_tables_nested_20k_deep_are_a_syntax_error(
    server: LiveServer, logs: pytest.LogCaptureFixture, kind: bytes
) -> None:
    client = _opened(server)
    try:
        client.sock.sendall(_method(1, _declare(_nested(20_000, kind))))
        close = client.expect_close(502)
        assert (close.class_id, close.method_id) == (50, 10)  # queue.declare
        assert "nested deeper than 64" in close.reply_text
    finally:
        client.close()
    _one_line(logs, "nested deeper than 64")
    _still_serving(server)


def test_nesting_at_the_limit_decodes_one_more_level_does_not() -> None:
    for kind in (b"F", b"A"):
        data = _nested(63, kind)  # 64 levels with the outer table
        decode_table(data, 0, len(data), 64)
        deeper = _nested(64, kind)
        with pytest.raises(FieldError, match="nested deeper than 64"):
            decode_table(deeper, 0, len(deeper), 64)


def test_a_non_utf8_long_string_can_be_encoded_again() -> None:
    """pamqp decodes it to bytes, which its encoder refuses: re-encoding properties
    (direct reply-to, stream offsets, dead-lettering) would raise on such a header."""
    table = struct.pack(">I", 8) + b"\x01kS" + struct.pack(">I", 1) + b"\xff"
    decoded, _ = decode_table(table, 0, len(table), 64)
    assert decoded == {"k": bytearray(b"\xff")}
    assert encode.field_table(decoded)


def test_nested_arguments_are_accepted(server: LiveServer) -> None:
    client = _opened(server)
    try:
        queue = unique("nested-ok")
        client.sock.sendall(_method(1, _declare(_nested(20, b"A"), queue)))
        ok = client.next().value
        assert isinstance(ok, commands.Queue.DeclareOk), getattr(ok, "reply_text", ok)
        assert ok.queue == queue
    finally:
        client.close()


def test_headers_nested_deep_in_a_content_header_are_a_syntax_error(
    server: LiveServer, logs: pytest.LogCaptureFixture
) -> None:
    client = _opened(server)
    try:
        client.send(1, commands.Basic.Publish(exchange="", routing_key=unique("deep")))
        headers = _nested(20_000, b"A")
        properties = struct.pack(">H", 0x2000) + headers  # only the headers property
        payload = struct.pack(">HHQ", 60, 0, 1) + properties
        client.sock.sendall(struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce")
        close = client.expect_close(502)
        assert close.class_id == 60
    finally:
        client.close()
    _one_line(logs, "nested deeper than 64")
    _still_serving(server)


@pytest.mark.parametrize(
    "table",
    [
        # A long string claiming 2^31-1 bytes, with three behind it.
        pytest.param(
            struct.pack(">I", 10) + b"\x01kS" + struct.pack(">I", 2**31 - 1) + b"abc",
            id="long-string-2^31-1",
        ),
        # A table claiming more bytes than the frame holds.
        pytest.param(struct.pack(">I", 2**31 - 1) + b"\x01kV", id="table-larger-than-frame"),
        # A value running past the end of its table.
        pytest.param(struct.pack(">I", 4) + b"\x01kI\x00\x00\x00\x00", id="value-past-table"),
        # A byte array claiming more than there is.
        pytest.param(
            struct.pack(">I", 8) + b"\x01kx" + struct.pack(">I", 1000) + b"a",
            id="byte-array-overrun",
        ),
    ],
)
def test_declared_lengths_beyond_the_bytes_present_are_a_syntax_error(
    server: LiveServer, logs: pytest.LogCaptureFixture, table: bytes
) -> None:
    client = _opened(server)
    try:
        client.sock.sendall(_method(1, _declare(table)))
        close = client.expect_close(502)
        assert (close.class_id, close.method_id) == (50, 10)
        assert "overruns" in close.reply_text
    finally:
        client.close()
    _one_line(logs, "overruns")
    _still_serving(server)


def test_a_deep_amqplain_response_is_no_crash(
    server: LiveServer, logs: pytest.LogCaptureFixture
) -> None:
    """Before login: the AMQPLAIN response is a field table too. Undecodable, it gives
    no credentials; open mode lets that in (accounts mode would answer 403)."""
    client = RawClient(server)
    try:
        client.sock.sendall(PROTOCOL_HEADER)
        assert isinstance(client.next().value, commands.Connection.Start)
        response = _nested(20_000, b"A")[4:]  # a table without its size, raw bytes
        start_ok = (
            struct.pack(">HHI", 10, 11, 0)  # connection.start-ok, no client properties
            + _shortstr("AMQPLAIN")
            + struct.pack(">I", len(response))
            + response
            + _shortstr("en_US")
        )
        client.sock.sendall(struct.pack(">BHI", 1, 0, len(start_ok)) + start_ok + b"\xce")
        assert isinstance(client.next().value, commands.Connection.Tune)
    finally:
        client.close()
    assert [r for r in logs.records if r.levelno >= logging.ERROR or r.exc_info] == []
    _still_serving(server)


def test_a_large_frame_before_login_is_a_frame_error(tmp_path: Path) -> None:
    with start(tmp_path, **{"limits.max_unauthenticated_frame_bytes": "4096"}) as live:
        client = RawClient(live)
        try:
            client.sock.sendall(PROTOCOL_HEADER)
            assert isinstance(client.next().value, commands.Connection.Start)
            big = commands.Connection.StartOk(
                client_properties={"padding": "x" * 8192},
                mechanism="PLAIN",
                response="\0guest\0guest",
            )
            client.sock.sendall(method_frame(0, big))
            close = client.expect_close(501)
            assert "exceeds frame_max 4096" in close.reply_text
        finally:
            client.close()
        _still_serving(live)  # pika's own handshake fits


def _still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed ``sock`` (reading what it sent so far)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):  # heartbeats
            pass
    except BlockingIOError:
        return True  # nothing more to read, and no end of stream
    except OSError:
        return False
    return False


def test_a_socket_that_sends_only_the_header_is_closed(tmp_path: Path) -> None:
    """Closed after ``limits.handshake_timeout_ms``: before a silent peer with a 3 s
    heartbeat is dropped (after 6 s), so not after some longer built-in delay."""
    overrides = {"limits.handshake_timeout_ms": "300", "amqp.heartbeat_s": "3"}
    with start(tmp_path, **overrides) as live:
        silent = RawClient(live)
        silent.open(heartbeat=3)  # sends nothing more: dropped after two intervals
        sock = socket.create_connection(live.address("amqp"), timeout=WAIT_S)
        try:
            sock.sendall(PROTOCOL_HEADER)
            received = b""
            while data := sock.recv(65536):  # connection.start, then the close
                received += data
            assert received.startswith(b"\x01\x00\x00")  # a method frame: start
            assert _still_open(silent.sock), "the silent heartbeat peer went first"
        finally:
            sock.close()
            silent.close()
        _still_serving(live)


def test_a_socket_that_sends_one_byte_at_a_time_is_closed(tmp_path: Path) -> None:
    """Every byte arrives before the previous read's timeout, but the handshake as a
    whole does not finish in time: the socket closes before connection.tune."""
    with start(tmp_path, **{"limits.handshake_timeout_ms": "300"}) as live:
        sock = socket.create_connection(live.address("amqp"), timeout=WAIT_S)
        start_ok = commands.Connection.StartOk(
            client_properties={"product": "slow" * 50}, mechanism="PLAIN", response="\0a\0b"
        )
        handshake = PROTOCOL_HEADER + method_frame(0, start_ok)
        sent = 0
        closed = False
        try:
            for byte in handshake:
                try:
                    sock.sendall(bytes((byte,)))
                except OSError:  # reset: closed
                    closed = True
                    break
                sent += 1
                sock.settimeout(0.05)  # pacing between bytes, not a wait on a result
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
                if not data:
                    closed = True
                    break
                assert data.startswith(b"\x01\x00\x00")  # connection.start, never tune
            assert closed, "a handshake sent over seconds was not cut off"
            assert sent < len(handshake)
        finally:
            sock.close()
        _still_serving(live)


def test_a_frame_begun_and_never_finished_is_a_frame_error(tmp_path: Path) -> None:
    overrides = {"limits.frame_timeout_ms": "300", "amqp.heartbeat_s": "0"}
    with start(tmp_path, **overrides) as live:
        client = _opened(live)
        try:
            frame = method_frame(1, commands.Queue.Declare(queue=unique("slow")))
            client.sock.sendall(frame[:-3])  # all but the last bytes, then silence
            close = client.expect_close(501)
            assert "not received whole" in close.reply_text
        finally:
            client.close()
        _still_serving(live)


def test_a_frame_begun_ends_at_its_own_limit_under_a_longer_heartbeat_one(
    tmp_path: Path,
) -> None:
    """The reads before the frame armed the connection's watch timer for a later limit
    (the handshake's, 60 s; the heartbeats', 120 s; both beyond the client's WAIT_S):
    a frame begun must still end at its own shorter limit, so the watch is pulled
    earlier rather than left to fire first."""
    overrides = {
        "limits.frame_timeout_ms": "300",
        "limits.handshake_timeout_ms": "60000",
        "amqp.heartbeat_s": "60",
    }
    with start(tmp_path, **overrides) as live:
        client = RawClient(live)
        try:
            client.open(heartbeat=60)
            client.send(1, commands.Channel.Open())  # read whole, under the 120 s limit
            assert isinstance(client.next().value, commands.Channel.OpenOk)
            frame = method_frame(1, commands.Queue.Declare(queue=unique("slow")))
            client.sock.sendall(frame[:-3])  # all but the last bytes, then silence
            close = client.expect_close(501)  # within the socket's WAIT_S, not 120 s
            assert "not received whole" in close.reply_text
        finally:
            client.close()
        _still_serving(live)


def _held(server: LiveServer) -> int:
    async def held() -> int:
        return server.gateway.frame_budget.held

    return server.call(held)


def test_declared_frames_wait_for_the_shared_budget(tmp_path: Path) -> None:
    """Frames declared but not yet sent hold their size in the gateway's budget; a
    frame that does not fit waits (its connection reads nothing more) until the first
    one has been handled, and then goes through."""
    budget = 300_000
    overrides = {
        "limits.max_buffered_frame_bytes": str(budget),
        "amqp.frame_max": str(FRAME_MAX),
        "amqp.heartbeat_s": "0",
    }
    with start(tmp_path, **overrides) as live:
        first, second = _opened(live), _opened(live)
        try:
            frames = []
            for client in (first, second):
                queue = unique("budget")
                table = encode.field_table({"pad": "x" * 200_000})
                frames.append((client, queue, _method(1, _declare(table, queue))))
            (_, _, frame_a), (_, _, frame_b) = frames
            first.sock.sendall(frame_a[:1000])
            wait_for(lambda: _held(live) == len(frame_a))
            second.sock.sendall(frame_b)  # whole, but it does not fit beside the first
            with connect(live) as conn:  # a connection with small frames still works
                conn.channel().queue_declare(unique("small"))
            assert _held(live) == len(frame_a)  # the second is still waiting
            first.sock.sendall(frame_a[1000:])
            for client, queue, _ in frames:
                ok = client.next().value
                assert isinstance(ok, commands.Queue.DeclareOk), ok
                assert ok.queue == queue
            wait_for(lambda: _held(live) == 0)
        finally:
            first.close()
            second.close()


def test_a_body_in_one_byte_frames_is_stored_whole(server: LiveServer) -> None:
    """A body split over 50,000 frames is assembled in one buffer and stored."""
    queue = unique("split")
    with connect(server) as conn:
        conn.channel().queue_declare(queue)
    client = _opened(server)
    try:
        body = bytes(range(256)) * 200
        client.send(1, commands.Confirm.Select())
        assert isinstance(client.next().value, commands.Confirm.SelectOk)
        client.send(1, commands.Basic.Publish(exchange="", routing_key=queue))
        header = struct.pack(">HHQH", 60, 0, len(body), 0)
        out = [struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"]
        out += [struct.pack(">BHI", 3, 1, 1) + bytes((b,)) + b"\xce" for b in body]
        client.sock.sendall(b"".join(out))
        assert isinstance(client.next().value, commands.Basic.Ack)
    finally:
        client.close()
    with connect(server) as conn:
        ch = conn.channel()
        deadline = time.monotonic() + WAIT_S
        method, _, got = ch.basic_get(queue, auto_ack=True)
        while method is None and time.monotonic() < deadline:
            method, _, got = ch.basic_get(queue, auto_ack=True)
        assert got == body
