"""A burst of PUBLISHes read at once is checked, routed and stored as one batch
(topic checks and routes worked out once per topic, connection.py and routing.py):
every subscriber still gets exactly its own share, in order, with its own QoS,
retain flag, no-local and subscription ids."""

from __future__ import annotations

from pathlib import Path

from polymq.protocols.mqtt import codec
from tests.mqtt.helpers import Paho, RawClient, mqtt_server, paho_properties, wait_until


def test_one_burst_to_several_topics_reaches_each_subscriber_as_alone(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        publisher = RawClient(port, level=codec.LEVEL_5)
        publisher.connect("burst-pub")
        # The publisher's own subscription is no-local: none of the burst comes back.
        publisher.send(
            codec.Subscribe(
                packet_id=1,
                subscriptions=[codec.Subscription(filter="b/#", qos=1, no_local=True)],
            )
        )
        assert isinstance(publisher.receive(), codec.SubAck)
        everything = Paho(port, v5=True).connect()
        everything.subscribe("b/#", qos=1)
        only_x = Paho(port, v5=True).connect()
        props = paho_properties("SUBSCRIBE", SubscriptionIdentifier=42)
        only_x.subscribe("b/x", qos=0, properties=props)
        burst = b""
        expected = []
        for i in range(60):
            topic = ("b/x", "b/y", "c/z")[i % 3]
            qos = i % 2
            retain = i % 5 == 0
            burst += codec.encode(
                codec.Publish(
                    topic=topic,
                    payload=b"%d" % i,
                    qos=qos,
                    retain=retain,
                    packet_id=i + 1 if qos else 0,
                ),
                codec.LEVEL_5,
            )
            expected.append((topic, b"%d" % i, qos))
        publisher.send(burst)  # one write: read as one batch (30 QoS 1: within 32 in flight)
        acks: list[int] = []
        while len(acks) < 30:
            packet = publisher.receive()
            assert isinstance(packet, codec.PubAck), packet
            acks.append(packet.packet_id)
        assert acks == [i + 1 for i in range(60) if i % 2]
        to_b = [(t, p, q) for t, p, q in expected if t.startswith("b/")]
        got = everything.wait_messages(len(to_b))
        assert [(m.topic, m.payload, m.qos) for m in got] == to_b
        assert not any(m.retain for m in got)  # live, not retain-as-published
        to_x = [(t, p) for t, p, _ in expected if t == "b/x"]
        got_x = only_x.wait_messages(len(to_x))
        assert [(m.topic, m.payload, m.qos) for m in got_x] == [(t, p, 0) for t, p in to_x]
        assert all(m.properties.SubscriptionIdentifier == [42] for m in got_x)
        # What was retained: the last retained publish of each topic.
        late = Paho(port, v5=True).connect()
        late.subscribe("b/#", qos=1)
        wait_until(lambda: len(late.messages) >= 2, what="retained messages")
        retained = sorted((m.topic, m.payload) for m in late.messages)
        assert retained == [("b/x", b"45"), ("b/y", b"55")]
        publisher.send(codec.PingReq())
        assert isinstance(publisher.receive(), codec.PingResp)  # nothing of its own came
