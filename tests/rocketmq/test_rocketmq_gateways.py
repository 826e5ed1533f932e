"""RocketMQ over several gateways: routes and assignments name the live gateways from
the directory (spread by queue, the same answer from each), clients follow them, and
storage out of reach answers a status the clients retry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rocketmq.grpc_protocol import definition_pb2, service_pb2

from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.rocketmq.status import Code
from polymq.storage.model import TopicConfig
from tests.kafka.gateways import Gateways, gateways
from tests.rocketmq.conftest import (
    create_topic,
    factory,
    message,
    producer,
    raw_message,
    raw_stub,
    receive_all,
    signed,
    simple_consumer,
    unique,
)

# Its gateways share one engine (tests/kafka/gateways.py), whatever the form.
ONE_FORM = True

IDS = ("rmq-a", "rmq-b")
QUEUES = 8


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    data_dir: Path = tmp_path_factory.mktemp("rocketmq-gateways")
    with gateways(data_dir, IDS, {"rocketmq": factory()}) as live:
        yield live


def _endpoints(two: Gateways) -> list[GatewayEndpoint]:
    return [
        GatewayEndpoint(gateway_id=g, host="127.0.0.1", port=two.address(g, "rocketmq")[1])
        for g in IDS
    ]


def _owner(two: Gateways, key: str) -> GatewayEndpoint:
    owner = owner_of(key, _endpoints(two))
    assert owner is not None
    return owner


def _owner_port(two: Gateways, key: str) -> int:
    return _owner(two, key).port


def test_routes_spread_queues_over_the_gateways(two: Gateways) -> None:
    topic, group = unique("t"), unique("g")
    create_topic(two.server(IDS[0]), topic, TopicConfig(queue_count=QUEUES))
    resource = definition_pb2.Resource
    for asked in IDS:
        with raw_stub(two.server(asked)) as stub:
            route = stub.QueryRoute(
                service_pb2.QueryRouteRequest(topic=resource(name=topic)), metadata=signed()
            )
            assignment = stub.QueryAssignment(
                service_pb2.QueryAssignmentRequest(
                    topic=resource(name=topic), group=resource(name=group)
                ),
                metadata=signed(),
            )
        assert route.status.code == Code.OK
        ports = {q.id: q.broker.endpoints.addresses[0].port for q in route.message_queues}
        assert ports == {q: _owner_port(two, f"{topic}/{q}") for q in range(QUEUES)}
        names = {q.id: q.broker.name for q in route.message_queues}
        assert names == {q: _owner(two, f"{topic}/{q}").gateway_id for q in range(QUEUES)}
        [assigned] = assignment.assignments
        endpoints = assigned.message_queue.broker.endpoints
        assert endpoints.addresses[0].port == _owner_port(two, f"{group}/{topic}")


def test_a_producer_and_a_consumer_on_different_gateways(two: Gateways) -> None:
    topic, group = unique("t"), unique("g")
    create_topic(two.server(IDS[0]), topic, TopicConfig(queue_count=QUEUES))
    bodies = [b"m%d" % i for i in range(20)]
    with producer(two.server(IDS[0]), topic) as p:
        for body in bodies:
            p.send(message(topic, body))
    with simple_consumer(two.server(IDS[1]), group, topic) as consumer:
        got = receive_all(consumer, len(bodies))
        for m in got:
            consumer.ack(m)
    assert sorted(m.body for m in got) == sorted(bodies)


def test_storage_out_of_reach_is_a_status_clients_retry(two: Gateways) -> None:
    topic = unique("t")
    server = two.server(IDS[0])
    create_topic(server, topic, TopicConfig(queue_count=1))
    two.storage[IDS[0]].down = True
    try:
        with raw_stub(server) as stub:
            answer = stub.SendMessage(
                service_pb2.SendMessageRequest(messages=[raw_message(topic)]), metadata=signed()
            )
    finally:
        two.storage[IDS[0]].down = False
    assert answer.status.code == Code.HA_NOT_AVAILABLE
