"""Hostile MNS requests: bodies nested thousands deep, entity bombs, oversize bodies
and batches, nonsense in headers, query and path. Each gets a 4xx with MNS's
``<Error>`` document (never a 500 or a traceback in the log), and the real SDK's
send and receive work afterwards on a new connection."""

from __future__ import annotations

import json
import logging
import resource
import socket
from collections.abc import Iterator

import httpx
import pytest
from mns.account import Account
from mns.queue import Message, QueueMeta

from polymq.gateway.config import AuthConfig
from tests.live_server import LiveServer
from tests.mns.harness import ACCESS_KEY, SECRET_KEY, endpoint, start
from tests.mns.signed import request, sign_headers

NS = "xmlns='http://mns.aliyuncs.com/doc/v1/'"
MESSAGES = "/queues/target/messages"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with start(tmp_path_factory.mktemp("mns-hostile")) as s:
        response = request(endpoint(s), "PUT", "/queues/target", f"<Queue {NS}/>".encode())
        assert response.status_code in (201, 204)
        yield s


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    """Open auth: requests need no signature, so paths and queries can be anything."""
    with start(tmp_path_factory.mktemp("mns-open"), AuthConfig(mode="open")) as s:
        assert httpx.put(endpoint(s) + "/queues/target").status_code in (201, 204)
        yield s


@pytest.fixture(autouse=True)
def one_line_no_traceback(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.INFO):
        yield
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def sdk_round_trip(server: LiveServer) -> None:
    """The real SDK, on a connection of its own, after the hostile request."""
    queue = Account(endpoint(server), ACCESS_KEY, SECRET_KEY).get_queue("healthy")
    queue.create(QueueMeta())
    queue.send_message(Message("still here"))
    got = queue.receive_message(0)
    assert got.message_body == b"still here"
    queue.delete_message(got.receipt_handle)


def error_of(response: httpx.Response) -> tuple[int, str]:
    """Status and MNS code of an ``<Error>`` document (or its JSON form)."""
    if response.headers["content-type"].startswith("application/json"):
        return response.status_code, response.json()["Code"]
    assert response.headers["content-type"].startswith("text/xml"), response.text[:200]
    assert "<RequestId>" in response.text and "<HostId>" in response.text
    return response.status_code, response.text.split("<Code>", 1)[1].split("</Code>", 1)[0]


DEEP = 100_000
DEEP_XML = 50_000  # 350 KB: under the body limit, so the parser must refuse it


@pytest.mark.parametrize(
    "body",
    [
        b"<a>" * DEEP_XML + b"</a>" * DEEP_XML,
        f"<Message {NS}>".encode() + b"<a>" * 5000 + b"x" + b"</a>" * 5000 + b"</Message>",
        f"<Messages {NS}>".encode() + b"<Message>" * 64 + b"</Message>" * 64 + b"</Messages>",
    ],
    ids=["50k", "5k-in-message", "65-levels"],
)
def test_deeply_nested_xml_is_malformed(server: LiveServer, body: bytes) -> None:
    response = request(endpoint(server), "POST", MESSAGES, body)
    assert error_of(response) == (400, "MalformedXML")
    sdk_round_trip(server)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * DEEP + b"]" * DEEP,
        b'{"Messages": ' * 20_000 + b"1" + b"}" * 20_000,
        b'{"Messages": [' + b"[" * 64 + b"]" * 64 + b"]}",
    ],
    ids=["100k-arrays", "20k-objects", "65-levels"],
)
def test_deeply_nested_json_is_refused(server: LiveServer, body: bytes) -> None:
    base = endpoint(server)
    for accept in ("text/xml", "application/json"):
        headers = sign_headers("POST", MESSAGES, body, content_type="application/json")
        headers["accept"] = accept
        response = httpx.post(base + MESSAGES, content=body, headers=headers)
        assert error_of(response) == (400, "MalformedXML")
    sdk_round_trip(server)


LAUGHS = (
    '<?xml version="1.0" encoding="{encoding}"?>'
    '<!DOCTYPE lolz [<!ENTITY lol "lol">'
    + "".join(
        f'<!ENTITY lol{i} "{("&lol" + str(i - 1) + ";") * 10 if i > 1 else "&lol;" * 10}">'
        for i in range(1, 10)
    )
    + "]><Message><MessageBody>&lol9;</MessageBody></Message>"
)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_billion_laughs_is_refused_without_memory_growth(server: LiveServer, encoding: str) -> None:
    """UTF-16 hides ``<!DOCTYPE`` from a byte search: expat itself must refuse it."""
    body = LAUGHS.format(encoding=encoding).encode(encoding)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(20):
        response = request(endpoint(server), "POST", MESSAGES, body)
        assert error_of(response) == (400, "MalformedXML")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 64 << 10, f"peak RSS grew {grown_kib} KiB"  # 10^9 lols: gigabytes
    sdk_round_trip(server)


def test_external_entities_are_refused(server: LiveServer) -> None:
    body = (
        b'<!DOCTYPE m SYSTEM "file:///etc/passwd"><Message><MessageBody>x</MessageBody></Message>'
    )
    assert error_of(request(endpoint(server), "POST", MESSAGES, body)) == (400, "MalformedXML")


def test_oversize_bodies_are_refused(server: LiveServer) -> None:
    base = endpoint(server)
    limit = server.gateway.config.http.max_message_bytes * 6 + 64 * 1024
    over = b"<Message><MessageBody>" + b"y" * limit + b"</MessageBody></Message>"
    # Declared in Content-Length: refused before it is read.
    assert error_of(request(base, "POST", MESSAGES, over)) == (400, "MessageBodyTooLong")

    # Chunked, no Content-Length: refused once the bytes read pass the limit.
    def chunks() -> Iterator[bytes]:
        for offset in range(0, len(over), 64 << 10):
            yield over[offset : offset + (64 << 10)]

    headers = sign_headers("POST", MESSAGES)
    response = httpx.post(base + MESSAGES, content=chunks(), headers=headers)
    assert error_of(response) == (400, "MessageBodyTooLong")
    sdk_round_trip(server)


def test_batch_over_64_kib_in_all_is_refused_whole(server: LiveServer) -> None:
    """MNS: a batch is at most 16 messages and 64 KB together."""
    base = endpoint(server)
    each = "z" * (8 << 10)
    entries = "".join(f"<Message><MessageBody>{each}</MessageBody></Message>" for _ in range(9))
    body = f"<Messages {NS}>{entries}</Messages>".encode()
    assert error_of(request(base, "POST", MESSAGES, body)) == (400, "MessageBodyTooLong")
    assert request(base, "GET", MESSAGES + "?waitseconds=0").status_code == 404  # none stored
    sdk_round_trip(server)


def test_json_batches_past_the_limits(server: LiveServer) -> None:
    base = endpoint(server)

    def post_json(method: str, document: object) -> httpx.Response:
        body = json.dumps(document).encode()
        headers = sign_headers(method, MESSAGES, body, content_type="application/json")
        return httpx.request(method, base + MESSAGES, content=body, headers=headers)

    seventeen = {"Messages": [{"MessageBody": str(i)} for i in range(17)]}
    assert error_of(post_json("POST", seventeen)) == (400, "InvalidArgument")
    # Past limits.max_batch_items entries the document itself is refused.
    huge = {"Messages": [{"MessageBody": "x"}] * 20_000}
    assert error_of(post_json("POST", huge)) == (400, "MalformedXML")
    receipts = {"ReceiptHandles": [f"handle-{i}" for i in range(17)]}
    assert error_of(post_json("DELETE", receipts)) == (400, "InvalidArgument")
    assert error_of(post_json("DELETE", {"ReceiptHandles": ["x"] * 20_000})) == (
        400,
        "MalformedXML",
    )
    assert error_of(post_json("POST", {"Messages": [1, 2, 3]})) == (400, "InvalidArgument")
    sdk_round_trip(server)


@pytest.mark.parametrize(
    "query",
    [
        "numOfMessages=17",
        "numOfMessages=-1",
        "numOfMessages=" + "9" * 5000,
        "numOfMessages=1e3",
        "waitseconds=99999999999999999999",
        "waitseconds=-5",
        "numOfMessages=2&waitseconds=abc",
        "numOfMessages=%00",
        "numOfMessages=%FF%FE",
    ],
)
def test_nonsense_in_the_query(open_server: LiveServer, query: str) -> None:
    response = httpx.get(endpoint(open_server) + f"{MESSAGES}?{query}")
    status, _ = error_of(response)
    assert status == 400


@pytest.mark.parametrize(
    "headers",
    [
        {"x-mns-ret-number": "abc"},
        {"x-mns-ret-number": "9" * 5000},
        {"x-mns-ret-number": "-1"},
    ],
)
def test_nonsense_in_list_headers(open_server: LiveServer, headers: dict[str, str]) -> None:
    response = httpx.get(endpoint(open_server) + "/queues", headers=headers)
    assert error_of(response) == (400, "InvalidArgument")


@pytest.mark.parametrize(
    "date",
    [
        "garbage",
        "Mon, 01 Jan 99999999 00:00:00 GMT",
        "Mon, 01 Jan 0000 00:00:00 GMT",
        "Mon, 99 Foo 2024 99:99:99 GMT",
        "Mon, 01 Jan 2024 00:00:00 +9999",
        "",
    ],
)
def test_nonsense_dates(server: LiveServer, date: str) -> None:
    headers = sign_headers("GET", "/queues/target", extra={"date": date})
    response = httpx.get(endpoint(server) + "/queues/target", headers=headers)
    status, code = error_of(response)
    assert status in (400, 403, 408), code


@pytest.mark.parametrize(
    "raw_path",
    [
        b"/queues/%FF%FE",
        b"/queues/%00",
        b"/queues/" + b"a" * 30_000,
        b"/queues/%C3%28/messages",
        b"/queues/..%2F..%2Fetc",
        b"/topics/%FF/subscriptions/%FE",
    ],
)
def test_nonsense_in_the_path(open_server: LiveServer, raw_path: bytes) -> None:
    """Sent as raw bytes: httpx would re-encode the path."""
    host, port = open_server.address("http")
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"GET " + raw_path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    answer = b"".join(chunks)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:300]


def test_bodies_that_are_not_text(open_server: LiveServer) -> None:
    base = endpoint(open_server)
    for body, content_type in (
        (b'{"MessageBody": "\xff\xfe"}', "application/json"),
        (b"<Message><MessageBody>\xff\xfe</MessageBody></Message>", "text/xml"),
        (b'<?xml version="1.0" encoding="no-such-encoding"?><Message/>', "text/xml"),
        (b'<?xml version="1.0" encoding="utf-7"?><Message/>', "text/xml"),  # multi-byte
        (b'{"MessageBody": "x", "DelaySeconds": ' + b"9" * 5000 + b"}", "application/json"),
        (
            b"<Message><MessageBody>x</MessageBody><DelaySeconds>"
            + b"9" * 5000
            + b"</DelaySeconds>"
            b"</Message>",
            "text/xml",
        ),
        (b'{"MessageBody": "x", "Priority": 1e999}', "application/json"),
        (b'{"MessageBody": "x", "Priority": NaN}', "application/json"),
    ):
        response = httpx.post(base + MESSAGES, content=body, headers={"content-type": content_type})
        status, _ = error_of(response)
        assert status == 400, (body[:80], response.text[:300])
