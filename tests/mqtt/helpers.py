"""Shared pieces of the MQTT tests: a live server with the MQTT listeners, a paho
client that records what it receives, and a raw-socket client for bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.listener import mqtt_listener, mqtt_ws_listener
from polymq.protocols.mqtt.options import MqttOptions
from tests.live_server import LiveServer, live_server, server_config

__all__ = [
    "TIMEOUT",
    "Paho",
    "RawClient",
    "Received",
    "mqtt_server",
    "paho_properties",
    "wait_until",
]

TIMEOUT = 30.0
FACTORIES = {"mqtt": mqtt_listener, "mqtt_ws": mqtt_ws_listener}


@contextmanager
def mqtt_server(
    tmp_path: Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    accounts: Mapping[str, str | tuple[str, str]] | None = None,
    options: MqttOptions | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
) -> Iterator[LiveServer]:
    """A gateway with both MQTT listeners; ``accounts`` (user to password, or to
    password and namespace) turns on authentication; ``options`` the adapter's
    tunables; ``loop_factory`` its loop."""
    config = server_config(tmp_path, ("mqtt", "mqtt_ws"), overrides)
    if accounts is not None:
        auth = AuthConfig(
            mode="accounts",
            accounts=tuple(_account(user, spec) for user, spec in accounts.items()),
        )
        config = dataclasses.replace(config, auth=auth)
    factories = FACTORIES
    if options is not None:
        factories = {
            name: functools.partial(factory, options=options) for name, factory in FACTORIES.items()
        }
    with live_server(
        tmp_path, ("mqtt", "mqtt_ws"), factories=factories, config=config, loop_factory=loop_factory
    ) as server:
        yield server


def _account(user: str, spec: str | tuple[str, str]) -> AccountConfig:
    """``password`` or ``(password, namespace)``."""
    if isinstance(spec, str):
        return AccountConfig(user=user, password=spec)
    return AccountConfig(user=user, password=spec[0], namespaces=(spec[1],))


def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def paho_properties(packet_type: str, **values: Any) -> Any:
    """paho ``Properties`` for ``packet_type`` (PUBLISH, SUBSCRIBE, CONNECT,
    WILLMESSAGE) with ``values`` set; a name given a list is set once per item (user
    properties repeat)."""
    props = Properties(getattr(PacketTypes, packet_type))  # type: ignore[no-untyped-call]
    for name, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            setattr(props, name, item)
    return props


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    properties: Any


@dataclass
class Paho:
    """A paho-mqtt client on its own network thread, recording deliveries."""

    port: int
    v5: bool = False
    v31: bool = False  # MQTT 3.1 (protocol name MQIsdp)
    client_id: str = field(default_factory=lambda: f"t-{uuid.uuid4().hex[:12]}")
    clean: bool = True
    session_expiry: int | None = None
    username: str | None = None
    password: str | None = None
    transport: str = "tcp"
    will: tuple[str, bytes, int, bool] | None = None
    will_delay: int | None = None
    keepalive: int = 60
    user_data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.messages: list[Received] = []
        self.lock = threading.Condition()
        self.connack: tuple[bool, int] | None = None
        self.disconnects: list[int] = []
        self.published: dict[int, int] = {}  # mid -> reason code
        self.subacks: dict[int, list[int]] = {}
        protocol = paho.MQTTv5 if self.v5 else paho.MQTTv31 if self.v31 else paho.MQTTv311
        kwargs: dict[str, Any] = {}
        if not self.v5:
            kwargs["clean_session"] = self.clean
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=protocol,
            transport=self.transport,  # type: ignore[arg-type]
            **kwargs,
        )
        if self.username is not None:
            self.client.username_pw_set(self.username, self.password)
        if self.will is not None:
            props = None
            if self.v5 and self.will_delay is not None:
                props = paho_properties("WILLMESSAGE", WillDelayInterval=self.will_delay)
            topic, payload, qos, retain = self.will
            self.client.will_set(topic, payload, qos, retain, properties=props)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe

    # callbacks
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.lock:
            self.connack = (bool(flags.session_present), int(reason.value))
            self.lock.notify_all()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.messages.append(
                Received(
                    msg.topic,
                    bytes(msg.payload),
                    msg.qos,
                    bool(msg.retain),
                    bool(msg.dup),
                    getattr(msg, "properties", None),
                )
            )
            self.lock.notify_all()

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        with self.lock:
            self.disconnects.append(int(reason.value))
            self.lock.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        with self.lock:
            self.published[mid] = int(reason.value)
            self.lock.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        with self.lock:
            self.subacks[mid] = [int(r.value) for r in reasons]
            self.lock.notify_all()

    # actions
    def connect(self, *, wait: bool = True, clean_start: bool | None = None) -> Paho:
        props = None
        kwargs: dict[str, Any] = {}
        if self.v5:
            kwargs["clean_start"] = self.clean if clean_start is None else clean_start
            if self.session_expiry is not None:
                props = paho_properties("CONNECT", SessionExpiryInterval=self.session_expiry)
        self.client.connect(
            "127.0.0.1", self.port, keepalive=self.keepalive, properties=props, **kwargs
        )
        self.client.loop_start()
        if wait:
            self.wait(lambda: self.connack is not None, "CONNACK")
        return self

    def wait(self, predicate: Callable[[], bool], what: str = "", timeout: float = TIMEOUT) -> None:
        with self.lock:
            if not self.lock.wait_for(predicate, timeout):
                raise AssertionError(f"{self.client_id}: timed out waiting for {what}")

    def subscribe(self, topic: str, qos: int = 0, **options: Any) -> list[int]:
        if self.v5:
            from paho.mqtt.subscribeoptions import SubscribeOptions

            props = options.pop("properties", None)
            result, mid = self.client.subscribe(
                topic, options=SubscribeOptions(qos=qos, **options), properties=props
            )
        else:
            result, mid = self.client.subscribe(topic, qos)
        assert result == 0 and mid is not None
        self.wait(lambda: mid in self.subacks, f"SUBACK for {topic}")
        return self.subacks[mid]

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        properties: Any = None,
        wait: bool = True,
    ) -> int:
        info = self.client.publish(topic, payload, qos, retain, properties=properties)
        if wait and qos:
            self.wait(lambda: info.mid in self.published, f"ack of {topic}")
            return self.published[info.mid]
        return 0

    def wait_messages(self, count: int, what: str = "messages") -> list[Received]:
        self.wait(lambda: len(self.messages) >= count, f"{count} {what}")
        return list(self.messages)

    def disconnect(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def kill(self) -> None:
        """Drop the connection without DISCONNECT (an abnormal close)."""
        sock: Any = self.client.socket()
        self.client.loop_stop()
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class RawClient:
    """MQTT over a plain socket with our own codec: for bytes no real client sends."""

    def __init__(self, port: int, level: int = codec.LEVEL_5) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.level = level
        self.decoder = codec.Decoder(level=level)
        self.pending: list[codec.Packet] = []

    def send(self, data: bytes | codec.Packet) -> None:
        if not isinstance(data, bytes):
            data = codec.encode(data, self.level)
        self.sock.sendall(data)

    def connect(self, client_id: str = "", **kwargs: Any) -> codec.ConnAck:
        self.send(codec.Connect(level=self.level, client_id=client_id, **kwargs))
        ack = self.receive()
        assert isinstance(ack, codec.ConnAck), ack
        return ack

    def subscribe(self, topic_filter: str, qos: int = 0, packet_id: int = 1) -> codec.SubAck:
        self.send(
            codec.Subscribe(
                packet_id=packet_id,
                subscriptions=[codec.Subscription(filter=topic_filter, qos=qos)],
            )
        )
        ack = self.receive()
        assert isinstance(ack, codec.SubAck), ack
        return ack

    def receive(self) -> codec.Packet | None:
        """The next packet, or None once the server closed the connection."""
        while not self.pending:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def closed(self) -> list[codec.Packet]:
        """Everything the server sent until it closed the connection."""
        packets = []
        while (packet := self.receive()) is not None:
            packets.append(packet)
        return packets

    def close(self) -> None:
        self.sock.close()
