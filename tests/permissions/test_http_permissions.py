"""The MNS-style API answers the permission model's refusals with MNS's AccessDenied
(403, the MNS error body), seen by the aliyun MNS SDK; ListQueue/ListTopic show only
what the account may describe and nothing of another namespace; the admin API lists,
adds and deletes rules (admins only), and a rule it adds applies at once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message, QueueMeta
from mns.topic import TopicMessage, TopicMeta

from tests.live_server import LiveServer
from tests.permissions.accounts import OTHER, PASSWORD, SHOP, permission_server

_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("perm-http"), ("http",)) as s:
        yield s


def _base(server: LiveServer) -> str:
    host, port = server.address("http")
    return f"http://{host}:{port}"


def _mns(server: LiveServer, user: str) -> Account:
    return Account(_base(server), f"{user}-ak", f"{user}-sk")


def _denied(action: Any) -> MNSServerException:
    with pytest.raises(MNSServerException) as caught:
        action()
    # The SDK read the type from the MNS error body's <Code> (of a 4xx answer).
    assert caught.value.type == "AccessDenied"
    return caught.value


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def test_queues_read_and_write_permissions(server: LiveServer) -> None:
    name = _name("data-")
    writer, reader = _mns(server, "writer"), _mns(server, "reader")
    writer.get_queue(name).create(QueueMeta())
    writer.get_queue(name).send_message(Message("hello"))
    got = reader.get_queue(name).receive_message(5)
    assert got.message_body == b"hello"
    reader.get_queue(name).delete_message(got.receipt_handle)
    _denied(lambda: reader.get_queue(name).send_message(Message("nope")))
    _denied(lambda: writer.get_queue(name).receive_message(1))
    _denied(lambda: reader.get_queue(_name("data-")).create(QueueMeta()))
    _denied(lambda: writer.get_queue(name).delete())


def test_topics_read_and_write_permissions(server: LiveServer) -> None:
    name = _name("data-")
    writer, reader = _mns(server, "writer"), _mns(server, "reader")
    writer.get_topic(name).create(TopicMeta())
    writer.get_topic(name).publish_message(TopicMessage("hello"))
    _denied(lambda: reader.get_topic(name).publish_message(TopicMessage("nope")))


def test_listings_show_only_what_may_be_described(server: LiveServer) -> None:
    mine, secret, secret_topic = _name("data-"), _name("secret-"), _name("secret-")
    guest = _mns(server, "guest")
    guest.get_queue(mine).create(QueueMeta())
    guest.get_queue(secret).create(QueueMeta())
    guest.get_topic(secret_topic).create(TopicMeta())
    listed, _ = _mns(server, "reader").list_queue(prefix="", ret_number=1000)
    names = {url.rsplit("/", 1)[-1] for url in listed}
    assert mine in names and secret not in names
    topics, _ = _mns(server, "reader").list_topic(prefix="", ret_number=1000)
    assert not any(url.endswith("/" + secret_topic) for url in topics)
    # Another namespace: none of them.
    outsider_queues, _ = _mns(server, "outsider").list_queue(prefix="", ret_number=1000)
    assert not {url.rsplit("/", 1)[-1] for url in outsider_queues} & {mine, secret}
    # The admin API's listing too.
    admin_topics = httpx.get(
        f"{_base(server)}/admin/topics", auth=("reader", PASSWORD), timeout=_TIMEOUT_S
    ).json()["topics"]
    admin_names = {t["name"] for t in admin_topics}
    assert mine in admin_names and secret not in admin_names
    outsider_topics, _ = _mns(server, "outsider").list_topic(prefix="", ret_number=1000)
    assert not any(url.endswith("/" + secret_topic) for url in outsider_topics)


def _rule(**fields: Any) -> dict[str, Any]:
    return {
        "principal": "guest",
        "namespace": SHOP,
        "resource": "topic",
        "match": "prefix",
        "effect": "deny",
        **fields,
    }


def test_admin_api_lists_adds_and_deletes_rules(server: LiveServer) -> None:
    base = _base(server)
    ops, guest = ("ops", PASSWORD), ("guest", PASSWORD)
    name = _name("held-")
    _mns(server, "guest").get_queue(name).create(QueueMeta())
    listed = httpx.get(f"{base}/admin/permissions", auth=ops, timeout=_TIMEOUT_S).json()["rules"]
    assert any(
        r["principal"] == "reader" and r["pattern"] == "data-*" and r["source"] == "config"
        for r in listed
    )
    rule = _rule(pattern="held-", operations=["write"])
    # Admins only.
    refused = httpx.post(f"{base}/admin/permissions", json=rule, auth=guest, timeout=_TIMEOUT_S)
    assert refused.status_code == 403
    added = httpx.post(f"{base}/admin/permissions", json=rule, auth=ops, timeout=_TIMEOUT_S)
    assert added.status_code == 201
    key = added.json()["key"]
    _denied(lambda: _mns(server, "guest").get_queue(name).send_message(Message("held")))
    # The account sees its own rules, not others'.
    own = httpx.get(f"{base}/admin/permissions", auth=guest, timeout=_TIMEOUT_S).json()["rules"]
    assert [r["key"] for r in own] == [key]
    configured = next(r for r in listed if r["source"] == "config")
    url = f"{base}/admin/permissions/{SHOP}/{configured['key']}"
    assert httpx.delete(url, auth=ops, timeout=_TIMEOUT_S).status_code == 409
    url = f"{base}/admin/permissions/{SHOP}/{key}"
    assert httpx.delete(url, auth=guest, timeout=_TIMEOUT_S).status_code == 403
    assert httpx.delete(url, auth=ops, timeout=_TIMEOUT_S).status_code == 204
    _mns(server, "guest").get_queue(name).send_message(Message("free"))
    assert httpx.delete(url, auth=ops, timeout=_TIMEOUT_S).status_code == 404


def test_admin_api_shows_nothing_of_another_namespace(server: LiveServer) -> None:
    base = _base(server)
    outsider = ("outsider", PASSWORD)
    name = _name("data-")
    _mns(server, "writer").get_queue(name).create(QueueMeta())
    topics = httpx.get(f"{base}/admin/topics", auth=outsider, timeout=_TIMEOUT_S).json()
    assert {t["namespace"] for t in topics["topics"]} <= {OTHER}
    asked = httpx.get(f"{base}/admin/topics?namespace={SHOP}", auth=outsider, timeout=_TIMEOUT_S)
    assert asked.status_code == 404
    rules = httpx.get(f"{base}/admin/permissions", auth=outsider, timeout=_TIMEOUT_S).json()
    assert rules["rules"] == []
    shop_rules = httpx.get(
        f"{base}/admin/permissions?namespace={SHOP}", auth=outsider, timeout=_TIMEOUT_S
    )
    assert shop_rules.status_code == 404
