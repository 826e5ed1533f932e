"""The storage mapping: an MQTT topic lives in the storage topic named by its first
level with the full name as a property, and messages other protocols store there
(a Kafka record, say) reach MQTT subscribers under the storage topic's name."""

from __future__ import annotations

from pathlib import Path

from polymq.gateway.accounts import Principal
from polymq.gateway.processor import Caller
from polymq.protocols import interop
from polymq.storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef, TopicConfig
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, mqtt_server


def test_mqtt_publish_is_stored_under_the_first_level(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        pub = Paho(server.port("mqtt"), v5=True).connect()
        pub.publish("sensors/a/temp", b"21", qos=1)
        storage = server.gateway.storage
        queue = QueueRef(DEFAULT_NAMESPACE, "sensors", 0)
        read = server.call(lambda: storage.read(queue, 0, max_messages=10))
        [stored] = read.messages
        assert stored.message.body == b"21"
        assert stored.message.property(interop.MQTT_TOPIC) == b"sensors/a/temp"
        assert stored.message.producer == pub.client_id


def test_foreign_messages_reach_mqtt_subscribers(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        storage = server.gateway.storage
        server.call(
            lambda: storage.create_topic(DEFAULT_NAMESPACE, "sensors", TopicConfig(queue_count=2))
        )
        exact = Paho(port, v5=True).connect()
        exact.subscribe("sensors", qos=1)
        wild = Paho(port).connect()
        wild.subscribe("sensors/#", qos=1)
        other = Paho(port).connect()
        other.subscribe("sensors/x", qos=1)
        offline = Paho(port, client_id="off", clean=False).connect()
        offline.subscribe("sensors/#", qos=1)
        offline.disconnect()
        record = Message(body=b"from kafka", key=b"k1", properties=(("h", b"v"),))
        for queue_id in (0, 1):
            request = AppendRequest(
                entry=record, queues=(QueueRef(DEFAULT_NAMESPACE, "sensors", queue_id),)
            )
            server.call(lambda r=request: storage.append([r]))  # type: ignore[misc]
        got = exact.wait_messages(2)
        assert [(m.topic, m.payload) for m in got] == [("sensors", b"from kafka")] * 2
        assert ("h", "v") in got[0].properties.UserProperty
        assert (interop.KEY, "k1") in got[0].properties.UserProperty
        assert len(wild.wait_messages(2)) == 2
        back = Paho(port, client_id="off", clean=False).connect()
        assert [m.topic for m in back.wait_messages(2)] == ["sensors", "sensors"]
        other.publish("sensors/x", b"mqtt", qos=1)
        assert [m.payload for m in other.wait_messages(1)] == [b"mqtt"]
        assert len(exact.messages) == 2  # the MQTT publish to sensors/x is not "sensors"


def test_foreign_messages_stored_while_down_reach_persistent_sessions(tmp_path: Path) -> None:
    queue = QueueRef(DEFAULT_NAMESPACE, "meters", 0)
    with mqtt_server(tmp_path) as server:
        storage = server.gateway.storage
        server.call(lambda: storage.create_topic(DEFAULT_NAMESPACE, "meters", TopicConfig()))
        port = server.port("mqtt")
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        keeper.subscribe("meters/#", qos=1)
        keeper.disconnect()
    with mqtt_server(tmp_path) as server:
        storage = server.gateway.storage
        record = AppendRequest(entry=Message(body=b"while away"), queues=(queue,))
        server.call(lambda: storage.append([record]))  # before any MQTT client is back
        port = server.port("mqtt")
        fresh = Paho(port).connect()
        fresh.subscribe("meters", qos=1)
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        assert [(m.topic, m.payload) for m in keeper.wait_messages(1)] == [
            ("meters", b"while away")
        ]
        live = AppendRequest(entry=Message(body=b"live"), queues=(queue,))
        server.call(lambda: storage.append([live]))
        assert [m.payload for m in fresh.wait_messages(1)] == [b"live"]  # not the old one


def _kafka_caller() -> Caller:
    principal = Principal(
        name="kafka-app", namespaces=frozenset({DEFAULT_NAMESPACE}), default_namespace="default"
    )
    return Caller(principal=principal, namespace=DEFAULT_NAMESPACE, protocol="kafka")


def _kafka_topic(server: LiveServer, topic: str) -> None:
    processor = server.gateway.processor
    server.call(lambda: processor.create_topic(_kafka_caller(), topic, TopicConfig()))


def _kafka_append(server: LiveServer, topic: str, body: bytes) -> None:
    """Store a record as another protocol does: through the processor."""
    processor = server.gateway.processor
    request = AppendRequest(
        entry=Message(body=body), queues=(QueueRef(DEFAULT_NAMESPACE, topic, 0),)
    )
    server.call(lambda: processor.append(_kafka_caller(), [request]))


def _mqtt_out(server: LiveServer) -> int:
    usage = server.gateway.metering.snapshot()
    return sum(u.messages_out for u in usage if u.protocol == "mqtt")


def test_the_tail_does_not_meter_what_it_reads(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        _kafka_topic(server, "meter")
        sub = Paho(port).connect()
        sub.subscribe("meter/#", qos=1)  # a tail on storage topic "meter"
        pub = Paho(port).connect()
        pub.publish("meter/mqtt", b"own", qos=1)  # read by the tail, skipped
        _kafka_append(server, "meter", b"foreign")
        got = sub.wait_messages(2)
        assert sorted(m.payload for m in got) == [b"foreign", b"own"]
        # the tail read both; only the two deliveries are messages out
        assert _mqtt_out(server) == 2


def test_copies_routed_into_session_queues_are_not_metered_as_mqtt_in(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        _kafka_topic(server, "billing")
        port = server.port("mqtt")
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        keeper.subscribe("billing", qos=1)  # its session queue gets a copy of each record
        _kafka_append(server, "billing", b"foreign")
        assert [m.payload for m in keeper.wait_messages(1)] == [b"foreign"]
        usage = server.gateway.metering.snapshot()
        messages_in = {u.protocol: u.messages_in for u in usage if u.messages_in}
        assert messages_in == {"kafka": 1}  # the producer's, not the copy's


def test_foreign_messages_reach_filters_starting_with_a_wildcard(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        _kafka_topic(server, "plant")
        everything = Paho(port).connect()
        everything.subscribe("#", qos=1)
        one_level = Paho(port, v5=True).connect()
        one_level.subscribe("+", qos=1)
        two_levels = Paho(port).connect()
        two_levels.subscribe("+/x", qos=1)
        pub = Paho(port).connect()
        pub.publish("plant/x", b"mqtt", qos=1)
        _kafka_append(server, "plant", b"old topic")
        # a storage topic created after the subscriptions is found too
        _kafka_topic(server, "fresh")
        _kafka_append(server, "fresh", b"new topic")
        got = everything.wait_messages(3)
        assert sorted((m.topic, m.payload) for m in got) == [
            ("fresh", b"new topic"),
            ("plant", b"old topic"),
            ("plant/x", b"mqtt"),
        ]
        got = one_level.wait_messages(2)
        assert sorted((m.topic, m.payload) for m in got) == [
            ("fresh", b"new topic"),
            ("plant", b"old topic"),
        ]
        # "+/x" matches the MQTT publish only: it came once, not again by the tail
        assert [m.payload for m in two_levels.wait_messages(1)] == [b"mqtt"]
        assert len(everything.messages) == 3
