"""Kafka: each refusal of the permission model is Kafka's own error code, seen by
confluent-kafka; CreateAcls/DescribeAcls/DeleteAcls through its AdminClient change
what another client may do; an account of another namespace learns nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer, ShareConsumer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from tests.kafka.clients import confluent_consumer
from tests.live_server import LiveServer
from tests.permissions.accounts import PASSWORD, permission_server

_TIMEOUT_S = 30.0
_ANY_NAME: Any = None  # a filter's "any" (the stubs say str)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("perm-kafka"), ("kafka",)) as s:
        yield s


def _sasl(server: LiveServer, user: str) -> dict[str, Any]:
    host, port = server.address("kafka")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": user,
        "sasl.password": PASSWORD,
    }


def _produce(server: LiveServer, user: str, topic: str, **extra: Any) -> KafkaError | None:
    """One record's delivery report: None when stored, else its error."""
    reports: list[KafkaError | None] = []
    producer = Producer({**_sasl(server, user), "message.timeout.ms": 10000, "retries": 0, **extra})
    producer.produce(topic, b"v", on_delivery=lambda err, _msg: reports.append(err))
    producer.flush(_TIMEOUT_S)
    assert len(reports) == 1
    return reports[0]


def _consume_error(server: LiveServer, user: str, topic: str, group: str) -> int | None:
    """The first error code a consumer of ``topic`` in ``group`` gets, or None once a
    record arrived."""
    extra = {k: v for k, v in _sasl(server, user).items() if k != "bootstrap.servers"}
    consumer = confluent_consumer(_sasl(server, user)["bootstrap.servers"], group, **extra)
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            error = message.error()
            if error is None:
                return None
            if error.code() != KafkaError._PARTITION_EOF:
                return int(error.code())
        raise AssertionError("neither a record nor an error")
    finally:
        consumer.close()


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def test_writer_writes_reader_reads_and_not_the_reverse(server: LiveServer) -> None:
    topic = _name("data-")
    assert _produce(server, "writer", topic) is None  # create + write allowed
    error = _produce(server, "reader", topic)
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _consume_error(server, "reader", topic, _name("g-")) is None
    # The writer may not read, nor use any group: the group is refused first.
    assert _consume_error(server, "writer", topic, _name("g-")) == (
        KafkaError.GROUP_AUTHORIZATION_FAILED
    )


def test_reading_a_topic_outside_the_rules(server: LiveServer) -> None:
    topic = _name("secret-")
    assert _produce(server, "guest", topic) is None  # no rules: the whole namespace
    assert _consume_error(server, "reader", topic, _name("g-")) == (
        KafkaError.TOPIC_AUTHORIZATION_FAILED
    )
    admin = AdminClient(_sasl(server, "reader"))
    listed = admin.list_topics(timeout=_TIMEOUT_S).topics
    assert topic not in listed  # not describable: not listed
    asked = admin.list_topics(topic, timeout=_TIMEOUT_S).topics[topic]
    assert asked.error is not None
    assert asked.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_transactional_ids(server: LiveServer) -> None:
    allowed = Producer({**_sasl(server, "writer"), "transactional.id": _name("tx-ok-")})
    allowed.init_transactions(_TIMEOUT_S)
    refused = Producer({**_sasl(server, "writer"), "transactional.id": _name("tx-no-")})
    with pytest.raises(KafkaException) as caught:
        refused.init_transactions(_TIMEOUT_S)
    assert caught.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED


def _wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_acls_created_described_and_deleted_through_the_admin_client(server: LiveServer) -> None:
    topic = _name("locked-")
    assert _produce(server, "guest", topic) is None
    admin = AdminClient(_sasl(server, "ops"))
    binding = AclBinding(
        ResourceType.TOPIC,
        "locked-",
        ResourcePatternType.PREFIXED,
        "User:guest",
        "*",
        AclOperation.WRITE,
        AclPermissionType.DENY,
    )
    for future in admin.create_acls([binding]).values():
        future.result(_TIMEOUT_S)
    error = _produce(server, "guest", topic)
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED

    everything = AclBindingFilter(
        ResourceType.ANY,
        _ANY_NAME,
        ResourcePatternType.ANY,
        _ANY_NAME,
        _ANY_NAME,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    described = admin.describe_acls(everything).result(_TIMEOUT_S)
    assert binding in described
    # The configuration's rules are there too (read-only).
    assert any(b.principal == "User:reader" and b.name == "data-" for b in described)

    guest_only = AclBindingFilter(
        ResourceType.TOPIC,
        _ANY_NAME,
        ResourcePatternType.ANY,
        "User:guest",
        _ANY_NAME,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    deleted = [b for f in admin.delete_acls([guest_only]).values() for b in f.result(_TIMEOUT_S)]
    assert deleted == [binding]
    _wait_for(lambda: _produce(server, "guest", topic) is None, "the deny rule still applies")


def test_acl_apis_need_an_admin(server: LiveServer) -> None:
    admin = AdminClient(_sasl(server, "guest"))
    binding = AclBinding(
        ResourceType.TOPIC,
        "x",
        ResourcePatternType.LITERAL,
        "User:guest",
        "*",
        AclOperation.ALL,
        AclPermissionType.ALLOW,
    )
    with pytest.raises(KafkaException) as caught:
        for future in admin.create_acls([binding]).values():
            future.result(_TIMEOUT_S)
    assert caught.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED


def test_another_namespace_is_invisible(server: LiveServer) -> None:
    topic = _name("data-")
    group = _name("g-")
    assert _produce(server, "writer", topic) is None
    assert _consume_error(server, "reader", topic, group) is None
    outsider = AdminClient(_sasl(server, "outsider"))
    assert topic not in outsider.list_topics(timeout=_TIMEOUT_S).topics
    groups = outsider.list_consumer_groups().result(_TIMEOUT_S)
    assert group not in {g.group_id for g in groups.valid}
    described = outsider.describe_consumer_groups([group])[group].result(_TIMEOUT_S)
    assert not described.members


def test_share_group_needs_group_read(server: LiveServer) -> None:
    """The viewer finds the coordinator (describe) but may not join (read)."""
    topic = _name("data-")
    assert _produce(server, "writer", topic) is None
    errors: list[int] = []
    consumer = ShareConsumer({**_sasl(server, "viewer"), "group.id": _name("s-")})
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        while not errors:
            assert time.monotonic() < deadline, "no error for a share group it may not read"
            for message in consumer.poll(0.3) or []:
                error = message.error()
                if error is not None:
                    errors.append(int(error.code()))
    except KafkaException as e:
        errors.append(int(e.args[0].code()))
    finally:
        consumer.close()
    assert errors[0] == KafkaError.GROUP_AUTHORIZATION_FAILED
