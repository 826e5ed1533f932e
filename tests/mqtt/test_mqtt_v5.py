"""MQTT 5 features with paho-mqtt (MQTTv5): properties, expiry, aliases, options of
subscriptions, shared subscriptions, reason codes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from polymq.protocols.mqtt import codec
from tests.mqtt.helpers import Paho, RawClient, mqtt_server, paho_properties, wait_until


def _props(**values: Any) -> Any:
    return paho_properties("PUBLISH", **values)


def test_properties_travel_end_to_end(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=True).connect()
        sub.subscribe("rpc/#", qos=1)
        pub = Paho(port, v5=True).connect()
        props = _props(
            ContentType="application/json",
            ResponseTopic="rpc/reply",
            CorrelationData=b"\x01\x02",
            PayloadFormatIndicator=1,
            MessageExpiryInterval=600,
        )
        for pair in (("b", "1"), ("a", "2"), ("b", "3")):
            props.UserProperty = pair
        pub.publish("rpc/call", b"{}", qos=1, properties=props)
        got = sub.wait_messages(1)[0].properties
        assert got.ContentType == "application/json"
        assert got.ResponseTopic == "rpc/reply"
        assert got.CorrelationData == b"\x01\x02"
        assert got.PayloadFormatIndicator == 1
        assert 590 <= got.MessageExpiryInterval <= 600
        assert got.UserProperty == [("b", "1"), ("a", "2"), ("b", "3")]


def test_expired_messages_are_not_delivered(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=True, client_id="exp", session_expiry=600).connect()
        sub.subscribe("e/#", qos=1)
        sub.disconnect()
        pub = Paho(port, v5=True).connect()
        pub.publish("e/short", b"gone", qos=1, properties=_props(MessageExpiryInterval=1))
        pub.publish("e/long", b"kept", qos=1, properties=_props(MessageExpiryInterval=100))
        time.sleep(2.2)  # let the first one expire while the session is offline
        sub = Paho(port, v5=True, client_id="exp", session_expiry=600).connect(clean_start=False)
        got = sub.wait_messages(1)
        pub.publish("e/sync", b"sync", qos=1)
        sub.wait_messages(2)
        assert [m.payload for m in sub.messages] == [b"kept", b"sync"]
        assert sub.messages[0].properties.MessageExpiryInterval <= 98
        assert got


def test_no_local_retain_as_published_and_subscription_ids(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        me = Paho(port, v5=True).connect()
        props = paho_properties("SUBSCRIBE", SubscriptionIdentifier=7)
        me.subscribe("chat/#", qos=1, noLocal=True, properties=props)
        props = paho_properties("SUBSCRIBE", SubscriptionIdentifier=9)
        me.subscribe("chat/+", qos=1, retainAsPublished=True, properties=props)
        other = Paho(port, v5=True).connect()
        me.publish("chat/mine", b"mine", qos=1)
        other.publish("chat/theirs", b"theirs", qos=1, retain=True)
        me.wait_messages(2)
        by_payload = {m.payload: m for m in me.messages}
        # "mine" only through the subscription without no-local
        assert by_payload[b"mine"].properties.SubscriptionIdentifier == [9]
        assert sorted(by_payload[b"theirs"].properties.SubscriptionIdentifier) == [7, 9]
        assert by_payload[b"theirs"].retain is True  # retain as published
        other.publish("chat/theirs", b"", qos=1, retain=True)


def test_retain_handling(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        pub = Paho(port, v5=True).connect()
        pub.publish("rh/x", b"r", qos=1, retain=True)
        never = Paho(port, v5=True).connect()
        never.subscribe("rh/#", qos=1, retainHandling=2)
        once = Paho(port, v5=True).connect()
        once.subscribe("rh/#", qos=1, retainHandling=1)
        once.subscribe("rh/#", qos=1, retainHandling=1)  # not new: no retained again
        always = Paho(port, v5=True).connect()
        always.subscribe("rh/#", qos=1, retainHandling=0)
        always.subscribe("rh/#", qos=1, retainHandling=0)
        pub.publish("rh/sync", b"sync", qos=1)
        for client, expected in ((never, 1), (once, 2), (always, 3)):
            client.wait(lambda c=client: _has(c, b"sync"), "sync")  # type: ignore[misc]
            assert len(client.messages) == expected, client.messages


def test_topic_aliases_both_ways(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        raw = RawClient(port)
        ack = raw.connect("alias", properties={codec.TOPIC_ALIAS_MAXIMUM: 5})
        assert ack.properties[codec.TOPIC_ALIAS_MAXIMUM] > 0
        raw.subscribe("al/#", qos=1)
        # inbound: set alias 3, then use it alone
        raw.send(
            codec.Publish(
                topic="al/one", payload=b"1", qos=1, packet_id=2, properties={codec.TOPIC_ALIAS: 3}
            )
        )
        raw.send(
            codec.Publish(
                topic="", payload=b"2", qos=1, packet_id=3, properties={codec.TOPIC_ALIAS: 3}
            )
        )
        seen: list[codec.Publish] = []
        while len(seen) < 2:
            packet = raw.receive()
            assert packet is not None
            if isinstance(packet, codec.Publish):
                seen.append(packet)
                raw.send(codec.PubAck(packet_id=packet.packet_id))
        # outbound: the first carries topic and alias, the second the alias only
        assert seen[0].topic == "al/one" and seen[0].properties[codec.TOPIC_ALIAS] == 1
        assert seen[1].topic == "" and seen[1].properties[codec.TOPIC_ALIAS] == 1
        assert [p.payload for p in seen] == [b"1", b"2"]
        raw.close()


def test_shared_subscription_balances_and_hands_over(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        a = Paho(port, v5=True).connect()
        b = Paho(port, v5=True).connect()
        a.subscribe("$share/workers/tasks/#", qos=1)
        b.subscribe("$share/workers/tasks/#", qos=1)
        pub = Paho(port, v5=True).connect()
        # Members take a few at a time as they come: enough tasks that one member
        # slow to wake (a loaded machine) still gets work (with 40, one member once
        # took them all in a clean run, 4 at a time, before the other woke).
        tasks = 200
        for i in range(tasks):
            pub.publish(f"tasks/{i}", str(i).encode(), qos=1)
        wait_until(lambda: len(a.messages) + len(b.messages) >= tasks, what=f"{tasks} tasks")
        payloads = sorted(int(m.payload) for m in a.messages + b.messages)
        assert payloads == list(range(tasks))
        assert a.messages and b.messages  # both members got work


def test_shared_message_in_flight_goes_to_another_member(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        # a raw member that receives but never acks, then vanishes
        raw = RawClient(port)
        raw.connect("lazy")
        raw.subscribe("$share/g/jobs", qos=1)
        pub = Paho(port, v5=True).connect()
        pub.publish("jobs", b"important", qos=1)
        packet = raw.receive()
        assert isinstance(packet, codec.Publish) and packet.payload == b"important"
        good = Paho(port, v5=True).connect()
        good.subscribe("$share/g/jobs", qos=1)
        raw.close()  # unacked: must reach the other member
        got = good.wait_messages(1)
        assert got[0].payload == b"important"
        assert got[0].dup is True


def test_inbound_qos2_resend_is_stored_once(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=True).connect()
        sub.subscribe("once", qos=2)
        raw = RawClient(port)
        raw.connect("q2")
        publish = codec.Publish(topic="once", payload=b"x", qos=2, packet_id=10)
        raw.send(publish)
        assert isinstance(raw.receive(), codec.PubRec)
        publish.dup = True
        raw.send(publish)  # the resend before PUBREL
        assert isinstance(raw.receive(), codec.PubRec)
        raw.send(codec.PubRel(packet_id=10))
        assert isinstance(raw.receive(), codec.PubComp)
        raw.send(codec.Publish(topic="once", payload=b"next", qos=2, packet_id=10))
        assert isinstance(raw.receive(), codec.PubRec)
        raw.send(codec.PubRel(packet_id=10))
        assert isinstance(raw.receive(), codec.PubComp)
        # Messages from one client on one topic and at one QoS keep their order (§4.6
        # orders per topic and QoS, so the barrier is QoS 2 too): a duplicate of "x"
        # would arrive before it.
        raw.send(codec.Publish(topic="once", payload=b"barrier", qos=2, packet_id=11))
        assert isinstance(raw.receive(), codec.PubRec)
        raw.send(codec.PubRel(packet_id=11))
        assert isinstance(raw.receive(), codec.PubComp)
        sub.wait_messages(3)
        assert [m.payload for m in sub.messages] == [b"x", b"next", b"barrier"]


def test_unacked_messages_come_back_with_dup_and_window_is_bounded(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, {"mqtt.receive_maximum": "4"}) as server:
        port = server.port("mqtt")
        raw = RawClient(port)
        ack = raw.connect("window", clean_start=False, properties={codec.SESSION_EXPIRY: 600})
        assert ack.properties[codec.RECEIVE_MAXIMUM] == 4
        raw.subscribe("w", qos=1)
        pub = Paho(port, v5=True).connect()
        for i in range(10):
            pub.publish("w", str(i).encode(), qos=1)
        first = [raw.receive() for _ in range(4)]
        assert [p.payload for p in first if isinstance(p, codec.Publish)] == [
            b"0",
            b"1",
            b"2",
            b"3",
        ]
        raw.sock.settimeout(0.5)
        try:
            extra = raw.sock.recv(100)  # the window is full: nothing more comes
        except TimeoutError:
            extra = b""
        assert extra == b""
        raw.close()
        raw = RawClient(port)
        raw.connect("window", clean_start=False, properties={codec.SESSION_EXPIRY: 600})
        got: list[codec.Publish] = []
        while len(got) < 10:
            packet = raw.receive()
            assert isinstance(packet, codec.Publish), packet
            got.append(packet)
            raw.send(codec.PubAck(packet_id=packet.packet_id))
        assert sorted(int(p.payload) for p in got) == list(range(10))
        assert all(p.dup for p in got if int(p.payload) < 4)
        assert not any(p.dup for p in got if int(p.payload) >= 4)
        raw.close()


def _has(client: Paho, payload: bytes) -> bool:
    return any(m.payload == payload for m in client.messages)


def test_clean_session_window_holds_the_rest_until_acks(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, {"mqtt.receive_maximum": "3"}) as server:
        port = server.port("mqtt")
        raw = RawClient(port)
        raw.connect("clean-window")
        raw.subscribe("cw", qos=1)
        pub = Paho(port, v5=True).connect()
        for i in range(8):
            pub.publish("cw", str(i).encode(), qos=1)
        held = [raw.receive() for _ in range(3)]
        raw.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            raw.sock.recv(100)  # the window is full
        raw.sock.settimeout(30)
        got = []
        for packet in held:
            assert isinstance(packet, codec.Publish)
            got.append(packet)
            raw.send(codec.PubAck(packet_id=packet.packet_id))
        while len(got) < 8:
            packet = raw.receive()
            assert isinstance(packet, codec.Publish)
            got.append(packet)
            raw.send(codec.PubAck(packet_id=packet.packet_id))
        assert [p.payload for p in got] == [str(i).encode() for i in range(8)]
        raw.close()
