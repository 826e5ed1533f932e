"""MQTT 3.1, 3.1.1 and 5.0, judged by the OASIS specifications (section numbers in the
docstrings) and by Mosquitto, the reference implementation.

Absence is checked with a marker: after the action that must *not* deliver something,
another message is published at QoS 1 (its PUBACK awaited) on a topic the subscriber
also follows; once the marker arrives, whatever should have come before it has had
its chance. No sleeping and hoping."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from polymq.conformance.runner import NotApplicable, NotOffered, Registry, Target

registry = Registry("mqtt")
case = registry.case
_WAIT_S = 10.0


def _props(packet_type: str, **values: Any) -> Any:
    props = Properties(getattr(PacketTypes, packet_type))  # type: ignore[no-untyped-call]
    for name, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            setattr(props, name, item)
    return props


@dataclasses.dataclass
class Got:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Any
    dup: bool = False


class Client:
    """A paho client on its network thread, recording what it receives."""

    def __init__(
        self,
        t: Target,
        client_id: str,
        *,
        version: MQTTProtocolVersion = paho.MQTTv311,
        clean: bool = True,
        password: str | None = None,
        will: tuple[str, bytes, int] | None = None,
        websocket: bool = False,
    ) -> None:
        self.t, self.version, self.clean = t, version, clean
        self.port = t.port("mqtt-ws" if websocket else "mqtt")
        kwargs: dict[str, Any] = {} if version == paho.MQTTv5 else {"clean_session": clean}
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=version,
            transport="websockets" if websocket else "tcp",
            **kwargs,
        )
        if websocket:
            self.client.ws_set_options(path="/mqtt")
        if t.user is not None:
            self.client.username_pw_set(t.user, password or t.password)
        if will is not None:
            self.client.will_set(*will)
        self.cond = threading.Condition()
        self.connack: tuple[bool, int] | None = None
        self.messages: list[Got] = []
        self.acked: dict[int, int] = {}
        self.subacks: dict[int, list[int]] = {}
        self.unsubacks: set[int] = set()
        self.disconnected = False
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.on_disconnect = self._on_disconnect
        self.client.on_unsubscribe = self._on_unsubscribe

    def _on_connect(self, c: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.cond:
            self.connack = (bool(flags.session_present), int(reason.value))
            self.cond.notify_all()

    def _on_message(self, c: Any, u: Any, m: Any) -> None:
        with self.cond:
            props = getattr(m, "properties", None)
            got = Got(m.topic, bytes(m.payload), m.qos, bool(m.retain), props, bool(m.dup))
            self.messages.append(got)
            self.cond.notify_all()

    def _on_publish(self, c: Any, u: Any, mid: int, reason: Any, props: Any) -> None:
        with self.cond:
            self.acked[mid] = int(reason.value)
            self.cond.notify_all()

    def _on_subscribe(self, c: Any, u: Any, mid: int, reasons: Any, props: Any) -> None:
        with self.cond:
            self.subacks[mid] = [int(r.value) for r in reasons]
            self.cond.notify_all()

    def _on_unsubscribe(self, c: Any, u: Any, mid: int, reasons: Any, props: Any) -> None:
        with self.cond:
            self.unsubacks.add(mid)
            self.cond.notify_all()

    def _on_disconnect(self, c: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.cond:
            self.disconnected = True
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = _WAIT_S) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise AssertionError(f"timed out waiting for {what}")

    def connect(self, *, expiry: int | None = None) -> tuple[bool, int]:
        props = None
        kwargs: dict[str, Any] = {}
        if self.version == paho.MQTTv5:
            kwargs["clean_start"] = self.clean
            if expiry is not None:
                props = _props("CONNECT", SessionExpiryInterval=expiry)
        self.client.connect(self.t.host, self.port, 30, properties=props, **kwargs)
        self.client.loop_start()
        self.wait(lambda: self.connack is not None or self.disconnected, "CONNACK")
        if self.connack is None:
            raise AssertionError("connection closed before CONNACK")
        return self.connack

    def subscribe(self, topic: str, qos: int = 1, **options: Any) -> int:
        """Subscribe and return the granted QoS (or the failure code)."""
        if self.version == paho.MQTTv5:
            _, mid = self.client.subscribe(topic, options=SubscribeOptions(qos=qos, **options))
        else:
            _, mid = self.client.subscribe(topic, qos)
        assert mid is not None, "SUBSCRIBE not sent"
        self.wait(lambda: mid in self.subacks, f"SUBACK of {topic}")
        return self.subacks[mid][0]

    def unsubscribe(self, topic: str) -> None:
        _, mid = self.client.unsubscribe(topic)
        self.wait(lambda: mid in self.unsubacks, f"UNSUBACK of {topic}")

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, props: Any = None
    ) -> None:
        info = self.client.publish(topic, payload, qos, retain, properties=props)
        if qos:
            self.wait(lambda: info.mid in self.acked, f"acknowledgement of {topic}")

    def wait_for(self, payload: bytes) -> Got:
        self.wait(lambda: any(m.payload == payload for m in self.messages), f"message {payload!r}")
        return next(m for m in self.messages if m.payload == payload)

    def before(self, marker: bytes) -> list[Got]:
        """Messages that arrived before ``marker`` (which is awaited)."""
        self.wait_for(marker)
        return self.messages[: next(i for i, m in enumerate(self.messages) if m.payload == marker)]

    def close(self) -> None:
        """DISCONNECT, and wait until the socket is closed."""
        with suppress(Exception):
            self.client.disconnect()
        with suppress(AssertionError):
            self.wait(lambda: self.disconnected or self.connack is None, "the close", 5)
        self.client.loop_stop()

    def kill(self) -> None:
        """Drop the TCP connection without DISCONNECT: an abnormal close."""
        sock: Any = self.client.socket()
        self.client.loop_stop()
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextmanager
def _clients(t: Target, count: int, **kwargs: Any) -> Iterator[list[Client]]:
    clients = [Client(t, t.name("c"), **kwargs) for _ in range(count)]
    try:
        for c in clients:
            rc = c.connect()[1]
            assert rc == 0, f"CONNACK {rc}"
        yield clients
    finally:
        for c in clients:
            c.close()


def _clear_retained(t: Target, topic: str) -> None:
    with _clients(t, 1) as (c,):
        c.publish(topic, b"", retain=True)


@case("connect-3.1.1", "paho")
def connect_311(t: Target) -> None:
    """CONNECT level 4 is accepted with return code 0 (3.2.2.3)."""
    with _clients(t, 1):
        pass


@case("connect-3.1", "paho")
def connect_31(t: Target) -> None:
    """CONNECT with protocol name MQIsdp, level 3 is accepted."""
    with _clients(t, 1, version=paho.MQTTv31):
        pass


@case("v5-connect", "paho-v5")
def connect_v5(t: Target) -> None:
    """CONNECT level 5 is accepted with reason code 0x00 (3.2.2.2)."""
    with _clients(t, 1, version=paho.MQTTv5):
        pass


@case("auth-refused", "paho")
def auth_refused(t: Target) -> None:
    """A wrong password gets CONNACK 4 (bad user name or password) or 5 (not authorized)."""
    if not t.auth_enforced:
        raise NotApplicable("the target does not check credentials")
    c = Client(t, t.name("auth"), password="wrong-" + t.run_id)
    try:
        try:
            _, rc = c.connect()
        except AssertionError:
            return  # closed without CONNACK: allowed for v3.1.1 by some brokers
        assert rc in (4, 5, 134, 135), f"CONNACK {rc} for a wrong password"
    finally:
        c.close()


def _qos_case(t: Target, qos: int, version: int = paho.MQTTv311) -> None:
    topic = f"{t.name('qos')}/x"
    with _clients(t, 2, version=version) as (sub, pub):
        granted = sub.subscribe(topic, qos)
        if granted != qos:
            raise NotOffered(f"subscription at QoS {qos} granted {granted}")
        pub.publish(topic, b"payload", qos)
        got = sub.wait_for(b"payload")
        assert got.topic == topic and got.qos == qos, got


@case("qos0", "paho")
def qos0(t: Target) -> None:
    """QoS 0 publish reaches a QoS 0 subscriber (4.3.1)."""
    _qos_case(t, 0)


@case("qos1", "paho")
def qos1(t: Target) -> None:
    """QoS 1: PUBACK to the publisher, delivery at QoS 1 (4.3.2)."""
    _qos_case(t, 1)


@case("qos2", "paho")
def qos2(t: Target) -> None:
    """QoS 2: granted QoS 2, PUBREC/PUBREL/PUBCOMP both ways, delivered at QoS 2 (4.3.3)."""
    _qos_case(t, 2)


@case("qos-downgrade", "paho")
def qos_downgrade(t: Target) -> None:
    """Delivery QoS is the minimum of the publish and the subscription QoS (3.8.4)."""
    topic = f"{t.name('down')}/x"
    with _clients(t, 2) as (sub, pub):
        sub.subscribe(topic, 0)
        pub.publish(topic, b"at-1", 1)
        assert sub.wait_for(b"at-1").qos == 0


@case("wildcards", "paho")
def wildcards(t: Target) -> None:
    """``+`` matches one level, ``#`` any number including the parent (4.7.1)."""
    root = t.name("wild")
    with _clients(t, 2) as (sub, pub):
        sub.subscribe(f"{root}/+/c", 1)
        sub.subscribe(f"{root}/a/#", 1)
        for topic, body in (
            (f"{root}/a/c", b"1"),  # both filters: one copy (overlap may give two, 3.3.5)
            (f"{root}/x/c", b"2"),
            (f"{root}/a", b"3"),  # `#` includes the parent level
            (f"{root}/a/b/c", b"4"),
            (f"{root}/x/y/c", b"no"),
            (f"{root}/a/c", b"end"),
        ):
            pub.publish(topic, body, 1)
        bodies = {m.payload for m in sub.before(b"end")}
        assert bodies == {b"1", b"2", b"3", b"4"}, bodies


@case("retained", "paho")
def retained(t: Target) -> None:
    """A retained message reaches later subscribers with RETAIN set; an empty retained
    payload clears it (3.3.1.3)."""
    topic = f"{t.name('ret')}/state"
    with _clients(t, 1) as (pub,):
        pub.publish(topic, b"on", 1, retain=True)
    try:
        with _clients(t, 1) as (late,):
            late.subscribe(topic, 1)
            got = late.wait_for(b"on")
            assert got.retain, "retained message delivered without RETAIN"
        _clear_retained(t, topic)
        with _clients(t, 2) as (later, pub):
            later.subscribe(topic, 1)
            pub.publish(topic, b"live", 1)
            assert later.before(b"live") == [], "a cleared retained message was delivered"
            assert not later.wait_for(b"live").retain, "a live message arrived with RETAIN set"
    finally:
        _clear_retained(t, topic)


@case("will", "paho")
def will(t: Target) -> None:
    """The will is published when the connection ends without DISCONNECT (3.1.2.5)."""
    topic = f"{t.name('will')}/status"
    with _clients(t, 1) as (watcher,):
        watcher.subscribe(topic, 1)
        dying = Client(t, t.name("dying"), will=(topic, b"gone", 1))
        dying.connect()
        dying.kill()
        watcher.wait_for(b"gone")


@case("will-not-on-disconnect", "paho")
def will_not_on_disconnect(t: Target) -> None:
    """A clean DISCONNECT discards the will (3.14.4)."""
    topic = f"{t.name('will')}/status"
    with _clients(t, 2) as (watcher, pub):
        watcher.subscribe(topic, 1)
        polite = Client(t, t.name("polite"), will=(topic, b"gone", 1))
        polite.connect()
        polite.close()
        with _clients(t, 1) as (probe,):  # the broker has handled the close by now
            probe.subscribe(f"{topic}/probe", 0)
        pub.publish(topic, b"marker", 1)
        assert watcher.before(b"marker") == [], "the will was published after DISCONNECT"


@case("persistent-session", "paho")
def persistent_session(t: Target) -> None:
    """clean_session=0: subscriptions and QoS 1 messages survive a disconnect, and the
    CONNACK says the session is present (3.1.2.4, 3.2.2.2)."""
    topic = f"{t.name('sess')}/x"
    client_id = t.name("durable")
    first = Client(t, client_id, clean=False)
    try:
        first.connect()
        first.subscribe(topic, 1)
    finally:
        first.close()
    with _clients(t, 1) as (pub,):
        pub.publish(topic, b"offline", 1)
    again = Client(t, client_id, clean=False)
    try:
        present, _ = again.connect()
        assert present, "session present flag not set"
        again.wait_for(b"offline")
    finally:
        again.close()
        cleanup = Client(t, client_id, clean=True)
        cleanup.connect()
        cleanup.close()


@case("unsubscribe", "paho")
def unsubscribe(t: Target) -> None:
    """After UNSUBACK no more messages arrive for that filter (3.10.4)."""
    root = t.name("unsub")
    with _clients(t, 2) as (sub, pub):
        sub.subscribe(f"{root}/a", 1)
        sub.subscribe(f"{root}/b", 1)
        sub.unsubscribe(f"{root}/a")
        pub.publish(f"{root}/a", b"dropped", 1)
        pub.publish(f"{root}/b", b"marker", 1)
        assert sub.before(b"marker") == [], "a message arrived after unsubscribing"


@case("takeover", "paho")
def takeover(t: Target) -> None:
    """A second connection with the same client id closes the first (3.1.4)."""
    client_id = t.name("twin")
    first, second = Client(t, client_id), Client(t, client_id)
    try:
        first.connect()
        second.connect()
        first.client.reconnect_delay_set(60, 60)
        first.wait(lambda: first.disconnected, "the first connection to be closed")
    finally:
        first.close()
        second.close()


@case("shared-subscription", "paho-v5")
def shared_subscription(t: Target) -> None:
    """$share/{group}/{filter}: each message goes to one member of the group (4.8.2)."""
    topic = f"{t.name('shared')}/x"
    with _clients(t, 3, version=paho.MQTTv5) as (a, b, pub):
        for member in (a, b):
            code = member.subscribe(f"$share/g/{topic}", 1)
            if code > 2:
                raise NotOffered(f"SUBACK reason 0x{code:02x}")
        bodies = [f"m{i}".encode() for i in range(10)]
        for body in bodies:
            pub.publish(topic, body, 1)

        def everyone() -> list[bytes]:
            return [m.payload for m in a.messages + b.messages]

        a.wait(lambda: len(set(everyone())) == 10, "all 10 messages across the group")
        assert sorted(everyone()) == sorted(bodies), f"duplicates: {sorted(everyone())}"


@case("v5-user-properties", "paho-v5")
def v5_user_properties(t: Target) -> None:
    """User properties (order and repeats kept), content type, response topic and
    correlation data reach the subscriber unchanged (3.3.2.3)."""
    topic = f"{t.name('props')}/x"
    pairs = [("a", "1"), ("b", "2"), ("a", "3")]
    with _clients(t, 2, version=paho.MQTTv5) as (sub, pub):
        sub.subscribe(topic, 1)
        props = _props(
            "PUBLISH",
            UserProperty=pairs,
            ContentType="text/plain",
            ResponseTopic=f"{topic}/reply",
            CorrelationData=b"corr",
        )
        pub.publish(topic, b"p", 1, props=props)
        got = sub.wait_for(b"p").properties
        assert list(got.UserProperty) == pairs, got.UserProperty
        assert got.ContentType == "text/plain" and got.CorrelationData == b"corr", got
        assert got.ResponseTopic == f"{topic}/reply", got


@case("v5-message-expiry", "paho-v5")
def v5_message_expiry(t: Target) -> None:
    """An expired retained message is no longer delivered (3.3.2.3.3); a live one is
    sent with its remaining interval."""
    topic = f"{t.name('expiry')}/x"
    with _clients(t, 1, version=paho.MQTTv5) as (pub,):
        pub.publish(
            topic, b"brief", 1, retain=True, props=_props("PUBLISH", MessageExpiryInterval=1)
        )
    try:
        with _clients(t, 1, version=paho.MQTTv5) as (early,):
            early.subscribe(topic, 1)
            interval = getattr(early.wait_for(b"brief").properties, "MessageExpiryInterval", None)
            assert interval is not None and interval <= 1, f"expiry interval {interval}"
        time.sleep(2.2)  # the feature is the passing of time
        with _clients(t, 2, version=paho.MQTTv5) as (late, pub2):
            late.subscribe(topic, 1)
            pub2.publish(topic, b"marker", 1)
            assert late.before(b"marker") == [], "an expired retained message was delivered"
    finally:
        _clear_retained(t, topic)


@case("v5-no-local", "paho-v5")
def v5_no_local(t: Target) -> None:
    """No Local: a client's own publishes are not sent back to it (3.8.3.1)."""
    topic = f"{t.name('nolocal')}/x"
    with _clients(t, 2, version=paho.MQTTv5) as (me, other):
        me.subscribe(topic, 1, noLocal=True)
        me.publish(topic, b"mine", 1)
        other.publish(topic, b"theirs", 1)
        assert me.before(b"theirs") == [], "own message delivered despite No Local"


@case("publish-subscribe", "gmqtt")
async def gmqtt_roundtrip(t: Target) -> None:
    """gmqtt (asyncio, MQTT 3.1.1): QoS 1 publish and delivery."""
    from gmqtt import Client as GClient
    from gmqtt.mqtt.constants import MQTTv311

    topic = f"{t.name('gmqtt')}/x"
    got: asyncio.Queue[bytes] = asyncio.Queue()
    subscribed = asyncio.Event()
    sub, pub = GClient(t.name("gsub")), GClient(t.name("gpub"))
    for c in (sub, pub):
        if t.user is not None:
            c.set_auth_credentials(t.user, t.password)

    def on_message(client: object, topic: str, payload: bytes, qos: int, props: object) -> int:
        got.put_nowait(payload)
        return 0

    sub.on_message = on_message
    sub.on_subscribe = lambda *args: subscribed.set()
    await sub.connect(t.host, t.port("mqtt"), version=MQTTv311)
    await pub.connect(t.host, t.port("mqtt"), version=MQTTv311)
    try:
        sub.subscribe(topic, qos=1)
        await asyncio.wait_for(subscribed.wait(), _WAIT_S)
        pub.publish(topic, b"hello", qos=1)
        assert await asyncio.wait_for(got.get(), _WAIT_S) == b"hello"
    finally:
        await pub.disconnect()
        await sub.disconnect()


@case("publish-subscribe", "amqtt")
async def amqtt_roundtrip(t: Target) -> None:
    """amqtt (asyncio, MQTT 3.1.1): QoS 1 publish and delivery."""
    from amqtt.client import MQTTClient

    creds = f"{t.user}:{t.password}@" if t.user is not None else ""
    uri = f"mqtt://{creds}{t.host}:{t.port('mqtt')}/"
    topic = f"{t.name('amqtt')}/x"
    sub = MQTTClient(client_id=t.name("asub"), config={"auto_reconnect": False})
    pub = MQTTClient(client_id=t.name("apub"), config={"auto_reconnect": False})
    await sub.connect(uri)
    await pub.connect(uri)
    try:
        await sub.subscribe([(topic, 1)])
        await pub.publish(topic, b"hello", qos=1)
        message = await sub.deliver_message(timeout_duration=_WAIT_S)
        assert message is not None and bytes(message.data) == b"hello"
    finally:
        await pub.disconnect()
        await sub.disconnect()


def _mqtt_js(t: Target, level: int, max_qos: int) -> dict[str, Any]:
    from polymq.conformance.cases._node import run_node

    creds = [t.user, t.password or ""] if t.user is not None else []
    url = f"mqtt://{t.host}:{t.port('mqtt')}"
    topic = f"{t.name('js')}/x"
    result = run_node("conformance_mqtt.js", url, str(level), str(max_qos), topic, *creds)
    if result["granted"] != [max_qos]:
        raise NotOffered(f"granted {result['granted']} for QoS {max_qos}")
    expected = [[topic, f"m{q}", q] for q in range(max_qos + 1)]
    assert sorted(result["got"]) == expected, result
    return result


@case("publish-subscribe", "mqtt.js")
def mqtt_js_311(t: Target) -> None:
    """mqtt.js (node, MQTT 3.1.1): QoS 0 and 1 publish and delivery."""
    _mqtt_js(t, 4, 1)


@case("v5-publish-subscribe", "mqtt.js")
def mqtt_js_v5(t: Target) -> None:
    """mqtt.js (node, MQTT 5): QoS 0, 1 and 2 publish and delivery."""
    _mqtt_js(t, 5, 2)


@case("qos1-redelivery", "paho")
def qos1_redelivery(t: Target) -> None:
    """A QoS 1 message not acknowledged before the connection dropped is sent again to
    the resumed session with DUP set (4.4)."""
    topic = f"{t.name('redeliver')}/x"
    client_id = t.name("unacked")
    holder = Client(t, client_id, clean=False)
    holder.client.manual_ack_set(True)  # never PUBACK
    try:
        holder.connect()
        holder.subscribe(topic, 1)
        with _clients(t, 1) as (pub,):
            pub.publish(topic, b"unacked", 1)
        holder.wait_for(b"unacked")
    finally:
        holder.kill()
    again = Client(t, client_id, clean=False)
    try:
        present, _ = again.connect()
        assert present, "session present flag not set"
        assert again.wait_for(b"unacked").dup, "redelivered without DUP"
    finally:
        again.close()
        _clean_session(t, client_id)


def _clean_session(t: Target, client_id: str) -> None:
    cleanup = Client(t, client_id, clean=True)
    cleanup.connect()
    cleanup.close()


def _utf8(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


def _raw_connect_311(t: Target, client_id: str, clean: bool) -> int:
    """Send a CONNECT paho would refuse to send; the CONNACK return code."""
    flags = 0x02 if clean else 0x00
    payload = _utf8(client_id)
    if t.user is not None:
        flags |= 0xC0
        payload += _utf8(t.user) + _utf8(t.password or "")
    body = _utf8("MQTT") + bytes([4, flags]) + (30).to_bytes(2, "big") + payload
    assert len(body) < 128
    with socket.create_connection((t.host, t.port("mqtt")), timeout=_WAIT_S) as sock:
        sock.sendall(bytes([0x10, len(body)]) + body)
        answer = b""
        while len(answer) < 4:
            chunk = sock.recv(4 - len(answer))
            if not chunk:
                raise AssertionError(f"connection closed after {answer!r}, no CONNACK")
            answer += chunk
    assert answer[:2] == b"\x20\x02", f"not a CONNACK: {answer!r}"
    return answer[3]


@case("client-id-rejected", "raw-socket")
def client_id_rejected(t: Target) -> None:
    """MQTT 3.1.1: an empty client id with CleanSession=0 gets CONNACK 2, identifier
    rejected (3.1.3.1)."""
    rc = _raw_connect_311(t, "", clean=False)
    assert rc == 2, f"CONNACK {rc}"


@case("v5-assigned-client-id", "paho-v5")
def v5_assigned_client_id(t: Target) -> None:
    """MQTT 5: an empty client id is accepted and the server assigns one in CONNACK
    (3.2.2.3.7)."""
    c = Client(t, "", version=paho.MQTTv5)
    assigned: list[str] = []

    def on_connect(client: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        assigned.append(getattr(props, "AssignedClientIdentifier", ""))
        c._on_connect(client, u, flags, reason, props)

    c.client.on_connect = on_connect
    try:
        assert c.connect()[1] == 0
        assert assigned and assigned[0], "no Assigned Client Identifier"
    finally:
        c.close()


@case("v5-retain-handling", "paho-v5")
def v5_retain_handling(t: Target) -> None:
    """Retain Handling 2: retained messages are not sent at subscribe; Retain As
    Published keeps the RETAIN flag on forwarded messages (3.8.3.1)."""
    topic = f"{t.name('rh')}/x"
    with _clients(t, 1, version=paho.MQTTv5) as (pub,):
        pub.publish(topic, b"old", 1, retain=True)
    try:
        with _clients(t, 2, version=paho.MQTTv5) as (sub, pub):
            sub.subscribe(topic, 1, retainHandling=2, retainAsPublished=True)
            pub.publish(topic, b"new", 1, retain=True)
            assert sub.before(b"new") == [], "a retained message sent despite Retain Handling 2"
            assert sub.wait_for(b"new").retain, "RETAIN not kept with Retain As Published"
    finally:
        _clear_retained(t, topic)


@case("v5-subscription-id", "paho-v5")
def v5_subscription_id(t: Target) -> None:
    """A Subscription Identifier comes back on the messages that subscription matched
    (3.8.2.1.2)."""
    topic = f"{t.name('subid')}/x"
    with _clients(t, 2, version=paho.MQTTv5) as (sub, pub):
        props = _props("SUBSCRIBE", SubscriptionIdentifier=42)
        _, mid = sub.client.subscribe(topic, options=SubscribeOptions(qos=1), properties=props)
        assert mid is not None
        sub.wait(lambda: mid in sub.subacks, "SUBACK")
        pub.publish(topic, b"tagged", 1)
        got = sub.wait_for(b"tagged").properties
        assert getattr(got, "SubscriptionIdentifier", None) == [42], got


@case("v5-topic-alias", "paho-v5")
def v5_topic_alias(t: Target) -> None:
    """A publisher's Topic Alias stands for the topic in later PUBLISHes with an empty
    topic name (3.3.2.3.4)."""
    topic = f"{t.name('alias')}/x"
    with _clients(t, 2, version=paho.MQTTv5) as (sub, pub):
        sub.subscribe(topic, 1)
        pub.publish(topic, b"first", 1, props=_props("PUBLISH", TopicAlias=1))
        pub.publish("", b"second", 1, props=_props("PUBLISH", TopicAlias=1))
        assert sub.wait_for(b"second").topic == topic
        assert sub.wait_for(b"first").topic == topic


@case("v5-session-expiry", "paho-v5")
def v5_session_expiry(t: Target) -> None:
    """A session with Session Expiry Interval 1 s is gone 2 s after its connection
    closed: the next CONNACK says no session present (3.1.2.11.2)."""
    client_id = t.name("expiring")
    first = Client(t, client_id, version=paho.MQTTv5, clean=False)
    first.connect(expiry=1)
    first.subscribe(f"{client_id}/x", 1)
    first.close()
    kept = Client(t, client_id, version=paho.MQTTv5, clean=False)
    try:
        assert kept.connect(expiry=1)[0], "session not present right after closing"
    finally:
        kept.close()
    time.sleep(2.2)  # the feature is the passing of time
    late = Client(t, client_id, version=paho.MQTTv5, clean=False)
    try:
        assert not late.connect(expiry=0)[0], "session still present after its expiry"
    finally:
        late.close()


@case("websocket", "paho")
def websocket(t: Target) -> None:
    """MQTT over WebSocket (subprotocol ``mqtt``, path ``/mqtt``): a WebSocket
    subscriber gets what a TCP publisher sends, and the other way round."""
    topic = f"{t.name('ws')}/x"
    ws = Client(t, t.name("ws"), websocket=True)
    try:
        assert ws.connect()[1] == 0
        ws.subscribe(topic, 1)
        with _clients(t, 1) as (tcp,):
            tcp.subscribe(topic, 1)
            tcp.publish(topic, b"from-tcp", 1)
            ws.wait_for(b"from-tcp")
            ws.publish(topic, b"from-ws", 1)
            tcp.wait_for(b"from-ws")
    finally:
        ws.close()


def _raw_session(t: Target, keep_alive: int = 30) -> socket.socket:
    """A TCP connection that sent a 3.1.1 CONNECT and got CONNACK 0."""
    client_id = t.name("raw")
    flags = 0x02
    payload = _utf8(client_id)
    if t.user is not None:
        flags |= 0xC0
        payload += _utf8(t.user) + _utf8(t.password or "")
    body = _utf8("MQTT") + bytes([4, flags]) + keep_alive.to_bytes(2, "big") + payload
    sock = socket.create_connection((t.host, t.port("mqtt")), timeout=_WAIT_S)
    sock.sendall(bytes([0x10, len(body)]) + body)
    answer = sock.recv(4)
    assert answer[:2] == b"\x20\x02" and answer[3:4] == b"\x00", f"CONNACK {answer!r}"
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes ``sock`` within ``seconds`` (anything it sends first
    is read and ignored)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1024):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True  # reset
    return False


@case("publish-wildcard-refused", "raw-socket")
def publish_wildcard_refused(t: Target) -> None:
    """A PUBLISH whose topic name holds a wildcard is a protocol violation: the server
    closes the connection (3.3.2.1, 4.8)."""
    with _raw_session(t) as sock:
        topic = _utf8(f"{t.name('bad')}/#")
        sock.sendall(bytes([0x30, len(topic) + 1]) + topic + b"x")
        assert _closed_within(sock, _WAIT_S), "the connection stayed open"


@case("keep-alive", "raw-socket")
def keep_alive(t: Target) -> None:
    """A client silent for one and a half keep-alive periods is disconnected
    (3.1.2.10)."""
    with _raw_session(t, keep_alive=1) as sock:
        assert _closed_within(sock, 6), "a silent client was not disconnected"


@case("resubscribe-replaces", "paho")
def resubscribe_replaces(t: Target) -> None:
    """SUBSCRIBE to a filter already subscribed replaces it: one copy per message, at
    the new QoS (3.8.4)."""
    topic = f"{t.name('resub')}/x"
    with _clients(t, 2) as (sub, pub):
        sub.subscribe(topic, 0)
        sub.subscribe(topic, 1)
        pub.publish(topic, b"once", 1)
        pub.publish(topic, b"end", 1)
        before = sub.before(b"end")
        assert [(m.payload, m.qos) for m in before] == [(b"once", 1)], before
