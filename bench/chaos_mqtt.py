"""MQTT in the chaos bench: paho-mqtt (MQTT 5) QoS 1 publishers and one persistent
session subscriber (``clean_start`` off, a session expiry of an hour).

paho reconnects only to the host it was given; the loop here makes a new connection
to the next gateway instead. A publish counts as acknowledged only when its PUBACK
came with a success reason code (MQTT 5 may answer a QoS 1 publish with a failure
code instead of closing). A publisher that loses its connection starts a new clean
one: what was in flight there is simply not acknowledged. The subscriber keeps its
session across reconnects, so what was published meanwhile waits in its queue."""

from __future__ import annotations

import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from bench.chaos_client import Context, Pacer, Worker, backoff
from bench.chaos_history import body

__all__ = ["workers"]

_PUBACK_WAIT_S = 10.0
_KEEPALIVE_S = 5


def _topic(context: Context, index: int) -> str:
    return f"chaos/{context.run}/m{index}"


class _Connection:
    """One paho client over one TCP connection, with the events its callbacks set."""

    def __init__(self, client_id: str, *, persistent: bool) -> None:
        self.connected = threading.Event()
        self.closed = threading.Event()
        self.refused: str | None = None
        self.pubacks: dict[int, int] = {}  # mid -> reason code value
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        self.persistent = persistent
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            self.refused = str(reason)
            self.closed.set()
        else:
            self.connected.set()

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        self.refused = self.refused or str(reason)
        self.closed.set()

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        self.pubacks[mid] = int(reason.value)

    def open(self, address: tuple[str, int]) -> bool:
        properties = None
        if self.persistent:
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            properties.SessionExpiryInterval = 3600
        self.client.connect(
            address[0],
            address[1],
            keepalive=_KEEPALIVE_S,
            clean_start=not self.persistent,
            properties=properties,
        )
        self.client.loop_start()
        deadline = time.monotonic() + 10
        while not self.connected.wait(0.1):
            if self.closed.is_set() or time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def alive(self) -> bool:
        return self.connected.is_set() and not self.closed.is_set()


class MqttPublisher(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.topic = _topic(context, index)

    def work(self) -> None:
        stop = self.context.stop_producing
        if not self.context.wait_subscribed():
            return
        pacer, seq, attempt = Pacer(self.context.rate), 0, 0
        while not stop.is_set():
            address = self.context.addresses("mqtt", attempt)[0]
            connection = _Connection(f"chaos-{self.context.run}-{self.name}", persistent=False)
            try:
                if connection.open(address):
                    while pacer.wait(stop) and self._publish(connection, seq):
                        seq += 1
                    seq += 1  # the one that failed, if any, keeps its number
                else:
                    self.error(f"connect {connection.refused or 'timed out'}")
            except OSError as e:
                self.error(e)
            finally:
                connection.close()
            if not stop.is_set():
                self.history.on_reconnect("producer")
                attempt += 1
                backoff(stop)

    def _publish(self, connection: _Connection, seq: int) -> bool:
        """One QoS 1 publish, awaited; ``False`` when the connection is no good."""
        self.history.on_sent()
        info = connection.client.publish(self.topic, body(self.name, seq), qos=1)
        deadline = time.monotonic() + _PUBACK_WAIT_S
        try:
            while not info.is_published():
                if not connection.alive():
                    self.error(f"disconnected ({connection.refused})")
                    return False
                if time.monotonic() > deadline:
                    self.error("no PUBACK in 10 s")
                    return False
                info.wait_for_publish(0.1)
        except (RuntimeError, ValueError) as e:
            self.error(e)
            return False
        reason = connection.pubacks.pop(info.mid, 0)
        if reason >= 0x80:
            self.error(f"PUBACK reason 0x{reason:02x}")
            return True  # refused, not lost: the connection is still good
        self.history.on_acked(self.name, seq)
        return True


class MqttSubscriber(Worker):
    def __init__(self, context: Context) -> None:
        super().__init__(context.name("consumer"), context)
        self.topics = [_topic(context, i) for i in range(context.producers)]

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        self.history.on_delivered(message.payload, queue=message.topic, redelivered=message.dup)

    def _on_subscribe(self, _c: Any, _u: Any, _mid: int, reasons: Any, _p: Any) -> None:
        if all(not r.is_failure for r in reasons):
            self.context.subscribed.set()
        else:
            self.error(f"SUBACK {[str(r) for r in reasons]}")

    def work(self) -> None:
        stop, attempt = self.context.stop_consuming, 0
        while not stop.is_set():
            address = self.context.addresses("mqtt", attempt)[0]
            connection = _Connection(f"chaos-{self.context.run}-{self.name}", persistent=True)
            connection.client.on_message = self._on_message
            connection.client.on_subscribe = self._on_subscribe
            try:
                if connection.open(address):
                    connection.client.subscribe([(t, 1) for t in self.topics])
                    while connection.alive() and not stop.wait(0.25):
                        pass
                    if not stop.is_set():
                        self.error(f"disconnected ({connection.refused})")
                else:
                    self.error(f"connect {connection.refused or 'timed out'}")
            except OSError as e:
                self.error(e)
            finally:
                connection.close()
            if not stop.is_set():
                self.history.on_reconnect("consumer")
                attempt += 1
                backoff(stop)


def workers(context: Context) -> list[Worker]:
    producers: list[Worker] = [MqttPublisher(context, i) for i in range(context.producers)]
    return [MqttSubscriber(context), *producers]
