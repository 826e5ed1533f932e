"""Well-behaved clients, one per protocol, each doing round trips through a real
client library while the fuzzer attacks the same server: a failed round trip, or one
still running after ``stall_s``, is a finding (another peer's bad input stopped or
held the server for everybody).

Each probe runs in a thread of its own (the libraries are blocking), reconnecting
after a failure; the fuzzer reads their counters and flags stalls itself, since a
stalled client cannot report that it is stalled.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["CLIENTS", "Probe", "ProbeClient", "make_client"]

log = logging.getLogger(__name__)

# What one round trip may take before it counts as failed (the clients' own timeouts).
ROUND_TRIP_TIMEOUT_S = 10.0
# Pause between two round trips: enough to watch the server, cheap on a shared machine.
GAP_S = 0.05


class ProbeFailed(Exception):
    pass


class ProbeClient(Protocol):
    def round_trip(self) -> None: ...

    def close(self) -> None: ...


def _wait(done: Callable[[], bool], timeout: float, what: str, pump: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise ProbeFailed(f"{what}: no answer within {timeout:.0f} s")
        pump()


def _tag() -> str:
    return uuid.uuid4().hex[:10]


class KafkaProbe:
    """confluent-kafka: produce one record (acks=all), then consume it back."""

    def __init__(self, host: str, port: int) -> None:
        from confluent_kafka import Consumer, Producer

        bootstrap = f"{host}:{port}"
        fast = {
            "socket.timeout.ms": 5000,
            "reconnect.backoff.ms": 50,
            "reconnect.backoff.max.ms": 500,
            "topic.metadata.refresh.interval.ms": 5000,
        }
        self.topic = f"netfuzz-probe-{_tag()}"
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "linger.ms": 0,
                "message.timeout.ms": int(ROUND_TRIP_TIMEOUT_S * 1000),
                **fast,
            }
        )
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"netfuzz-{_tag()}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 100,
                **fast,
            }
        )
        self.assigned = False

    def round_trip(self) -> None:
        from confluent_kafka import TopicPartition

        value = _tag().encode()
        delivered: list[Any] = []
        self.producer.produce(
            self.topic, value, on_delivery=lambda err, msg: delivered.append((err, msg))
        )
        self.producer.flush(ROUND_TRIP_TIMEOUT_S)
        if not delivered:
            raise ProbeFailed("produce: no delivery report")
        err, msg = delivered[0]
        if err is not None:
            raise ProbeFailed(f"produce: {err}")
        if not self.assigned:
            self.consumer.assign([TopicPartition(self.topic, 0, msg.offset())])
            self.assigned = True
        deadline = time.monotonic() + ROUND_TRIP_TIMEOUT_S
        while time.monotonic() < deadline:
            got = self.consumer.poll(0.2)
            if got is None:
                continue
            if got.error() is not None:
                raise ProbeFailed(f"consume: {got.error()}")
            if got.value() == value:
                return
        raise ProbeFailed("consume: the record did not come back")

    def close(self) -> None:
        self.producer.flush(1)
        self.consumer.close()


class AmqpProbe:
    """pika: publish with a publisher confirm, then basic.get it back."""

    def __init__(self, host: str, port: int) -> None:
        import pika

        params = pika.ConnectionParameters(
            host=host,
            port=port,
            socket_timeout=5,
            stack_timeout=ROUND_TRIP_TIMEOUT_S,
            blocked_connection_timeout=ROUND_TRIP_TIMEOUT_S,
            connection_attempts=1,
            heartbeat=30,
        )
        self.connection = pika.BlockingConnection(params)
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()
        self.queue = f"netfuzz-probe-{_tag()}"
        self.channel.queue_declare(self.queue, auto_delete=True)

    def round_trip(self) -> None:
        body = _tag().encode()
        self.channel.basic_publish("", self.queue, body)
        got: list[bytes] = []

        def get() -> bool:
            _, _, message = self.channel.basic_get(self.queue, auto_ack=True)
            if message is not None:
                got.append(message)
            return body in got

        _wait(get, ROUND_TRIP_TIMEOUT_S, "basic.get", lambda: self.connection.sleep(0.01))

    def close(self) -> None:
        self.connection.close()


class MqttProbe:
    """paho-mqtt (TCP or WebSocket): a QoS 1 publish to a topic it subscribes to."""

    def __init__(self, host: str, port: int, *, websocket: bool = False) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.topic = f"netfuzz/probe/{_tag()}"
        self.received: set[bytes] = set()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.lost: list[str] = []
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"netfuzz-{_tag()}",
            transport="websockets" if websocket else "tcp",
            protocol=paho.MQTTv311,
        )
        if websocket:
            client.ws_set_options(path="/mqtt")
        client.on_connect = lambda c, u, f, rc, p: self.connected.set()
        client.on_subscribe = lambda c, u, mid, rc, p: self.subscribed.set()
        client.on_message = lambda c, u, m: self.received.add(bytes(m.payload))
        client.on_disconnect = lambda c, u, f, rc, p: self.lost.append(str(rc))
        self.client = client
        client.connect(host, port, keepalive=30)
        client.loop_start()
        if not self.connected.wait(ROUND_TRIP_TIMEOUT_S):
            self.close()
            raise ProbeFailed("no CONNACK")
        client.subscribe(self.topic, qos=1)
        if not self.subscribed.wait(ROUND_TRIP_TIMEOUT_S):
            self.close()
            raise ProbeFailed("no SUBACK")

    def round_trip(self) -> None:
        if self.lost:
            raise ProbeFailed(f"disconnected: {self.lost[0]}")
        payload = _tag().encode()
        self.client.publish(self.topic, payload, qos=1)
        _wait(
            lambda: payload in self.received or bool(self.lost),
            ROUND_TRIP_TIMEOUT_S,
            "publish",
            lambda: time.sleep(0.002),
        )
        if payload not in self.received:
            raise ProbeFailed(f"disconnected: {self.lost[0]}")
        self.received.discard(payload)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class RocketMQProbe:
    """rocketmq-python-client: a synchronous send (the route, then SendMessage)."""

    def __init__(self, host: str, port: int) -> None:
        from rocketmq import ClientConfiguration, Credentials, Producer

        self.topic = f"netfuzz-probe-{_tag()}"
        config = ClientConfiguration(f"{host}:{port}", Credentials("", ""), "", request_timeout=5)
        self.producer = Producer(config, (self.topic,))
        self.producer.startup()

    def round_trip(self) -> None:
        from rocketmq import Message

        message = Message()
        message.topic = self.topic
        message.body = _tag().encode()
        receipt = self.producer.send(message)
        if not receipt.message_id:
            raise ProbeFailed("send: no message id")

    def close(self) -> None:
        self.producer.shutdown()


class HttpProbe:
    """aliyun-mns-sdk: send a message to a queue, receive it, delete it."""

    def __init__(self, host: str, port: int) -> None:
        from mns.account import Account
        from mns.queue import QueueMeta

        self.account = Account(f"http://{host}:{port}", "netfuzz", "netfuzz")
        self.queue = self.account.get_queue(f"netfuzz-probe-{_tag()}")
        self.queue.create(QueueMeta())

    def round_trip(self) -> None:
        from mns.queue import Message

        body = _tag()
        self.queue.send_message(Message(body))
        got = self.queue.receive_message(wait_seconds=1)
        if got.message_body != body.encode():
            raise ProbeFailed("receive: another message came back")
        self.queue.delete_message(got.receipt_handle)

    def close(self) -> None:
        self.queue.delete()


CLIENTS: Mapping[str, Callable[[str, int], ProbeClient]] = {
    "kafka": KafkaProbe,
    "amqp": AmqpProbe,
    "mqtt": MqttProbe,
    "mqtt_ws": lambda host, port: MqttProbe(host, port, websocket=True),
    "rocketmq": RocketMQProbe,
    "http": HttpProbe,
}


def make_client(protocol: str, host: str, port: int) -> ProbeClient:
    return CLIENTS[protocol](host, port)


@dataclass(slots=True)
class Failure:
    at: float  # time.monotonic()
    error: str
    excused: bool  # the server was down on purpose or had crashed: counted elsewhere


@dataclass
class Probe:
    """One protocol's well-behaved client, looping in its own thread until stopped."""

    protocol: str
    address: Callable[[], tuple[str, int]]
    round_trips: int = 0
    worst_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    # When the running round trip (or reconnect) began; None between round trips.
    busy_since: float | None = None
    excused: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _client: ProbeClient | None = None
    _done: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"probe-{self.protocol}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def reset_worst(self) -> None:
        """Forget the warm-up's latencies (first connects, topic creation)."""
        self.worst_s = 0.0

    def wait_round_trips(self, count: int, timeout: float) -> bool:
        """Until ``count`` round trips in all succeeded (False after ``timeout``)."""
        with self._done:
            return self._done.wait_for(lambda: self.round_trips >= count, timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.busy_since = started
            try:
                if self._client is None:
                    host, port = self.address()
                    self._client = make_client(self.protocol, host, port)
                started = time.monotonic()  # latency: the round trip, not the connect
                self._client.round_trip()
            except Exception as e:
                self.busy_since = None
                self.failures.append(
                    Failure(time.monotonic(), f"{type(e).__name__}: {e}"[:300], self.excused)
                )
                self._drop()
                self._stop.wait(0.3)
                continue
            took = time.monotonic() - started
            self.busy_since = None
            with self._done:
                self.round_trips += 1
                if not self.excused:
                    self.worst_s = max(self.worst_s, took)
                self._done.notify_all()
            self._stop.wait(GAP_S)
        self._drop()

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.close()
        except Exception as e:  # a broken connection may not close cleanly: fine
            log.debug("closing the %s probe: %s", self.protocol, e)
