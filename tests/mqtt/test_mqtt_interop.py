"""The storage mapping: an MQTT topic lives in the storage topic named by its first
level with the full name as a property, and messages other protocols store there
(a Kafka record, say) reach MQTT subscribers under the storage topic's name."""

from __future__ import annotations

from pathlib import Path

from protocols import interop
from storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef, TopicConfig
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
