"""Core flows with paho-mqtt, MQTT 3.1.1 and 5.0: connect, publish at every QoS both
ways, wildcards, retained messages, will, takeover, persistent sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mqtt.helpers import Paho, mqtt_server


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_publish_every_qos_both_ways(tmp_path: Path, v5: bool) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=v5).connect()
        pub = Paho(port, v5=v5).connect()
        assert sub.connack == (False, 0)
        assert sub.subscribe("sensors/+/temp", qos=2) == [2]
        for qos in (0, 1, 2):
            pub.publish("sensors/kitchen/temp", f"q{qos}".encode(), qos=qos)
        got = sub.wait_messages(3)
        assert sorted((m.payload, m.qos) for m in got) == [(b"q0", 0), (b"q1", 1), (b"q2", 2)]
        assert {m.topic for m in got} == {"sensors/kitchen/temp"}
        pub.publish("sensors/kitchen/humidity", b"no", qos=1)
        pub.publish("sensors/kitchen/temp", b"last", qos=1)
        got = sub.wait_messages(4)
        assert got[-1].payload == b"last"
        sub.disconnect()
        pub.disconnect()


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_qos_is_downgraded_to_the_granted_maximum(tmp_path: Path, v5: bool) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=v5).connect()
        sub.subscribe("a/#", qos=1)
        pub = Paho(port, v5=v5).connect()
        pub.publish("a/b", b"x", qos=2)
        pub.publish("a", b"parent", qos=0)
        got = sub.wait_messages(2)
        assert sorted((m.topic, m.qos) for m in got) == [("a", 0), ("a/b", 1)]


def test_wildcards_and_dollar_topics(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        everything = Paho(port).connect()
        everything.subscribe("#")
        plus = Paho(port).connect()
        plus.subscribe("+/status")
        dollar = Paho(port).connect()
        dollar.subscribe("$internal/#")
        pub = Paho(port).connect()
        for topic in ("$internal/status", "home/status", "home/room/status", "sp ace/ü.dot/x"):
            pub.publish(topic, topic.encode(), qos=1)
        pub.publish("done", b"", qos=1)
        everything.wait(lambda: any(m.topic == "done" for m in everything.messages), "done")
        assert [m.topic for m in everything.messages] == [
            "home/status",
            "home/room/status",
            "sp ace/ü.dot/x",
            "done",
        ]
        plus.wait_messages(1)
        dollar.wait_messages(1)
        assert [m.topic for m in plus.messages] == ["home/status"]
        assert [m.topic for m in dollar.messages] == ["$internal/status"]


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_retained_set_replace_clear_and_wildcards(tmp_path: Path, v5: bool) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        pub = Paho(port, v5=v5).connect()
        pub.publish("house/lamp", b"on", qos=1, retain=True)
        pub.publish("house/lamp", b"off", qos=1, retain=True)
        pub.publish("house/door", b"shut", qos=1, retain=True)
        pub.publish("garden/tap", b"dry", qos=1, retain=True)
        sub = Paho(port, v5=v5).connect()
        sub.subscribe("house/+", qos=1)
        got = sub.wait_messages(2)
        assert sorted((m.topic, m.payload, m.retain) for m in got) == [
            ("house/door", b"shut", True),
            ("house/lamp", b"off", True),
        ]
        everything = Paho(port, v5=v5).connect()
        everything.subscribe("#", qos=1)
        assert len(everything.wait_messages(3)) == 3
        pub.publish("house/lamp", b"", qos=1, retain=True)  # clears it
        sub.wait_messages(3)  # the clearing publish itself is delivered, not retained
        assert sub.messages[2].retain is False
        late = Paho(port, v5=v5).connect()
        late.subscribe("house/#", qos=1)
        got = late.wait_messages(1)
        pub.publish("house/x", b"sync", qos=1)
        late.wait(lambda: any(m.topic == "house/x" for m in late.messages), "sync")
        assert [(m.topic, m.payload) for m in late.messages] == [
            ("house/door", b"shut"),
            ("house/x", b"sync"),
        ]


def test_retained_survive_restart(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        pub = Paho(server.port("mqtt")).connect()
        pub.publish("cfg/mode", b"eco", qos=1, retain=True)
        pub.disconnect()
    with mqtt_server(tmp_path) as server:
        sub = Paho(server.port("mqtt")).connect()
        sub.subscribe("cfg/#", qos=1)
        got = sub.wait_messages(1)
        assert (got[0].topic, got[0].payload, got[0].retain) == ("cfg/mode", b"eco", True)


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_will_on_abnormal_close_only(tmp_path: Path, v5: bool) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port, v5=v5).connect()
        watcher.subscribe("wills/#", qos=1)
        polite = Paho(port, v5=v5, will=("wills/polite", b"gone", 1, False)).connect()
        polite.disconnect()
        rude = Paho(port, v5=v5, will=("wills/rude", b"gone", 1, False)).connect()
        rude.kill()
        got = watcher.wait_messages(1)
        probe = Paho(port, v5=v5).connect()
        probe.publish("wills/probe", b"", qos=1)
        watcher.wait_messages(2)
        assert [m.topic for m in watcher.messages] == ["wills/rude", "wills/probe"]
        assert got[0].payload == b"gone"


def test_will_delay_and_cancel_on_reconnect(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port, v5=True).connect()
        watcher.subscribe("wills/#", qos=1)
        delayed = Paho(
            port, v5=True, session_expiry=60, will=("wills/late", b"bye", 1, False), will_delay=1
        ).connect()
        resumed = Paho(
            port, v5=True, session_expiry=60, will=("wills/never", b"bye", 1, False), will_delay=2
        ).connect()
        # Killed with ``resumed`` and never resumed: its will, due when the resumed one
        # would have been, is the barrier that says the resumed will is really gone.
        barrier = Paho(
            port, v5=True, session_expiry=60, will=("wills/barrier", b"bye", 1, False), will_delay=2
        ).connect()
        delayed.kill()
        resumed.kill()
        barrier.kill()
        again = Paho(port, v5=True, client_id=resumed.client_id, session_expiry=60)
        again.connect(clean_start=False)
        watcher.wait_messages(2)
        assert [m.topic for m in watcher.messages] == ["wills/late", "wills/barrier"]


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_takeover_closes_the_old_connection(tmp_path: Path, v5: bool) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        first = Paho(port, v5=v5, client_id="same").connect()
        first.client.reconnect_delay_set(60, 120)
        second = Paho(port, v5=v5, client_id="same").connect()
        first.wait(lambda: bool(first.disconnects), "disconnect")
        if v5:
            assert first.disconnects[0] == 0x8E
        second.subscribe("t", qos=1)
        second.publish("t", b"still works", qos=1)
        assert second.wait_messages(1)[0].payload == b"still works"


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
def test_offline_messages_after_reconnect_and_restart(tmp_path: Path, v5: bool) -> None:
    def client(port: int) -> Paho:
        return Paho(port, v5=v5, client_id="keeper", clean=False, session_expiry=3600)

    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = client(port).connect()
        sub.subscribe("jobs/#", qos=2)
        sub.disconnect()
        pub = Paho(port, v5=v5).connect()
        pub.publish("jobs/q0", b"zero", qos=0)  # QoS 0 is not kept for offline sessions
        for i in range(5):
            pub.publish(f"jobs/{i}", str(i).encode(), qos=1 + i % 2)
        sub = client(port).connect(clean_start=False)
        assert sub.connack == (True, 0)
        got = sub.wait_messages(5)
        # paho hands a QoS 2 message over at PUBREL: order holds within each QoS
        assert [m.payload for m in got if m.qos == 1] == [b"0", b"2", b"4"]
        assert [m.payload for m in got if m.qos == 2] == [b"1", b"3"]
        sub.disconnect()
        for i in range(5, 8):
            pub.publish(f"jobs/{i}", str(i).encode(), qos=1)
        pub.disconnect()
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = client(port).connect(clean_start=False)
        assert sub.connack == (True, 0)
        got = sub.wait_messages(3)
        assert [m.payload for m in got] == [b"5", b"6", b"7"]
        # and the subscription itself survived the restart
        pub = Paho(port, v5=v5).connect()
        pub.publish("jobs/live", b"live", qos=1)
        assert sub.wait_messages(4)[-1].payload == b"live"


def test_clean_session_discards_state(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, client_id="c", clean=False).connect()
        sub.subscribe("x", qos=1)
        sub.disconnect()
        fresh = Paho(port, client_id="c", clean=True).connect()
        assert fresh.connack == (False, 0)
        pub = Paho(port).connect()
        pub.publish("x", b"1", qos=1)
        fresh.subscribe("y", qos=1)
        pub.publish("y", b"2", qos=1)
        assert [m.payload for m in fresh.wait_messages(1)] == [b"2"]


def test_keep_alive_expiry_closes_and_sends_will(tmp_path: Path) -> None:
    from tests.mqtt.helpers import RawClient

    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        watcher = Paho(port).connect()
        watcher.subscribe("ka/#", qos=1)
        raw = RawClient(port, level=4)
        raw.connect("silent", keep_alive=1, will_topic="ka/dead", will_payload=b"x", will_qos=1)
        assert raw.closed() == []  # closed after 1.5 s of silence
        assert watcher.wait_messages(1)[0].topic == "ka/dead"


def test_mqtt_31_client(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        old = Paho(port, v31=True).connect()
        new = Paho(port, v5=True).connect()
        old.subscribe("legacy/#", qos=2)
        new.publish("legacy/x", b"hi", qos=2)
        got = old.wait_messages(1)
        assert (got[0].topic, got[0].payload, got[0].qos) == ("legacy/x", b"hi", 2)


def test_tenants_are_isolated(tmp_path: Path) -> None:
    accounts = {"a": ("pa", "tenant-a"), "b": ("pb", "tenant-b")}
    with mqtt_server(tmp_path, accounts=accounts) as server:
        port = server.port("mqtt")
        sub_a = Paho(port, username="a", password="pa").connect()
        sub_b = Paho(port, username="b", password="pb").connect()
        sub_a.subscribe("shared/name", qos=1)
        sub_b.subscribe("shared/name", qos=1)
        Paho(port, username="a", password="pa").connect().publish("shared/name", b"A", qos=1)
        Paho(port, username="b", password="pb").connect().publish("shared/name", b"B", qos=1)
        assert [m.payload for m in sub_a.wait_messages(1)] == [b"A"]
        assert [m.payload for m in sub_b.wait_messages(1)] == [b"B"]
        # the same client id in two tenants is two sessions: no takeover
        one = Paho(port, client_id="dup", username="a", password="pa").connect()
        Paho(port, client_id="dup", username="b", password="pb").connect()
        one.publish("shared/name", b"A2", qos=1)
        assert [m.payload for m in sub_a.wait_messages(2)] == [b"A", b"A2"]
        assert one.disconnects == []
