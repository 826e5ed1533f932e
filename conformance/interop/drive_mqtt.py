"""MQTT 5 through paho-mqtt. The storage topic is the topic name's first level; the
key, tag and user properties travel as v5 user properties (``polymq.key``,
``polymq.tag``), the content type as the v5 content type."""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from polymq.conformance.interop.driver import poll
from polymq.conformance.interop.fields import Arrived, Sent
from polymq.protocols import interop

__all__ = ["MqttDriver"]

_CONNECT_TIMEOUT_S = 20.0


class MqttDriver:
    protocol = "mqtt"
    client = "paho-mqtt (v5)"

    def __init__(self, host: str, port: int) -> None:
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"interop-{uuid.uuid4().hex[:8]}",
            protocol=paho.MQTTv5,
        )
        self._connected = threading.Event()
        self._subscribed: dict[int, threading.Event] = {}
        self._inbox: dict[str, queue.Queue[Any]] = {}
        self._client.on_connect = lambda *_: self._connected.set()
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._client.connect(host, port)
        self._client.loop_start()
        if not self._connected.wait(_CONNECT_TIMEOUT_S):
            raise TimeoutError("MQTT CONNACK did not arrive")

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, *_: Any) -> None:
        self._subscribed.setdefault(mid, threading.Event()).set()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        first = message.topic.split("/", 1)[0]
        self._inbox.setdefault(first, queue.Queue()).put(message)

    def prepare(self, topic: str) -> None:
        """Subscribe to the topic and everything under it; the SUBACK comes once the
        server follows the storage topic, so nothing produced after it is missed."""
        self._inbox.setdefault(topic, queue.Queue())
        result, mid = self._client.subscribe(f"{topic}/#", qos=1)
        if result != paho.MQTT_ERR_SUCCESS or mid is None:
            raise RuntimeError(f"subscribe failed: {result}")
        if not self._subscribed.setdefault(mid, threading.Event()).wait(_CONNECT_TIMEOUT_S):
            raise TimeoutError("MQTT SUBACK did not arrive")

    def produce(self, topic: str, sent: Sent) -> None:
        properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        properties.ContentType = sent.content_type
        properties.CorrelationData = sent.correlation_id.encode()
        properties.ResponseTopic = sent.reply_to
        properties.UserProperty = [
            (interop.KEY, sent.key),
            (interop.TAG, sent.tag),
            *sent.properties,
        ]
        info = self._client.publish(topic, sent.body, qos=1, properties=properties)
        info.wait_for_publish(_CONNECT_TIMEOUT_S)
        if not info.is_published():
            raise TimeoutError("MQTT PUBACK did not arrive")

    def next_message(self, topic: str, timeout_s: float) -> Any:
        """The next PUBLISH under ``topic`` as paho gives it (user properties in order,
        repeats kept)."""
        inbox = self._inbox.setdefault(topic, queue.Queue())

        def take(remaining: float) -> Any:
            try:
                return inbox.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                return None

        return poll(take, timeout_s, "mqtt")

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        message = self.next_message(topic, timeout_s)
        self._client.unsubscribe(f"{topic}/#")
        props = getattr(message, "properties", None)
        user = dict(getattr(props, "UserProperty", None) or [])
        key = user.pop(interop.KEY, None) or message.topic  # the topic is the default key
        tag = user.pop(interop.TAG, None)
        correlation = getattr(props, "CorrelationData", None)
        return Arrived(
            body=message.payload,
            key=key,
            tag=tag,
            properties=user,
            content_type=getattr(props, "ContentType", None),
            correlation_id=correlation.decode() if correlation is not None else None,
            reply_to=getattr(props, "ResponseTopic", None),
        )

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
