"""Bad input gets MNS's error code and HTTP status in an ``<Error>`` document, and the
server keeps serving everyone else."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from mns.account import Account, AccountMeta
from mns.mns_exception import MNSServerException
from mns.queue import Message, Queue, QueueMeta

from polymq.gateway.config import AuthConfig
from tests.live_server import LiveServer, live_server, server_config
from tests.mns.harness import (
    ACCESS_KEY,
    ACCOUNTS,
    FACTORIES,
    OTHER_ACCESS_KEY,
    OTHER_SECRET_KEY,
    SECRET_KEY,
    endpoint,
    start,
)
from tests.mns.signed import request, sign_headers

NS = "xmlns='http://mns.aliyuncs.com/doc/v1/'"


@pytest.fixture
def queue(account: Account) -> Queue:
    q = account.get_queue("healthy")
    q.create(QueueMeta())
    return q


def still_serving(queue: Queue) -> None:
    """Another client's round trip works after the bad request."""
    queue.send_message(Message("still here"))
    got = queue.receive_message(0)
    assert got.message_body == b"still here"
    queue.delete_message(got.receipt_handle)


def error_of(response: httpx.Response) -> tuple[int, str]:
    assert response.headers["content-type"].startswith("text/xml")
    assert "<RequestId>" in response.text and "<HostId>" in response.text
    code = response.text.split("<Code>", 1)[1].split("</Code>", 1)[0]
    return response.status_code, code


def test_malformed_xml(server: LiveServer, queue: Queue) -> None:
    base = endpoint(server)
    for body in (b"<Message><MessageBody>x</Message>", b"\xff\xfe not xml", b"<a><b/><b/></a>"):
        response = request(base, "POST", "/queues/healthy/messages", body)
        assert error_of(response)[0] == 400
    bad = request(base, "POST", "/queues/healthy/messages", b"<Message><MessageBody>x</Message>")
    assert error_of(bad) == (400, "MalformedXML")
    entity = b'<!DOCTYPE m [<!ENTITY a "aaaa">]><Message><MessageBody>&a;</MessageBody></Message>'
    assert error_of(request(base, "POST", "/queues/healthy/messages", entity)) == (
        400,
        "MalformedXML",
    )
    # A body that does not match its Content-MD5 (the header is signed, the body not).
    good = f"<Message {NS}><MessageBody>a</MessageBody></Message>".encode()
    headers = sign_headers("POST", "/queues/healthy/messages", good)
    tampered = good.replace(b">a<", b">b<")
    response = httpx.post(base + "/queues/healthy/messages", content=tampered, headers=headers)
    assert error_of(response) == (400, "InvalidDigest")
    still_serving(queue)


def test_oversize_body(server: LiveServer, queue: Queue) -> None:
    with pytest.raises(MNSServerException) as err:
        queue.send_message(Message("x" * 70_000))
    assert err.value.type == "MessageBodyTooLong"
    # A request far over any batch is refused from its Content-Length, unread.
    huge = b"<Message><MessageBody>" + b"y" * (4 << 20) + b"</MessageBody></Message>"
    response = request(endpoint(server), "POST", "/queues/healthy/messages", huge)
    assert error_of(response) == (400, "MessageBodyTooLong")
    still_serving(queue)


def test_wrong_signature_unknown_key_missing_and_stale_date(
    server: LiveServer, queue: Queue
) -> None:
    base = endpoint(server)
    with pytest.raises(MNSServerException) as err:
        Account(base, ACCESS_KEY, "not-the-secret").get_queue("healthy").get_attributes()
    assert err.value.type == "SignatureDoesNotMatch"

    wrong = request(base, "GET", "/queues/healthy", secret_key="not-the-secret")
    assert error_of(wrong) == (403, "SignatureDoesNotMatch")
    unknown = request(base, "GET", "/queues/healthy", access_key="nobody", secret_key="x")
    assert error_of(unknown) == (403, "InvalidAccessKeyId")
    missing = httpx.get(base + "/queues/healthy", headers={"x-mns-version": "2015-06-06"})
    assert error_of(missing) == (400, "MissingAuthorizationHeader")
    old = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() - 3600))
    headers = sign_headers("GET", "/queues/healthy", extra={"date": old})
    stale = httpx.get(base + "/queues/healthy", headers=headers)
    assert error_of(stale) == (408, "TimeExpired")
    # Signing one resource and requesting another does not pass.
    headers = sign_headers("GET", "/queues/healthy")
    assert error_of(httpx.get(base + "/queues/other", headers=headers)) == (
        403,
        "SignatureDoesNotMatch",
    )
    still_serving(queue)


def test_unknown_queue_and_other_tenants_queue(server: LiveServer, queue: Queue) -> None:
    base = endpoint(server)
    ghost = Account(base, ACCESS_KEY, SECRET_KEY).get_queue("ghost")
    calls: tuple[Callable[[], object], ...] = (
        lambda: ghost.send_message(Message("x")),
        lambda: ghost.receive_message(0),
        lambda: ghost.get_attributes(),
        lambda: ghost.peek_message(),
    )
    for call in calls:
        with pytest.raises(MNSServerException) as err:
            call()
        assert err.value.type == "QueueNotExist"
    # Tenant b's access key lives in another namespace: tenant a's queue is not there.
    other = Account(base, OTHER_ACCESS_KEY, OTHER_SECRET_KEY).get_queue("healthy")
    with pytest.raises(MNSServerException) as err:
        other.get_attributes()
    assert err.value.type == "QueueNotExist"
    assert error_of(request(base, "GET", "/queues/ghost"))[0] == 404
    still_serving(queue)


def test_bad_receipt_handles(server: LiveServer, account: Account, queue: Queue) -> None:
    for handle in ("garbage!", "AQEAAAAAAAAAAAAAAAAAAAABAAAAAAAAAA"):
        with pytest.raises(MNSServerException) as err:
            queue.delete_message(handle)
        assert err.value.type == "ReceiptHandleError"
    # A handle from another queue is no good here either.
    other = account.get_queue("another")
    other.create(QueueMeta())
    other.send_message(Message("x"))
    handle = other.receive_message(0).receipt_handle
    with pytest.raises(MNSServerException) as err:
        queue.delete_message(handle)
    assert err.value.type == "ReceiptHandleError"
    response = request(endpoint(server), "PUT", "/queues/healthy/messages?ReceiptHandle=zz")
    assert error_of(response) == (400, "MissingVisibilityTimeout")
    other.delete_message(handle)
    still_serving(queue)


def test_invalid_arguments(server: LiveServer, account: Account, queue: Queue) -> None:
    with pytest.raises(MNSServerException) as err:
        account.get_queue("bad-vis").create(QueueMeta(vis_timeout=50_000))
    assert err.value.type == "InvalidArgument"
    base = endpoint(server)
    body = f"<Message {NS}><MessageBody>x</MessageBody><Priority>99</Priority></Message>"
    response = request(base, "POST", "/queues/healthy/messages", body.encode())
    assert error_of(response) == (400, "InvalidArgument")
    too_many = "".join(f"<Message><MessageBody>{i}</MessageBody></Message>" for i in range(17))
    response = request(
        base, "POST", "/queues/healthy/messages", f"<Messages {NS}>{too_many}</Messages>".encode()
    )
    assert error_of(response) == (400, "InvalidArgument")
    response = request(base, "PUT", "/queues/bad name!", f"<Queue {NS}/>".encode())
    assert error_of(response) == (400, "InvalidQueueName")
    response = request(base, "GET", "/queues/healthy/messages?numOfMessages=17")
    assert error_of(response) == (400, "InvalidArgument")
    still_serving(queue)


def test_garbage_on_the_socket_closes_only_that_connection(
    server: LiveServer, queue: Queue
) -> None:
    host, port = server.address("http")
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01 this is not http\r\n\r\n")
        reply = sock.recv(4096)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    still_serving(queue)


def test_account_attributes(account: Account) -> None:
    assert account.get_attributes().logging_bucket == ""
    account.set_attributes(AccountMeta("bucket"))


def test_stopping_with_a_long_poll_in_flight(tmp_path: Path) -> None:
    outcome: list[str] = []
    with start(tmp_path) as server:
        queue = Account(endpoint(server), ACCESS_KEY, SECRET_KEY).get_queue("waiting")
        queue.create(QueueMeta())

        def poll() -> None:
            try:
                queue.receive_message(30)
                outcome.append("message")
            except Exception as e:  # the server went away mid-poll
                outcome.append(type(e).__name__)

        poller = threading.Thread(target=poll)
        poller.start()
        # Wait until the poll is being served: its connection is registered.
        deadline = time.monotonic() + 10
        while server.gateway.connections.count(protocol="http") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    poller.join(30)
    assert not poller.is_alive() and outcome and outcome != ["message"]


def test_connection_limit_refuses_extra_connections(tmp_path: Path) -> None:
    config = dataclasses.replace(
        server_config(tmp_path, ("http",), {"limits.max_connections": "2"}), auth=ACCOUNTS
    )
    with live_server(tmp_path, ("http",), config=config, factories=FACTORIES) as server:
        host, port = server.address("http")
        held = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        deadline = time.monotonic() + 10
        while server.gateway.connections.count(protocol="http") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with socket.create_connection((host, port), timeout=10) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = extra.recv(1024)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed unanswered
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while server.gateway.connections.count(protocol="http") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.get(endpoint(server) + "/healthz").status_code == 200


NASTY_BODIES = (
    b"",
    b"\x00\x01\x02",
    b"<Queue><VisibilityTimeout>-1</VisibilityTimeout></Queue>",
    b"<Queue><DlqPolicy>x</DlqPolicy></Queue>",
    b"<Message><UserProperties><PropertyValue><Name>a</Name><Type>BINARY</Type>"
    b"<Value>!!</Value></PropertyValue></UserProperties></Message>",
    b"<Messages></Messages>",
    b"<ReceiptHandles><ReceiptHandle>x</ReceiptHandle></ReceiptHandles>",
    b"<Subscription><Endpoint>queues/</Endpoint></Subscription>",
    b"<Topic><MaximumMessageSize>1</MaximumMessageSize></Topic>",
    b'{"MessageBody": 5}',
    b'{"Messages": "no"}',
    b"[1, 2]",
    b"<" * 10_000,
    # Nested past limits.max_nesting_depth (these were 500s from a RecursionError).
    b"<a>" * 20_000 + b"</a>" * 20_000,
    b"[" * 50_000 + b"]" * 50_000,
    b'{"MessageBody": ' * 20_000 + b'"x"' + b"}" * 20_000,
    b'<?xml version="1.0" encoding="nope"?><Message/>',
)


def test_nasty_bodies_never_cause_server_errors(tmp_path: Path) -> None:
    paths = (
        ("PUT", "/queues/q"),
        ("POST", "/queues/q/messages"),
        ("DELETE", "/queues/q/messages"),
        ("PUT", "/queues/q?metaoverride=true"),
        ("PUT", "/topics/t"),
        ("POST", "/topics/t/messages"),
        ("PUT", "/topics/t/subscriptions/s"),
        ("PUT", "/topics/t/subscriptions/s?metaoverride=true"),
    )
    with (
        start(tmp_path, AuthConfig(mode="open"), {"storage.durability": "async"}) as server,
        httpx.Client(base_url=endpoint(server)) as client,
    ):
        client.put("/queues/q").raise_for_status()
        client.put("/topics/t").raise_for_status()
        for body in NASTY_BODIES:
            for content_type in ("text/xml", "application/json"):
                for method, path in paths:
                    response = client.request(
                        method, path, content=body, headers={"content-type": content_type}
                    )
                    assert response.status_code < 500, (body, method, path, response.text)
        assert client.get("/healthz").status_code == 200


def test_batch_send_stores_the_good_messages_and_names_each_failure(account: Account) -> None:
    """MNS answers a batch with refused messages 500, one entry per message: the SDK
    raises with the first error's code and every entry in ``sub_errors``."""
    queue = account.get_queue("partial")
    queue.create(QueueMeta(max_msg_size=1024))
    batch = [
        Message("first"),
        Message("x" * 2048),  # base64 makes it longer still: over MaximumMessageSize
        Message("late", delay_seconds=999_999),
        Message("odd", priority=20),
        Message("last"),
    ]
    with pytest.raises(MNSServerException) as err:
        queue.batch_send_message(batch)
    assert err.value.type == "MessageBodyTooLong"
    entries = err.value.sub_errors
    assert [e.get("ErrorCode") for e in entries] == [
        None,
        "MessageBodyTooLong",
        "InvalidArgument",
        "InvalidArgument",
        None,
    ]
    stored_ids = [entries[0]["MessageId"], entries[4]["MessageId"]]
    got = queue.batch_receive_message(16, 1)
    assert [m.message_body for m in got] == [b"first", b"last"]
    assert [m.message_id for m in got] == stored_ids


def test_batch_send_with_every_message_refused_stores_nothing(server: LiveServer) -> None:
    base = endpoint(server)
    assert request(base, "PUT", "/queues/refused", f"<Queue {NS}/>".encode()).status_code == 201
    body = (
        f"<Messages {NS}><Message><MessageBody>a</MessageBody><DelaySeconds>-1</DelaySeconds>"
        "</Message><Message><MessageBody>b</MessageBody><Priority>0</Priority></Message>"
        "</Messages>"
    ).encode()
    response = request(base, "POST", "/queues/refused/messages", body)
    assert response.status_code == 500
    assert response.text.count("<ErrorCode>InvalidArgument</ErrorCode>") == 2
    assert "<MessageId>" not in response.text
    empty = request(base, "GET", "/queues/refused/messages?waitseconds=0")
    assert empty.status_code == 404
