"""Hostile HTTP peers on raw sockets: slow or idle sockets are closed after the head
and body deadlines, oversized heads get 431, unparseable requests 400 (after the
answers owed to the valid requests pipelined before them), an Upgrade leaves no
connection behind; each logs one line and no traceback, and a real MNS client still
works afterwards.

The server runs on uvloop, as ``polymq run`` does: a write to a transport closed under
a running handler raises there (asyncio's own transports drop it silently)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop
from mns.account import Account
from mns.queue import Message, QueueMeta

from polymq.protocols.http.listener import HttpListener
from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, SECRET_KEY, endpoint, start
from tests.mns.signed import sign_headers

DEADLINE_MS = 300
# Far longer than any deadline under test: reaching it means the server never closed.
GIVE_UP_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    overrides = {
        "limits.handshake_timeout_ms": str(DEADLINE_MS),
        "limits.frame_timeout_ms": str(DEADLINE_MS),
    }
    # The live server's loop comes from the policy in force when it starts.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        starting = start(tmp_path_factory.mktemp("http-hostile"), overrides=overrides)
        s = starting.__enter__()
    finally:
        asyncio.set_event_loop_policy(None)
    try:
        assert isinstance(s.loop, uvloop.Loop)
        Account(endpoint(s), ACCESS_KEY, SECRET_KEY).get_queue("alive").create(QueueMeta())
        yield s
    finally:
        starting.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def still_serving(server: LiveServer) -> Iterator[None]:
    """After every hostile peer, the MNS SDK's round trip works on a new connection,
    and every hostile connection has left the registry (the SDK's own keep-alive one
    of the test before too, closed by the idle deadline)."""
    wait_for(lambda: server.gateway.connections.count(protocol="http") == 0)
    yield
    wait_for(lambda: server.gateway.connections.count(protocol="http") == 0)
    queue = Account(endpoint(server), ACCESS_KEY, SECRET_KEY).get_queue("alive")
    queue.create(QueueMeta())
    queue.send_message(Message("still here"))
    got = queue.receive_message(0)
    assert got.message_body == b"still here"
    queue.delete_message(got.receipt_handle)


@pytest.fixture(autouse=True)
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.INFO):
        yield
    # caplog.records here would be the teardown's only: the test's are the call's.
    records = caplog.get_records("setup") + caplog.get_records("call")
    assert not [r for r in records if r.exc_info], "a hostile peer logged a traceback"
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert not errors, f"a hostile peer logged errors: {errors}"


def wait_for(condition: object, timeout_s: float = GIVE_UP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(server.address("http"), timeout=GIVE_UP_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server writes until it closes the connection."""
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def trickle(sock: socket.socket, data: bytes, interval_s: float = 0.05) -> bytes | None:
    """Send ``data`` a byte per ``interval_s``, as a slowloris does; what the server
    answered once it closed the connection, or ``None`` if it let all of it in."""
    sock.settimeout(interval_s)
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return b""
        sock.settimeout(GIVE_UP_S)
        return answer + read_until_closed(sock)
    else:
        return None
    sock.settimeout(GIVE_UP_S)
    return read_until_closed(sock)


def test_idle_socket_is_closed(server: LiveServer) -> None:
    with connect(server) as sock:
        wait_for(lambda: server.gateway.connections.count(protocol="http") == 1)
        assert read_until_closed(sock) == b""


def test_slowloris_head_gets_408_and_is_closed(server: LiveServer) -> None:
    # 400 bytes at 50 ms each would take 20 s: far past the 300 ms deadline.
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"
    with connect(server) as sock:
        answer = trickle(sock, head)
    assert answer is not None, "the server took the whole slow head"
    assert answer.startswith(b"HTTP/1.1 408")


def test_idle_keep_alive_connection_is_closed_after_its_response(server: LiveServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')


def test_busy_connection_outlives_the_deadlines_then_idles_out(server: LiveServer) -> None:
    """The deadlines count from each request's end, not the connection's start: a
    connection asking every fifth of a deadline for four deadlines stays open, and
    once idle it is closed a deadline after its last answer (not before; a lost timer
    would leave it open)."""
    deadline_s = DEADLINE_MS / 1000
    with connect(server) as sock:
        busy_until = time.monotonic() + 4 * deadline_s
        while time.monotonic() < busy_until:
            time.sleep(deadline_s / 5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                data = sock.recv(65536)
                assert data, "closed while busy"
                answer += data
        idle_from = time.monotonic()
        assert read_until_closed(sock) == b""
        idle_s = time.monotonic() - idle_from
    assert deadline_s * 0.5 < idle_s < deadline_s + 5.0


def test_slow_body_is_closed(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    """Signed, so the handler is reading the body when the deadline closes it."""
    body = b"<Message><MessageBody>" + b"x" * 400 + b"</MessageBody></Message>"
    headers = sign_headers("POST", "/queues/alive/messages", body)
    head = b"POST /queues/alive/messages HTTP/1.1\r\nHost: x\r\n" + b"".join(
        f"{name}: {value}\r\n".encode() for name, value in headers.items()
    )
    head += f"Content-Length: {len(body)}\r\n\r\n".encode()
    with connect(server) as sock:
        sock.sendall(head)
        answer = trickle(sock, body)
    assert answer == b"", "the server took the whole slow body"
    wait_for(lambda: any("left mid-request" in r.getMessage() for r in caplog.records))


@pytest.mark.parametrize(
    "head",
    [
        # Many headers, each complete.
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Many: aaaaaaaaaaaaaaaaaaaa\r\n" * 5000,
        # One header that never ends: llhttp buffers it before any callback.
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (1 << 20),
        # A request line that never ends.
        b"GET /" + b"a" * (1 << 20),
    ],
    ids=["many-headers", "endless-header", "endless-url"],
)
def test_oversized_head_gets_431(server: LiveServer, head: bytes) -> None:
    with connect(server) as sock:
        # Closed while we are still sending: the 431 may be lost to the reset.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431") or answer == b""


def test_large_normal_head_is_served(server: LiveServer) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 30_000 + b"\r\n"
    with connect(server) as sock:
        sock.sendall(head + b"Connection: close\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")


def test_upgrade_request_is_answered_and_leaves_no_connection(server: LiveServer) -> None:
    request = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    for _ in range(3):
        with connect(server) as sock:
            sock.sendall(request)
            answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200")
    # The still_serving fixture checks the registry is empty again.


def test_first_request_marks_the_connection_established(server: LiveServer) -> None:
    registry = server.gateway.connections
    with connect(server) as sock:
        wait_for(lambda: registry.count(protocol="http") == 1)
        [conn] = registry.list(protocol="http")
        assert not registry.is_established(conn.id)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert registry.is_established(conn.id)


def test_pipelined_requests_are_all_answered(server: LiveServer) -> None:
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(one * 20 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_until_closed(sock)
    assert answers.count(b"HTTP/1.1 200") == 21


def test_per_address_limit_refuses_the_extra_connection(tmp_path: Path) -> None:
    overrides = {"limits.max_connections_per_address": "2"}
    with start(tmp_path, overrides=overrides) as limited:
        held = [connect(limited) for _ in range(2)]
        wait_for(lambda: limited.gateway.connections.count(protocol="http") == 2)
        with connect(limited) as extra:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_until_closed(extra) == b""  # closed unanswered
        for sock in held:
            sock.close()
        wait_for(lambda: limited.gateway.connections.count(protocol="http") == 0)
        with connect(limited) as again:
            again.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_until_closed(again).startswith(b"HTTP/1.1 200")


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def responses(data: bytes) -> list[bytes]:
    """The status lines in what the server wrote, in order (the bodies here are JSON
    or empty, and a body is not followed by a line end)."""
    return re.findall(rb"HTTP/1\.1 \d{3} [^\r]*", data)


@pytest.mark.parametrize(
    ("bad", "answered", "refusal"),
    [
        # llhttp stops at the header line without a colon ("Invalid header token").
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 3, b"HTTP/1.1 400"),
        # What the network fuzzer sent (a recorded MNS session, a bit flipped in a
        # header name): without its Content-Length the POST is answered (unsigned, an
        # MNS error), and its body is read as the next request's method.
        (b"POST /queues/q/messages HTTP/1.1\r\nContent-Len'th: 5\r\n\r\nhello", 4, b"HTTP/1.1 400"),
    ],
    ids=["bad-header", "fuzzed-header-name"],
)
def test_requests_pipelined_before_a_bad_one_are_answered_first(
    server: LiveServer,
    caplog: pytest.LogCaptureFixture,
    bad: bytes,
    answered: int,
    refusal: bytes,
) -> None:
    """uvicorn wrote its 400 at once and closed, ahead of the answers owed (the valid
    requests' answers were lost, or read by the client as the 400), and on uvloop the
    handlers still running then wrote to the closed transport: a RuntimeError
    traceback per connection, 20-30 per 30 s of the network fuzzer."""
    with connect(server) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(HEALTHZ * 3 + bad + HEALTHZ)
        answer = read_until_closed(sock)
    statuses = responses(answer)
    assert len(statuses) == answered + 1, statuses
    assert statuses[:3] == [b"HTTP/1.1 200 OK"] * 3
    assert statuses[-1].startswith(refusal), statuses
    assert answer.endswith(b"connection: close\r\n\r\n")
    closing = [r for r in caplog.records if "http: closing" in r.getMessage()]
    assert len(closing) == 1 and closing[0].levelno == logging.INFO, closing


def long_poll_request() -> bytes:
    """A signed ReceiveMessage on the (empty) queue "alive", waiting 1 s: a request
    whose handler is still running when what the peer sends next arrives."""
    resource = "/queues/alive/messages?waitseconds=1"
    headers = sign_headers("GET", resource)
    head = f"GET {resource} HTTP/1.1\r\nHost: x\r\n".encode() + b"".join(
        f"{name}: {value}\r\n".encode() for name, value in headers.items()
    )
    return head + b"\r\n"


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        (b"\x00\x01garbage\r\n\r\n", b"HTTP/1.1 400"),
        (b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * (80 << 10) + b"\r\n\r\n", b"HTTP/1.1 431"),
    ],
    ids=["garbage", "oversized-head"],
)
def test_bad_bytes_during_a_long_poll_are_refused_after_its_answer(
    server: LiveServer, bad: bytes, refusal: bytes
) -> None:
    """The bad bytes arrive while a handler is waiting (a ReceiveMessage long poll on
    an empty queue): it still answers, then the refusal comes, then the close. Before,
    the close came at once, and the handler's answer met a closed transport."""
    registry = server.gateway.connections
    with connect(server) as sock:
        sock.sendall(long_poll_request())
        # Its headers were parsed: what follows arrives while the handler waits.
        wait_for(lambda: any(registry.is_established(c.id) for c in registry.list(protocol="http")))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(bad)
        answer = read_until_closed(sock)
    statuses = responses(answer)
    assert len(statuses) == 2 and statuses[0] == b"HTTP/1.1 404 Not Found", statuses
    assert b"MessageNotExist" in answer
    assert statuses[1].startswith(refusal), statuses


def test_peer_gone_during_a_long_poll_with_requests_pipelined_behind_it(
    server: LiveServer,
) -> None:
    """uvicorn told only its newest request that the peer had left: with requests
    pipelined behind it, the one being served (the long poll) went on and wrote to the
    closed transport when its wait ended (a RuntimeError traceback on uvloop; 7 per
    30 s of the network fuzzer, which resets its connections after 0.5 s of silence).
    The no_tracebacks fixture checks the log."""
    listener = server.gateway.listeners.get("http")
    assert isinstance(listener, HttpListener)

    async def in_flight() -> int:
        return listener.requests_in_flight()

    registry = server.gateway.connections
    with connect(server) as sock:
        sock.sendall(long_poll_request() + HEALTHZ * 2)  # one read: the two are queued
        wait_for(lambda: any(registry.is_established(c.id) for c in registry.list(protocol="http")))
        assert server.call(in_flight) == 1
        # A reset, as the fuzzer's hang-up: no FIN to read, the peer is just gone.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    wait_for(lambda: registry.count(protocol="http") == 0)  # uvicorn's connection_lost ran
    wait_for(lambda: server.call(in_flight) == 0)  # the long poll's wait ended


def test_bad_request_alone_gets_400(server: LiveServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"\x00\x01\x02 / HTTP/1.1\r\n\r\n")
        assert responses(read_until_closed(sock)) == [b"HTTP/1.1 400 Bad Request"]


def test_body_broken_while_its_handler_reads_gets_400(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A signed SendMessage whose chunked body turns to garbage while the handler is
    reading it: the handler is told its peer is gone, the peer gets 400."""
    body = b"<Message><MessageBody>abc</MessageBody></Message>"
    headers = sign_headers("POST", "/queues/alive/messages", body)
    head = b"POST /queues/alive/messages HTTP/1.1\r\nHost: x\r\n" + b"".join(
        f"{name}: {value}\r\n".encode() for name, value in headers.items()
    )
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n" % (10, body[:10]))
        # The handler is reading: it logs when it learns the client is gone.
        wait_for(lambda: server.gateway.connections.count(protocol="http") == 1)
        sock.sendall(b"zz-not-a-chunk-size\r\n")
        assert responses(read_until_closed(sock)) == [b"HTTP/1.1 400 Bad Request"]
    wait_for(lambda: any("left mid-request" in r.getMessage() for r in caplog.records))
