"""AMQP queues listed as queues, and the members of AMQP and MQTT groups, in the admin
API and ``polymq admin``, against a live gateway in ``accounts`` mode (both forms),
compared with what pika and paho did: queues declared, bound, published to and
consumed without ack; a persistent MQTT session's shared subscription; a RocketMQ
SimpleConsumer of a group; a KIP-848 Kafka consumer (librdkafka)."""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from confluent_kafka import Consumer
from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer

from polymq.gateway.admin_cli import run
from tests.admin.test_admin_cli import ACCOUNTS, NS, PASSWORD, admin, refused, url, wait_for
from tests.live_server import LiveServer, live_server, server_config
from tests.mqtt.helpers import Paho

LISTENERS = ("http", "kafka", "amqp", "mqtt", "rocketmq")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("admin-queues")
    config = dataclasses.replace(server_config(data, LISTENERS), auth=ACCOUNTS)
    with live_server(data, LISTENERS, config=config) as s:
        yield s


def amqp(server: LiveServer) -> pika.BlockingConnection:
    host, port = server.address("amqp")
    credentials = pika.PlainCredentials("guest", PASSWORD)
    return pika.BlockingConnection(
        pika.ConnectionParameters(host, port, NS, credentials, connection_attempts=1)
    )


def listed(server: LiveServer, name: str) -> dict[str, Any]:
    queues: list[dict[str, Any]] = admin(server, "queues", "list", "-n", NS)["queues"]
    [found] = [q for q in queues if q["name"] == name]
    return found


def test_amqp_queues_with_counts_consumers_and_bindings(server: LiveServer) -> None:
    connection = amqp(server)
    channel = connection.channel()
    channel.queue_declare("work", durable=True)
    channel.queue_bind("work", "amq.direct", routing_key="k1")
    channel.queue_bind("work", "amq.topic", routing_key="orders.#")
    temp = channel.queue_declare("", exclusive=True).method.queue
    channel.confirm_delivery()
    for i in range(3):
        channel.basic_publish("", "work", f"m{i}".encode())
    channel.basic_qos(prefetch_count=2)
    held: list[int] = []
    channel.basic_consume(
        "work", lambda ch, method, props, body: held.append(method.delivery_tag), consumer_tag="c1"
    )
    deadline = time.monotonic() + 30
    while len(held) < 2:
        assert time.monotonic() < deadline, f"pika got {len(held)} of 2 deliveries"
        connection.process_data_events(time_limit=0.5)
    peer = "{}:{}".format(*connection._impl._transport._sock.getsockname())
    try:
        # Two delivered and not acknowledged, one ready, one consumer: as pika saw it.
        wait_for(lambda: listed(server, "work")["messages_unacked"] == 2)
        work = listed(server, "work")
        assert (work["kind"], work["messages_ready"], work["consumer_count"]) == ("amqp", 1, 1)
        assert (work["durable"], work["exclusive"], work["auto_delete"]) == (True, False, False)
        assert [c["consumer_tag"] for c in work["consumers"]] == ["c1"]
        assert {(b["exchange"], b["routing_key"]) for b in work["bindings"]} == {
            ("amq.direct", "k1"),
            ("amq.topic", "orders.#"),
        }
        mine = listed(server, temp)
        assert (mine["exclusive"], mine["durable"], mine["messages_ready"]) == (True, False, 0)
        assert {q["kind"] for q in admin(server, "queues", "list", "--kind", "amqp")["queues"]} == {
            "amqp"
        }

        # The table people read: kind, counts, consumers, flags.
        out = io.StringIO()
        env = {"POLYMQ_ADMIN_USER": "ops", "POLYMQ_ADMIN_PASSWORD": PASSWORD}
        assert run(["--url", url(server), "queues", "list", "-n", NS], env, out) == 0
        header, *rows = out.getvalue().splitlines()
        assert header.split() == [
            "KIND", "NAMESPACE", "QUEUE", "READY", "UNACKED", "DELAYED", "CONSUMERS", "FLAGS",
        ]  # fmt: skip
        assert ["amqp", NS, "work", "1", "2", "1", "D"] in [r.split() for r in rows]

        # The group popping plain AMQP queues: its members are their consumers.
        group = admin(server, "groups", "describe", "amqp", "-n", NS)
        [row] = [q for q in group["pop_queues"] if q["queue"] == "work"]
        assert (row["ready"], row["unacked"], row["lag"], row["consumers"]) == (1, 2, 3, 1)
        [member] = [m for m in group["members"] if m["queue"] == "work"]
        [listed_group] = [
            g for g in admin(server, "groups", "list", "-n", NS)["groups"] if g["name"] == "amqp"
        ]
        assert (listed_group["lag"], [q["topic"] for q in listed_group["queues"]]) == (
            3,
            sorted(["work", temp]),
        )
        assert (member["protocol"], member["client_id"], member["client_host"]) == (
            "amqp",
            "c1",
            peer,
        )
        out = io.StringIO()
        assert run(["--url", url(server), "groups", "describe", "amqp", "-n", NS], env, out) == 0
        assert ["amqp", member["member_id"], "c1", peer, "work"] in [
            line.split() for line in out.getvalue().splitlines()
        ]
        # Acknowledged: the third is delivered in their place.
        for tag in held:
            channel.basic_ack(tag)
        wait_for(lambda: listed(server, "work")["messages_unacked"] == 1)
    finally:
        connection.close()
    # The exclusive queue went with its connection; the consumer too.
    wait_for(lambda: temp not in {q["name"] for q in admin(server, "queues", "list")["queues"]})
    assert listed(server, "work")["consumers"] == []


def test_mqtt_shared_subscription_members_and_lag(server: LiveServer) -> None:
    port = server.port("mqtt")
    member = Paho(
        port, v5=True, username="guest", password=PASSWORD, clean=False, session_expiry=600
    ).connect()
    assert member.subscribe("$share/workers/jobs/#", qos=1) == [1]

    def members() -> list[dict[str, Any]]:
        described = admin(server, "groups", "describe", "mqtt", "-n", NS)
        return [m for m in described["members"] if m["share_group"] == "workers"]

    wait_for(lambda: [m["client_id"] for m in members()] == [member.client_id])
    assert members()[0]["connected"] is True and members()[0]["filter"] == "jobs/#"
    member.disconnect()
    wait_for(lambda: members()[0]["connected"] is False)
    writer = Paho(port, v5=True, username="guest", password=PASSWORD).connect()
    try:
        for i in range(2):
            assert writer.publish(f"jobs/{i}", b"job", qos=1) == 0
    finally:
        writer.disconnect()

    def lag() -> int:
        described = admin(server, "groups", "describe", "mqtt", "-n", NS)
        [row] = [q for q in described["pop_queues"] if q["queue"] == "$share/workers/jobs/#"]
        return int(row["lag"])

    wait_for(lambda: lag() == 2)  # held for the member while it is away
    member.connect(clean_start=False)
    assert len(member.wait_messages(2)) == 2
    member.disconnect()


def test_rocketmq_consumer_group_members(server: LiveServer) -> None:
    """A RocketMQ SimpleConsumer is listed as its group's member, with its client id,
    while it runs, and no longer once it shut down."""
    admin(server, "topics", "create", "rmq-orders", "-n", NS)
    host, port = server.address("rocketmq")
    config = ClientConfiguration(f"{host}:{port}", Credentials("guest-ak", "guest-sk"), NS)
    consumer = SimpleConsumer(
        config, "rmq-group", {"rmq-orders": FilterExpression()}, await_duration=1
    )
    consumer.startup()

    def members() -> list[dict[str, Any]]:
        described = admin(server, "groups", "describe", "rmq-group", "-n", NS)
        return [m for m in described["members"] if m["protocol"] == "rocketmq"]

    try:
        wait_for(lambda: [m["client_id"] for m in members()] == [consumer.client_id])
        [member] = [c for c in admin(server, "connections", "list")["connections"]
                    if c["client_id"] == consumer.client_id]  # fmt: skip
        assert members()[0]["client_host"] == member["peer"]
    finally:
        consumer.shutdown()
    wait_for(lambda: refused(server, "groups", "describe", "rmq-group", "-n", NS) == 1
             or not members())  # fmt: skip


def test_kip848_kafka_group_members(server: LiveServer) -> None:
    """A librdkafka consumer with ``group.protocol=consumer`` (KIP-848) is listed as
    its group's member while it runs, and no longer once it left."""
    admin(server, "topics", "create", "k-orders", "-n", NS)
    host, port = server.address("kafka")
    consumer = Consumer(
        {
            "bootstrap.servers": f"{host}:{port}",
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.username": "guest",
            "sasl.password": PASSWORD,
            "group.id": "k-group",
            "group.protocol": "consumer",
            "client.id": "kip848-client",
        }
    )
    consumer.subscribe(["k-orders"])

    def members() -> list[dict[str, Any]]:
        described = admin(server, "groups", "describe", "k-group", "-n", NS)
        return [m for m in described["members"] if m["client_id"] == "kip848-client"]

    deadline = time.monotonic() + 30
    while not consumer.assignment():  # polled until the coordinator assigned
        assert time.monotonic() < deadline
        consumer.poll(0.2)
    try:
        [member] = members()
        assert member["protocol"] == "kafka"
    finally:
        consumer.close()
    wait_for(lambda: refused(server, "groups", "describe", "k-group", "-n", NS) == 1
             or not members())  # fmt: skip
