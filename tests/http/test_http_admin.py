"""The admin API, /metrics, /healthz and /docs on the HTTP port, against a live gateway
that the real MNS SDK has put traffic through."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message, QueueMeta

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols.http.listener import HttpListener
from polymq.storage.model import TopicConfig
from tests.live_server import LiveServer
from tests.mns.harness import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    NAMESPACE,
    endpoint,
    start,
)

ROOT = (ADMIN_USER, ADMIN_PASSWORD)
ALICE = ("alice", "alice-password")


def traffic(account: Account) -> None:
    queue = account.get_queue("orders")
    queue.create(QueueMeta())
    for i in range(3):
        queue.send_message(Message(f"order {i}"))
    queue.receive_message(0)


def test_admin_needs_credentials_and_scopes_namespaces(server: LiveServer) -> None:
    base = endpoint(server)
    denied = httpx.get(base + "/admin/namespaces")
    assert denied.status_code == 401 and "Basic" in denied.headers["www-authenticate"]
    assert httpx.get(base + "/admin/namespaces", auth=("alice", "wrong")).status_code == 401
    names = {
        n["name"] for n in httpx.get(base + "/admin/namespaces", auth=ROOT).json()["namespaces"]
    }
    assert {"default", NAMESPACE, "tenant-b"} <= names
    mine = httpx.get(base + "/admin/namespaces", auth=ALICE).json()["namespaces"]
    assert [n["name"] for n in mine] == [NAMESPACE]
    assert httpx.get(base + "/admin/topics?namespace=tenant-b", auth=ALICE).status_code == 404


def test_topics_groups_with_lag_and_connections(server: LiveServer, account: Account) -> None:
    traffic(account)
    base = endpoint(server)
    topics = httpx.get(base + f"/admin/topics?namespace={NAMESPACE}", auth=ROOT).json()["topics"]
    [orders] = [t for t in topics if t["name"] == "orders"]
    assert orders["queues"] == [{"queue_id": 0, "earliest": 0, "latest": 3}]
    assert orders["config"]["retention_ms"] == -1

    groups = httpx.get(base + f"/admin/groups?namespace={NAMESPACE}", auth=ALICE).json()["groups"]
    [group] = [g for g in groups if g["name"] == "mns.orders"]
    assert group["lag"] == 3
    assert group["queues"][0]["inflight"] == 1

    connections = httpx.get(base + "/admin/connections", auth=ROOT).json()
    assert connections["per_protocol"].get("http", 0) >= 1  # the SDK's keep-alive one
    assert all(c["protocol"] == "http" for c in connections["connections"])
    # The SDK's connection is known by the access key that signed its requests.
    assert {(c["user"], c["namespace"]) for c in connections["connections"]} >= {
        ("alice", NAMESPACE)
    }
    usage = httpx.get(base + "/admin/usage", auth=ROOT).json()["usage"]
    [mine] = [u for u in usage if u["namespace"] == NAMESPACE and u["protocol"] == "http"]
    assert (mine["messages_in"], mine["messages_out"], mine["connections"]) == (3, 1, 1)


def test_internal_topics_are_listed_only_when_asked(server: LiveServer) -> None:
    storage = server.gateway.storage
    config = TopicConfig(internal=True)
    server.call(lambda: storage.create_topic(NAMESPACE, "$mqtt.session.x", config))
    base = endpoint(server)

    def names(query: str) -> dict[str, bool]:
        url = base + f"/admin/topics?namespace={NAMESPACE}{query}"
        topics = httpx.get(url, auth=ROOT).json()["topics"]
        return {t["name"]: t["config"]["internal"] for t in topics}

    assert "$mqtt.session.x" not in names("")
    assert names("&internal=true")["$mqtt.session.x"] is True


def test_prioritised_queues_are_counted_over_every_level(
    server: LiveServer, account: Account
) -> None:
    """A message with a priority other than the default lives in another storage queue
    of the MNS queue's topic; admin and metrics must count all of them."""
    queue = account.get_queue("ranked")
    queue.create(QueueMeta())
    for priority in (2, 8, 16):
        message = Message(f"p{priority}")
        message.set_priority(priority)
        queue.send_message(message)
    queue.receive_message(0)
    base = endpoint(server)
    groups = httpx.get(base + f"/admin/groups?namespace={NAMESPACE}", auth=ROOT).json()["groups"]
    [group] = [g for g in groups if g["name"] == "mns.ranked"]
    assert (group["queues"][0]["lag"], group["queues"][0]["inflight"]) == (3, 1)
    text = httpx.get(base + "/metrics").text
    labels = f'namespace="{NAMESPACE}",queue="ranked"'
    assert f'polymq_mns_queue_messages{{{labels},state="active"}} 2.0' in text
    assert f'polymq_mns_queue_messages{{{labels},state="inactive"}} 1.0' in text


def test_accounts_never_show_secrets(server: LiveServer) -> None:
    response = httpx.get(endpoint(server) + "/admin/accounts", auth=ROOT)
    body = response.json()
    assert body["mode"] == "accounts"
    users = {a["user"]: a for a in body["accounts"]}
    assert users["alice"]["access_key"] == "tenant-a-ak"
    assert users["alice"]["namespaces"] == [NAMESPACE]
    for secret in ("tenant-a-secret", "alice-password", ADMIN_PASSWORD, "tenant-b-secret"):
        assert secret not in response.text
    # An account sees only itself.
    alice = httpx.get(endpoint(server) + "/admin/accounts", auth=ALICE).json()["accounts"]
    assert [a["user"] for a in alice] == ["alice"]


def test_metrics_healthz_and_docs(server: LiveServer, account: Account) -> None:
    traffic(account)
    base = endpoint(server)
    metrics = httpx.get(base + "/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert f'polymq_messages_in_total{{namespace="{NAMESPACE}",protocol="http"}} 3.0' in text
    assert f'polymq_messages_out_total{{namespace="{NAMESPACE}",protocol="http"}} 1.0' in text
    labels = f'namespace="{NAMESPACE}",queue="orders"'
    assert f'polymq_mns_queue_messages{{{labels},state="active"}} 2.0' in text
    assert f'polymq_mns_queue_messages{{{labels},state="inactive"}} 1.0' in text
    assert f'polymq_topic_messages{{namespace="{NAMESPACE}",topic="orders"}} 3.0' in text
    assert 'polymq_connections_open{protocol="http"}' in text
    send = 'method="POST",route="/queues/{queue}/messages",status="201"'
    assert f"polymq_http_request_duration_seconds_count{{{send}}} 3.0" in text

    assert httpx.get(base + "/healthz").json() == {"status": "ok"}
    docs = httpx.get(base + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    paths = httpx.get(base + "/openapi.json").json()["paths"]
    assert "/queues/{queue}/messages" in paths and "/admin/groups" in paths


def test_two_servers_in_one_process_keep_their_own_metrics(tmp_path: Path) -> None:
    with start(tmp_path / "a") as one, start(tmp_path / "b") as two:
        for server in (one, two):
            assert httpx.get(endpoint(server) + "/metrics").status_code == 200
        Account(endpoint(one), "tenant-a-ak", "tenant-a-secret").get_queue("q").create(QueueMeta())
        Account(endpoint(one), "tenant-a-ak", "tenant-a-secret").get_queue("q").send_message(
            Message("only on one")
        )
        assert 'polymq_messages_in_total{namespace="tenant-a",protocol="http"} 1.0' in (
            httpx.get(endpoint(one) + "/metrics").text
        )
        assert (
            'namespace="tenant-a",protocol="http"' not in httpx.get(endpoint(two) + "/metrics").text
        )


@pytest.mark.parametrize("path", ["/admin/nothing", "/queues/a/b/c/d"])
def test_unknown_paths_are_404(server: LiveServer, path: str) -> None:
    assert httpx.get(endpoint(server) + path).status_code == 404


def test_connections_have_nagle_off(server: LiveServer) -> None:
    """Responses go out as two writes (head, body); with Nagle on, the second waits
    for a delayed ACK, ~40 ms per request."""
    listener = server.gateway.listeners.get("http")
    assert isinstance(listener, HttpListener)
    with httpx.Client(base_url=endpoint(server)) as client:
        assert client.get("/healthz").status_code == 200

        async def nodelay() -> list[int]:
            return listener.socket_options(socket.IPPROTO_TCP, socket.TCP_NODELAY)

        options = server.call(nodelay)
    assert options and all(options)


def test_metrics_and_groups_survive_a_topic_deleted_under_a_queue(
    server: LiveServer, account: Account
) -> None:
    traffic(account)
    caller = Caller(principal=ANONYMOUS, namespace=NAMESPACE, protocol="kafka")
    server.call(lambda: server.gateway.processor.delete_topic(caller, "orders"))
    base = endpoint(server)
    assert httpx.get(base + "/metrics").status_code == 200
    assert httpx.get(base + "/admin/groups", auth=ROOT).status_code == 200
    with pytest.raises(MNSServerException) as err:
        account.get_queue("orders").receive_message(0)
    assert err.value.type == "QueueNotExist"


def test_mns_dispatcher_matches_only_its_routes(server: LiveServer) -> None:
    """MNS routes bypass FastAPI; anything else (another method, an empty name, a
    longer path) still reaches FastAPI and gets its answer."""
    listener = server.gateway.listeners.get("http")
    assert isinstance(listener, HttpListener) and listener.app is not None
    dispatcher = listener.app.api.dispatcher(listener.app.app)
    found = dispatcher.match("DELETE", "/topics/news/subscriptions/mail")
    assert found is not None
    route, params = found
    assert route.path == "/topics/{topic}/subscriptions/{subscription}"
    assert params == {"topic": "news", "subscription": "mail"}
    assert dispatcher.match("POST", "/queues/q") is None
    assert dispatcher.match("GET", "/queues//messages") is None
    assert dispatcher.match("GET", "/queues/q/messages/x") is None
    base = endpoint(server)
    assert httpx.post(base + "/queues/q").status_code == 405  # FastAPI's answer
    unsigned = httpx.get(base + "/queues/q/messages")  # the dispatcher's MNS error
    assert unsigned.status_code == 400
    assert "<Code>MissingAuthorizationHeader</Code>" in unsigned.text


async def test_a_handler_bug_is_an_mns_internal_error_and_others_fall_through() -> None:
    from fastapi import Request, Response
    from starlette.responses import PlainTextResponse
    from starlette.types import Receive, Scope, Send

    from polymq.protocols.mns.routes import MnsDispatcher, Route

    async def broken(request: Request, queue: str) -> Response:
        raise RuntimeError(f"bug on {queue}")

    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        await PlainTextResponse("fallback", status_code=418)(scope, receive, send)

    dispatcher = MnsDispatcher((Route("GET", "/queues/{queue}", broken, "Broken"),), fallback)
    transport = httpx.ASGITransport(app=dispatcher)
    async with httpx.AsyncClient(transport=transport, base_url="http://mns") as client:
        failed = await client.get("/queues/q")
        assert failed.status_code == 500
        assert "<Code>InternalError</Code>" in failed.text
        assert failed.headers["x-mns-request-id"]
        other = await client.get("/queues/q/messages")
        assert (other.status_code, other.text) == (418, "fallback")
