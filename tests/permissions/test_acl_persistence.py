"""A rule added through one gateway is kept in storage: another gateway over the same
storage applies it (within the Authorizer's refresh), and after a restart over the
same data it still applies and Kafka's DescribeAcls shows it. Both gateways are
reached through their own HTTP listeners (the admin API, MNS), so each step is known
to run at the gateway meant: a Kafka client sends ACL requests and produces to
whichever gateway it picks."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import httpx
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message, QueueMeta

from tests.live_server import LiveServer, live_gateways, live_server, server_config
from tests.permissions.accounts import ACCOUNTS, PASSWORD, SHOP

_TIMEOUT_S = 30.0
_ANY_NAME: Any = None


def _sasl(server: LiveServer, user: str) -> dict[str, Any]:
    host, port = server.address("kafka")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": user,
        "sasl.password": PASSWORD,
    }


def _send_error(server: LiveServer, queue: str) -> str | None:
    """MNS SendMessage as guest through ``server``'s own HTTP listener."""
    host, port = server.address("http")
    try:
        Account(f"http://{host}:{port}", "guest-ak", "guest-sk").get_queue(queue).send_message(
            Message("v")
        )
    except MNSServerException as e:
        return str(e.type)
    return None


def test_a_stored_rule_reaches_every_gateway_and_survives_a_restart(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> None:
    data_dir = tmp_path_factory.mktemp("perm-acl")
    listeners = ("kafka", "http")
    config = dataclasses.replace(server_config(data_dir, listeners), auth=ACCOUNTS)
    topic = f"kept-{uuid.uuid4().hex[:8]}"
    binding = AclBinding(
        ResourceType.TOPIC,
        topic,
        ResourcePatternType.LITERAL,
        "User:guest",
        "*",
        AclOperation.WRITE,
        AclPermissionType.DENY,
    )
    with live_gateways(data_dir, listeners, 2, config=config) as (first, second):
        host, port = second.address("http")
        Account(f"http://{host}:{port}", "guest-ak", "guest-sk").get_queue(topic).create(
            QueueMeta()
        )
        assert _send_error(second, topic) is None  # read (and cached) before the ACL
        host, port = first.address("http")
        rule = {
            "principal": "guest",
            "namespace": SHOP,
            "resource": "topic",
            "pattern": topic,
            "match": "literal",
            "operations": ["write"],
            "effect": "deny",
        }
        added = httpx.post(
            f"http://{host}:{port}/admin/permissions",
            json=rule,
            auth=("ops", PASSWORD),
            timeout=_TIMEOUT_S,
        )
        assert added.status_code == 201
        deadline = time.monotonic() + _TIMEOUT_S
        while _send_error(second, topic) != "AccessDenied":
            assert time.monotonic() < deadline, "the other gateway never applied the ACL"
            time.sleep(0.2)
    with live_server(data_dir, listeners, config=config) as again:
        assert _send_error(again, topic) == "AccessDenied"
        everything = AclBindingFilter(
            ResourceType.TOPIC,
            topic,
            ResourcePatternType.LITERAL,
            _ANY_NAME,
            _ANY_NAME,
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
        admin = AdminClient(_sasl(again, "ops"))
        described = admin.describe_acls(everything).result(_TIMEOUT_S)
        assert described == [binding]
