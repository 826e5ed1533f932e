"""Hostile HTTP peers on raw sockets: slow or idle sockets are closed after the head
and body deadlines, oversized heads get 431, an Upgrade leaves no connection behind;
each logs one line, and a real MNS client still works afterwards."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mns.account import Account
from mns.queue import Message, QueueMeta

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
    with start(tmp_path_factory.mktemp("http-hostile"), overrides=overrides) as s:
        yield s


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
    assert not [r for r in caplog.records if r.exc_info], "a hostile peer logged a traceback"


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
