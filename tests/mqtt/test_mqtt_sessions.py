"""Session lifecycle details: unsubscribe, session expiry, DISCONNECT with will,
receive maximum, $SYS topics, server shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.broker import MqttBroker
from polymq.storage.model import DEFAULT_NAMESPACE, TopicConfig
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, RawClient, mqtt_server, wait_until


def test_unsubscribe(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        raw = RawClient(port)
        raw.connect("unsub")
        raw.send(
            codec.Subscribe(
                packet_id=1,
                subscriptions=[codec.Subscription(filter="u/a"), codec.Subscription(filter="u/b")],
            )
        )
        assert raw.receive() == codec.SubAck(packet_id=1, reasons=[0, 0])
        raw.send(codec.Unsubscribe(packet_id=2, filters=["u/a", "u/none"]))
        assert raw.receive() == codec.UnsubAck(packet_id=2, reasons=[0x00, 0x11])
        pub = Paho(port).connect()
        pub.publish("u/a", b"a", qos=1)
        pub.publish("u/b", b"b", qos=1)
        packet = raw.receive()
        assert isinstance(packet, codec.Publish) and packet.topic == "u/b"
        raw.close()


def test_session_expiry_removes_the_session(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        short = Paho(port, v5=True, client_id="short", session_expiry=1).connect()
        short.subscribe("exp/#", qos=1)
        short.disconnect()
        pub = Paho(port, v5=True).connect()
        pub.publish("exp/1", b"lost", qos=1)
        storage = server.gateway.storage

        def session_gone() -> bool:
            saved = server.call(lambda: storage.meta_get("default", "mqtt.session", "short"))
            return saved is None

        wait_until(session_gone, what="the session to expire")  # after 1 s
        again = Paho(port, v5=True, client_id="short", session_expiry=60)
        again.connect(clean_start=False)
        assert again.connack == (False, 0)
        pub.publish("exp/2", b"x", qos=1)
        again.subscribe("exp/sync", qos=1)
        pub.publish("exp/sync", b"sync", qos=1)
        assert [m.payload for m in again.wait_messages(1)] == [b"sync"]


def test_disconnect_with_will_message_reason_sends_the_will(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port, v5=True).connect()
        watcher.subscribe("dw/#", qos=1)
        raw = RawClient(port)
        raw.connect("dw", will_topic="dw/will", will_payload=b"w", will_qos=1)
        raw.send(codec.Disconnect(reason=0x04))
        assert raw.closed() == []
        assert watcher.wait_messages(1)[0].topic == "dw/will"


def test_receive_maximum_exceeded(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, {"mqtt.receive_maximum": "2"}) as server:
        raw = RawClient(server.port("mqtt"))
        raw.connect("greedy")
        for pid in (1, 2, 3):  # QoS 2, never released: three unacknowledged
            raw.send(codec.Publish(topic="rm", payload=b"x", qos=2, packet_id=pid))
        packets = raw.closed()
        assert packets[-1] == codec.Disconnect(
            reason=0x93, properties={codec.REASON_STRING: "receive maximum exceeded"}
        )


def test_sys_topics(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        client = Paho(port).connect()
        client.subscribe("$SYS/broker/clients/connected")
        got = client.wait_messages(1)
        assert got[0].payload == b"1" and got[0].retain
        everything = Paho(port).connect()
        everything.subscribe("#")
        client.subscribe("$SYS/broker/+")
        got = client.wait_messages(3)
        assert {m.topic for m in got[1:]} == {"$SYS/broker/version", "$SYS/broker/uptime"}
        assert everything.messages == []


def test_server_shutdown_sends_disconnect(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        raw = RawClient(server.port("mqtt"))
        raw.connect("bye")
    assert raw.closed() == [
        codec.Disconnect(reason=0x8B, properties={codec.REASON_STRING: "server shutting down"})
    ]


def test_clients_cannot_publish_to_sys(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port).connect()
        watcher.subscribe("$SYS/fake")
        raw = RawClient(port)
        raw.connect("faker")
        raw.send(codec.Publish(topic="$SYS/fake", payload=b"x", qos=1, packet_id=5))
        ack = raw.receive()
        assert isinstance(ack, codec.PubAck) and ack.reason == 0x87
        assert ack.properties[codec.REASON_STRING]
        raw.send(codec.Publish(topic="$SYS/fake", payload=b"x", qos=1, packet_id=6))
        raw.send(codec.Disconnect())
        assert [type(p) for p in raw.closed()] == [codec.PubAck]
        watcher.subscribe("sync/#", qos=1)
        watcher.publish("sync/x", b"", qos=1)
        assert [m.topic for m in watcher.wait_messages(1)] == ["sync/x"]


def test_qos2_flows_survive_a_clean_restart(tmp_path: Path) -> None:
    def connect(port: int) -> RawClient:
        raw = RawClient(port)
        ack = raw.connect("q2keep", clean_start=False, properties={codec.SESSION_EXPIRY: 600})
        assert ack.reason == 0
        return raw

    with mqtt_server(tmp_path) as server:
        raw = connect(server.port("mqtt"))
        raw.subscribe("q2/#", qos=2)
        raw.send(codec.Publish(topic="q2/in", payload=b"once", qos=2, packet_id=7))
        assert raw.receive() == codec.PubRec(packet_id=7)
        out = raw.receive()  # our own publish comes back to us, QoS 2
        assert isinstance(out, codec.Publish) and out.payload == b"once"
        raw.send(codec.PubRec(packet_id=out.packet_id))
        assert raw.receive() == codec.PubRel(packet_id=out.packet_id)
        raw.close()  # PUBREL to the server and PUBCOMP to us both outstanding
    with mqtt_server(tmp_path) as server:
        raw = connect(server.port("mqtt"))
        assert raw.receive() == codec.PubRel(packet_id=out.packet_id)  # resumed
        raw.send(codec.Publish(topic="q2/in", payload=b"once", qos=2, packet_id=7, dup=True))
        assert raw.receive() == codec.PubRec(packet_id=7)  # known: not stored again
        raw.send(codec.PubRel(packet_id=7))
        assert raw.receive() == codec.PubComp(packet_id=7)
        raw.send(codec.PubComp(packet_id=out.packet_id))
        raw.send(codec.Publish(topic="q2/sync", payload=b"sync", qos=1, packet_id=8))
        packets = [raw.receive(), raw.receive()]
        publishes = [p for p in packets if isinstance(p, codec.Publish)]
        assert [p.payload for p in publishes] == [b"sync"]
        raw.close()


def test_empty_client_id(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        ack = RawClient(port).connect("")
        assigned = ack.properties[codec.ASSIGNED_CLIENT_ID]
        assert assigned and ack.reason == 0
        assert ack.properties[codec.SHARED_SUB_AVAILABLE] == 1
        assert RawClient(port, level=4).connect("").reason == 0  # v3 clean: accepted
        refused = RawClient(port, level=4)
        assert refused.connect("", clean_start=False).reason == 0x02  # v3 3.1.3-8
        assert refused.closed() == []


def test_traffic_is_metered(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port).connect()
        sub.subscribe("m/#", qos=1)
        pub = Paho(port).connect()
        for i in range(3):
            pub.publish(f"m/{i}", b"12345", qos=1)
        sub.wait_messages(3)
        [usage] = [
            u
            for u in server.gateway.metering.snapshot()
            if u.protocol == "mqtt" and u.namespace == "default"
        ]
        assert (usage.messages_in, usage.bytes_in) == (3, 15)
        assert usage.messages_out >= 3 and usage.bytes_out >= 15
        assert usage.connections == 2


def test_packets_pipelined_behind_connect(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port).connect()
        watcher.subscribe("pipe/#", qos=1)
        raw = RawClient(port, level=4)
        connect = codec.Connect(level=4, client_id="piper")
        publish = codec.Publish(topic="pipe/x", payload=b"early", qos=1, packet_id=3)
        raw.send(
            codec.encode(connect, 4) + codec.encode(publish, 4) + codec.encode(codec.PingReq(), 4)
        )
        assert [raw.receive(), raw.receive(), raw.receive()] == [
            codec.ConnAck(),
            codec.PubAck(packet_id=3),
            codec.PingResp(),
        ]
        assert [m.payload for m in watcher.wait_messages(1)] == [b"early"]


def _shared_queues(server: LiveServer) -> set[str]:
    storage = server.gateway.storage
    topics = server.call(lambda: storage.list_topics(DEFAULT_NAMESPACE, include_internal=True))
    return {t.name for t in topics if t.name.startswith("$mqtt.share.")}


def test_shared_queue_is_deleted_when_its_last_member_leaves(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        first = Paho(port).connect()
        second = Paho(port).connect()
        first.subscribe("$share/g/jobs", qos=1)
        second.subscribe("$share/g/jobs", qos=1)
        assert _shared_queues(server) == {"$mqtt.share.g/jobs"}
        first.client.unsubscribe("$share/g/jobs")
        second.disconnect()  # a clean session ends: the last member is gone
        wait_until(lambda: not _shared_queues(server), what="the queue deleted")
        # an offline persistent member keeps the group: messages wait for it
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        keeper.subscribe("$share/p/jobs", qos=1)
        keeper.disconnect()
        first.publish("jobs", b"waits", qos=1)
        assert _shared_queues(server) == {"$mqtt.share.p/jobs"}
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        assert [m.payload for m in keeper.wait_messages(1)] == [b"waits"]
        keeper.disconnect()
        Paho(port, client_id="keeper", clean=True).connect().disconnect()  # session ends
        wait_until(lambda: not _shared_queues(server), what="the queue deleted")
        # a new member after that gets a new, working queue
        fresh = Paho(port).connect()
        fresh.subscribe("$share/g/jobs", qos=1)
        first.publish("jobs", b"again", qos=1)
        assert [m.payload for m in fresh.wait_messages(1)] == [b"again"]


def test_unused_shared_queues_are_deleted_on_load(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        keeper.subscribe("$share/kept/jobs", qos=1)
        keeper.disconnect()
        storage = server.gateway.storage
        # left behind by a crash between a group's end and its queue's deletion
        server.call(
            lambda: storage.create_topic(DEFAULT_NAMESPACE, "$mqtt.share.gone/x", TopicConfig())
        )
        assert _shared_queues(server) == {"$mqtt.share.kept/jobs", "$mqtt.share.gone/x"}
    with mqtt_server(tmp_path) as server:
        Paho(server.port("mqtt")).connect()  # loads the namespace's broker
        assert _shared_queues(server) == {"$mqtt.share.kept/jobs"}


def test_session_and_shared_queues_are_internal_topics(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        keeper = Paho(port, client_id="keeper", clean=False).connect()
        keeper.subscribe("$share/g/jobs", qos=1)
        keeper.publish("jobs", b"x", qos=1)
        storage = server.gateway.storage

        def names(include_internal: bool) -> set[str]:
            topics = server.call(
                lambda: storage.list_topics(DEFAULT_NAMESPACE, include_internal=include_internal)
            )
            return {t.name for t in topics}

        queues = {"$mqtt.share.g/jobs", *(n for n in names(True) if n.startswith("$mqtt.session."))}
        assert len(queues) == 2  # the shared group's queue and keeper's session queue
        assert names(True) >= queues | {"jobs"}
        assert "jobs" in names(False) and not names(False) & queues


def test_closing_a_broker_cancels_and_awaits_its_background_tasks(tmp_path: Path) -> None:
    """What a broker runs in the background (an expiry, a delayed will, following the
    other gateways) does not outlive its close: the listener's stop ends all of it."""
    with mqtt_server(tmp_path) as server:

        async def check() -> None:
            broker = await MqttBroker.load(server.gateway.processor, DEFAULT_NAMESPACE)
            started = asyncio.Event()

            async def forever() -> None:
                started.set()
                await asyncio.Event().wait()

            task = broker.spawn(forever())
            await started.wait()
            await broker.close()
            assert task.cancelled()
            assert len(broker.core.tasks) == 0

        server.call(check)
