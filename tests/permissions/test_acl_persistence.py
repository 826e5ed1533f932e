"""A Kafka ACL created through one gateway is kept in storage: another gateway over the
same storage applies it (within the Authorizer's refresh), and it is still there after
the server restarts over the same data."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from tests.live_server import LiveServer, live_gateways, live_server, server_config
from tests.permissions.accounts import ACCOUNTS, PASSWORD

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


def _produce_error(server: LiveServer, topic: str) -> int | None:
    reports: list[KafkaError | None] = []
    producer = Producer({**_sasl(server, "guest"), "message.timeout.ms": 10000, "retries": 0})
    producer.produce(topic, b"v", on_delivery=lambda err, _msg: reports.append(err))
    producer.flush(_TIMEOUT_S)
    return None if reports[0] is None else int(reports[0].code())


def test_a_created_acl_reaches_every_gateway_and_survives_a_restart(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> None:
    data_dir = tmp_path_factory.mktemp("perm-acl")
    config = dataclasses.replace(server_config(data_dir, ("kafka",)), auth=ACCOUNTS)
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
    with live_gateways(data_dir, ("kafka",), 2, config=config) as (first, second):
        assert _produce_error(second, topic) is None
        admin = AdminClient(_sasl(first, "ops"))
        for future in admin.create_acls([binding]).values():
            future.result(_TIMEOUT_S)
        deadline = time.monotonic() + _TIMEOUT_S
        while _produce_error(second, topic) != KafkaError.TOPIC_AUTHORIZATION_FAILED:
            assert time.monotonic() < deadline, "the other gateway never applied the ACL"
            time.sleep(0.2)
    with live_server(data_dir, ("kafka",), config=config) as again:
        assert _produce_error(again, topic) == KafkaError.TOPIC_AUTHORIZATION_FAILED
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
