"""Each HTTP response leaves in one write: head and body in one TCP segment (uvicorn
wrote them with two, which cost a second send and a second wake-up of the client per
request). Counted on the client's real socket by the kernel (``tcpi_data_segs_in``),
on uvloop as ``polymq run`` serves it; HEAD answers (no body to carry the head) still
arrive, and a keep-alive connection goes on serving after each kind."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from collections.abc import Iterator

import pytest
import uvloop
from mns.account import Account
from mns.queue import QueueMeta

from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, SECRET_KEY, endpoint, start
from tests.mns.signed import sign_headers

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, segments that carried data
# (Linux 4.6+), after 152 bytes of earlier fields.
_DATA_SEGS_IN = 152
_QUEUE = "one-write"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        starting = start(tmp_path_factory.mktemp("http-one-write"))
        s = starting.__enter__()
    finally:
        asyncio.set_event_loop_policy(None)
    try:
        assert isinstance(s.loop, uvloop.Loop)
        Account(endpoint(s), ACCESS_KEY, SECRET_KEY).get_queue(_QUEUE).create(QueueMeta())
        yield s
    finally:
        starting.__exit__(None, None, None)


def data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _DATA_SEGS_IN + 4:
        pytest.skip("this kernel's tcp_info has no tcpi_data_segs_in")
    count: int = struct.unpack_from("I", info, _DATA_SEGS_IN)[0]
    return count


def read_response(sock: socket.socket, *, head_only: bool = False) -> tuple[bytes, bytes]:
    """One response's head and body (by its Content-Length; none for HEAD)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    found = re.search(rb"(?im)^content-length: *(\d+)", head)
    length = 0 if head_only or found is None else int(found.group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than one response"
    return head, body


def signed(method: str, resource: str, body: bytes = b"") -> bytes:
    headers = sign_headers(method, resource, body)
    lines = [f"{method} {resource} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def test_each_response_with_a_body_is_one_segment(server: LiveServer) -> None:
    message = b"<Message><MessageBody>hello</MessageBody></Message>"
    requests = [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),  # FastAPI's side
        (signed("POST", f"/queues/{_QUEUE}/messages", message), b"201"),  # MNS XML
        (signed("GET", "/queues/no-such-queue/messages?waitseconds=0"), b"404"),  # MNS error
        (b"GET /no/such/page HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    ]
    with socket.create_connection(server.address("http"), timeout=20) as sock:
        for request, status in requests * 3:  # keep-alive: each again on one connection
            before = data_segments_in(sock)
            sock.sendall(request)
            head, body = read_response(sock)
            assert head.startswith(b"HTTP/1.1 " + status), head
            assert body
            assert data_segments_in(sock) - before == 1, f"{head!r} came in pieces"


def test_head_and_bodyless_answers_arrive_and_the_connection_goes_on(
    server: LiveServer,
) -> None:
    with socket.create_connection(server.address("http"), timeout=20) as sock:
        # No route takes HEAD: its 405 has a JSON body, whose length is told, not sent.
        sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _ = read_response(sock, head_only=True)
        assert head.startswith(b"HTTP/1.1 405")
        assert re.search(rb"(?im)^content-length: *[1-9]", head)
        sock.sendall(signed("PUT", f"/queues/{_QUEUE}"))  # exists already: 204, no body
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 204") and body == b""
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b'{"status":"ok"}'
