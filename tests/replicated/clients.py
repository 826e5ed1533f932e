"""Each protocol's real client as the replicated pool's kill tests drive it.

A :class:`Producer` is a thread sending one message at a time at a steady pace and
recording what its client reported acknowledged (and when). After an error it does
what a plain application does: counts it, reopens what broke, goes on with the next
message; the clients' own retries (librdkafka's, paho's resend on reconnect, the
RocketMQ client's attempts) stay on.

Consumers take part of a stream before the kill (acking it) and the rest after;
:class:`Taken` says what was seen and what of it was acknowledged, so a test can tell
an ack that was undone (an acknowledged message delivered again) from a message that
simply came again because it was never acked.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
import pika
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka import Producer as KafkaClient
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message as MnsMessage
from paho.mqtt.enums import CallbackAPIVersion
from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer
from rocketmq import Message as RocketMessage
from rocketmq import Producer as RocketClient

__all__ = [
    "Ack",
    "AmqpProducer",
    "Delivery",
    "KafkaProducer",
    "MnsProducer",
    "MqttProducer",
    "MqttSubscriber",
    "Producer",
    "RocketProducer",
    "Taken",
    "amqp_drain",
    "amqp_take",
    "body",
    "kafka_drain",
    "kafka_take",
    "mns_drain",
    "mns_take",
    "parse",
    "rocket_consumer",
    "rocket_drain",
    "rocket_take",
]

Address = tuple[str, int]
MessageId = tuple[str, int]  # (producer tag, sequence number)
WAIT_S = 60.0
INVISIBLE_S = 10  # RocketMQ's smallest invisible duration; the MNS queue's visibility


def body(tag: str, seq: int) -> bytes:
    """A unique id, then bytes of every value (NUL included) and a digest: a body
    that any re-encoding or truncation on the way would change."""
    head = f"{tag}:{seq:06d}:".encode()
    return head + bytes(range(256))[seq % 256 :] + hashlib.blake2b(head).digest() * (1 + seq % 3)


def parse(raw: bytes) -> MessageId | None:
    """The id of a body :func:`body` made, byte for byte; ``None`` for anything else."""
    tag, _, rest = raw.partition(b":")
    seq, _, _ = rest.partition(b":")
    try:
        message_id = (tag.decode(), int(seq))
    except (UnicodeDecodeError, ValueError):
        return None
    return message_id if raw == body(*message_id) else None


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    sent_at: float  # monotonic
    acked_at: float
    queue: str  # partition, queue id: where order is promised


@dataclass(frozen=True, slots=True)
class Delivery:
    raw: bytes
    queue: str  # as the consumer saw it ("" when the client does not say)
    redelivered: bool = False


@dataclass
class Taken:
    """What a consumer got: every delivery, and the ids it acked (committed offsets
    below, a delete that returned, an ack a later request's answer came after)."""

    deliveries: list[Delivery] = field(default_factory=list)
    acked: set[MessageId] = field(default_factory=set)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:100]}"


class Producer(threading.Thread):
    """Sends ``body(tag, seq)`` for seq 0, 1, … at ``rate`` a second, one at a time;
    a slot missed during an outage is not caught up (the gap shows)."""

    def __init__(self, tag: str, rate: float) -> None:
        super().__init__(name=f"producer-{tag}", daemon=True)
        self.tag = tag
        self.rate = rate
        self.acks: list[Ack] = []
        self.errors: Counter[str] = Counter()
        self.halt = threading.Event()
        self._lock = threading.Lock()

    # -- what each protocol provides ---------------------------------------------------

    def open(self) -> None:
        raise NotImplementedError

    def send(self, raw: bytes) -> str:
        """Send one message and wait for its acknowledgement; returns its queue."""
        raise NotImplementedError

    def reset(self) -> None:
        """After an error: drop whatever the next ``open`` must make anew."""

    def close(self) -> None:
        raise NotImplementedError

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        every, slot, seq, opened = 1.0 / self.rate, time.monotonic(), 0, False
        while not self.halt.is_set():
            slot = max(slot + every, time.monotonic())
            if self.halt.wait(max(slot - time.monotonic(), 0.0)):
                break
            try:
                if not opened:
                    self.open()
                    opened = True
                sent_at = time.monotonic()
                queue = self.send(body(self.tag, seq))
                with self._lock:
                    self.acks.append(Ack(seq, sent_at, time.monotonic(), queue))
            except _Halted:
                break
            except Exception as e:  # what the client raised: counted, then carry on
                with self._lock:
                    self.errors[_describe(e)] += 1
                with contextlib.suppress(Exception):
                    self.reset()
                opened = False
                self.halt.wait(0.1)
            seq += 1
        with contextlib.suppress(Exception):
            self.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(WAIT_S)
        assert not self.is_alive(), f"{self.tag}: the producer did not stop"

    def acked(self) -> list[Ack]:
        with self._lock:
            return list(self.acks)

    def acked_since(self, moment: float) -> int:
        """How many sent at or after ``moment`` were acknowledged."""
        return sum(1 for ack in self.acked() if ack.sent_at >= moment)

    def _wait(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.halt.wait(0.01):
                raise _Halted


class _Halted(Exception):
    """Stopped while a send was waiting for its acknowledgement (not acknowledged)."""


# -- Kafka: confluent-kafka, acks=all, idempotent ------------------------------------


def _kafka_common(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "topic.metadata.refresh.interval.ms": 1000,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 500,
    }


class KafkaProducer(Producer):
    def __init__(self, tag: str, rate: float, bootstrap: str, topic: str) -> None:
        super().__init__(tag, rate)
        self.bootstrap, self.topic = bootstrap, topic
        self.client: KafkaClient | None = None

    def _on_error(self, error: KafkaError) -> None:
        with self._lock:
            self.errors[f"error_cb {error.name()}"] += 1

    def open(self) -> None:
        if self.client is None:
            self.client = KafkaClient(
                {
                    **_kafka_common(self.bootstrap),
                    "acks": "all",
                    "enable.idempotence": True,
                    "linger.ms": 0,
                    "message.timeout.ms": 90_000,  # librdkafka retries through the takeover
                    "error_cb": self._on_error,
                }
            )

    def send(self, raw: bytes) -> str:
        assert self.client is not None
        report: list[tuple[KafkaError | None, Any]] = []
        self.client.produce(self.topic, raw, on_delivery=lambda err, msg: report.append((err, msg)))
        client = self.client

        def delivered() -> bool:
            client.poll(0.05)  # runs the delivery callback
            return bool(report)

        self._wait(delivered)
        error, message = report[0]
        if error is not None:
            raise KafkaException(error)
        return f"p{message.partition()}"

    def reset(self) -> None:
        # A fatal error fences an idempotent producer for good: a new one then.
        client, self.client = self.client, None
        if client is not None:
            client.flush(1.0)

    def close(self) -> None:
        client, self.client = self.client, None  # destroyed with the last reference
        if client is not None:
            client.flush(5.0)


def _kafka_consumer(bootstrap: str, group: str) -> Consumer:
    return Consumer(
        {
            **_kafka_common(bootstrap),
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
        }
    )


def _kafka_delivery(message: Any) -> Delivery:
    return Delivery(bytes(message.value()), f"p{message.partition()}")


def kafka_take(bootstrap: str, topic: str, group: str, count: int) -> Taken:
    """``count`` records of the group, then their offsets committed (synchronously)."""
    consumer = _kafka_consumer(bootstrap, group)
    taken, ends = Taken(), dict[int, int]()
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + WAIT_S
        while len(taken.deliveries) < count:
            assert time.monotonic() < deadline, f"kafka: took {len(taken.deliveries)} of {count}"
            message = consumer.poll(0.2)
            if message is None or message.error() is not None:
                continue
            partition, offset = message.partition(), message.offset()
            assert partition is not None and offset is not None
            taken.deliveries.append(_kafka_delivery(message))
            ends[partition] = offset + 1
        consumer.commit(
            offsets=[TopicPartition(topic, p, end) for p, end in ends.items()],
            asynchronous=False,
        )
        taken.acked = {i for d in taken.deliveries if (i := parse(d.raw)) is not None}
    finally:
        consumer.close()
    return taken


def kafka_drain(bootstrap: str, topic: str, group: str, wanted: set[MessageId]) -> Taken:
    """The group's records from its committed offsets on, until ``wanted`` came."""
    consumer = _kafka_consumer(bootstrap, group)
    taken = Taken()
    try:
        consumer.subscribe([topic])
        _until_seen(taken, wanted, lambda: _kafka_poll(consumer))
    finally:
        consumer.close()
    return taken


def _kafka_poll(consumer: Consumer) -> list[Delivery]:
    message = consumer.poll(0.2)
    if message is None or message.error() is not None:
        return []
    return [_kafka_delivery(message)]


def _until_seen(
    taken: Taken,
    wanted: set[MessageId],
    receive: Callable[[], Iterable[Delivery]],
    not_before: float = 0.0,
) -> None:
    """Receive until every id of ``wanted`` came (and not before ``not_before``: what
    an undone ack would have made visible again has had time to show)."""
    missing = set(wanted)
    deadline = time.monotonic() + WAIT_S
    while missing or time.monotonic() < not_before:
        if time.monotonic() > deadline:
            break  # the checks name what is missing
        for delivery in receive():
            taken.deliveries.append(delivery)
            missing.discard(parse(delivery.raw) or ("", -1))
    taken.acked = {i for d in taken.deliveries if (i := parse(d.raw)) is not None}


# -- AMQP: pika, publisher confirms, a durable queue ---------------------------------

_PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _amqp_connect(address: Address) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            *address, heartbeat=0, connection_attempts=1, blocked_connection_timeout=WAIT_S
        )
    )


class AmqpProducer(Producer):
    def __init__(self, tag: str, rate: float, address: Address, queue: str) -> None:
        super().__init__(tag, rate)
        self.address, self.queue = address, queue
        self.connection: pika.BlockingConnection | None = None
        self.channel: Any = None

    def open(self) -> None:
        if self.connection is None or not self.connection.is_open:
            self.connection = _amqp_connect(self.address)
        self.channel = self.connection.channel()
        self.channel.queue_declare(self.queue, durable=True)
        self.channel.confirm_delivery()

    def send(self, raw: bytes) -> str:
        # Returns once confirmed; a nack, a return or a closed channel raise.
        self.channel.basic_publish("", self.queue, raw, _PERSISTENT, mandatory=True)
        return "q"

    def reset(self) -> None:
        # The gateway closes only the channel that needs the dead shard: a new one.
        if self.channel is not None and self.channel.is_open:
            self.channel.close()
        if self.connection is not None and not self.connection.is_open:
            self.connection = None

    def close(self) -> None:
        if self.connection is not None and self.connection.is_open:
            self.connection.close()


def amqp_take(address: Address, queue: str, count: int) -> Taken:
    """``count`` messages by basic.get, each acked; the channel's close-ok comes after
    the server read the acks."""
    taken = Taken()
    connection = _amqp_connect(address)
    try:
        channel = connection.channel()
        deadline = time.monotonic() + WAIT_S
        while len(taken.deliveries) < count:
            assert time.monotonic() < deadline, f"amqp: took {len(taken.deliveries)} of {count}"
            method, _properties, raw = channel.basic_get(queue)
            if method is None:
                connection.sleep(0.05)
                continue
            taken.deliveries.append(Delivery(raw, "q", bool(method.redelivered)))
            channel.basic_ack(method.delivery_tag)
        channel.close()
        taken.acked = {i for d in taken.deliveries if (i := parse(d.raw)) is not None}
    finally:
        connection.close()
    return taken


def amqp_drain(address: Address, queue: str, wanted: set[MessageId]) -> Taken:
    taken = Taken()
    connection = _amqp_connect(address)
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=50)
        received: list[Delivery] = []

        def on_message(ch: Any, method: Any, _properties: Any, raw: bytes) -> None:
            received.append(Delivery(raw, "q", bool(method.redelivered)))
            ch.basic_ack(method.delivery_tag)

        channel.basic_consume(queue, on_message)

        def receive() -> list[Delivery]:
            connection.process_data_events(time_limit=0.1)
            got = list(received)
            received.clear()
            return got

        _until_seen(taken, wanted, receive)
        channel.close()
    finally:
        connection.close()
    return taken


# -- MQTT: paho, v3.1.1, persistent sessions -----------------------------------------


def _paho(client_id: str) -> paho.Client:
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv311,
        clean_session=False,
    )
    client.reconnect_delay_set(1, 1)  # paho reconnects by itself, to the same gateway
    return client


class MqttProducer(Producer):
    """QoS 1 or 2 on a persistent session: a publish the gateway could not take (it
    closes the connection) is sent again by paho on the reconnect, DUP set."""

    def __init__(
        self, tag: str, rate: float, address: Address, topic: str, qos: int, client_id: str
    ) -> None:
        super().__init__(tag, rate)
        self.address, self.topic, self.qos = address, topic, qos
        self.client = _paho(client_id)
        self.connected = threading.Event()
        self.published: set[int] = set()
        self.client.on_connect = lambda *_args: self.connected.set()
        self.client.on_publish = self._on_publish

    def _on_publish(self, _c: Any, _u: Any, mid: int, _reason: Any, _p: Any) -> None:
        with self._lock:
            self.published.add(mid)

    def open(self) -> None:
        if self.connected.is_set():
            return
        self.client.connect(*self.address, keepalive=10)
        self.client.loop_start()
        self._wait(self.connected.is_set)

    def send(self, raw: bytes) -> str:
        info = self.client.publish(self.topic, raw, self.qos)

        def acked() -> bool:
            with self._lock:
                return info.mid in self.published

        self._wait(acked)
        with self._lock:
            self.published.discard(info.mid)
        return self.topic

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class MqttSubscriber:
    """One paho client (kept across both phases, as QoS 2 receipt needs its state)
    on a persistent session, subscribed to ``topics`` (name -> QoS)."""

    def __init__(self, address: Address, client_id: str, topics: dict[str, int]) -> None:
        self.address, self.topics = address, topics
        self.client = _paho(client_id)
        self.lock = threading.Condition()
        self.deliveries: list[Delivery] = []
        self.subacks: dict[int, int] = {}  # mid -> deliveries seen before the SUBACK
        self.connected = False
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe

    def _on_connect(self, *_args: Any) -> None:
        with self.lock:
            self.connected = True
            self.lock.notify_all()

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        with self.lock:
            self.deliveries.append(Delivery(bytes(message.payload), message.topic, message.dup))
            self.lock.notify_all()

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, _reasons: Any, _p: Any) -> None:
        # Called on paho's thread, which sent the PUBACK (PUBREC) of every message
        # before it read this SUBACK.
        with self.lock:
            self.subacks[mid] = len(self.deliveries)
            self.lock.notify_all()

    def _wait(self, check: Callable[[], bool], what: str) -> None:
        with self.lock:
            assert self.lock.wait_for(check, WAIT_S), f"mqtt: timed out waiting for {what}"

    def connect(self) -> None:
        self.connected = False
        self.client.connect(*self.address, keepalive=10)
        self.client.loop_start()
        self._wait(lambda: self.connected, "CONNACK")

    def subscribe(self, topics: list[tuple[str, int]]) -> int:
        """Subscribe and wait for the SUBACK; the deliveries seen before it."""
        _, mid = self.client.subscribe(topics)
        assert mid is not None
        self._wait(lambda: mid in self.subacks, "SUBACK")
        return self.subacks[mid]

    def take(self, count: int) -> Taken:
        """At least ``count`` messages of each topic, acked by paho as they came;
        a SUBSCRIBE answered after them, then DISCONNECT."""

        def enough() -> bool:
            seen = Counter(d.queue for d in self.deliveries)
            return all(seen[topic] >= count for topic in self.topics)

        self._wait(enough, f"{count} messages of each topic")
        acked = self.subscribe([(next(iter(self.topics)) + "-sync", 0)])
        self.client.disconnect()
        self.client.loop_stop()
        with self.lock:
            deliveries = list(self.deliveries)
        ids = {i for d in deliveries[:acked] if (i := parse(d.raw)) is not None}
        return Taken(deliveries, ids)

    def drain(self, wanted: set[MessageId]) -> Taken:
        """The session's messages after a reconnect, until ``wanted`` came."""
        with self.lock:
            start = len(self.deliveries)
        self.connect()
        taken = Taken()
        seen = start

        def receive() -> list[Delivery]:
            nonlocal seen
            with self.lock:
                self.lock.wait(0.1)
                got = self.deliveries[seen:]
                seen = len(self.deliveries)
            return got

        try:
            _until_seen(taken, wanted, receive)
        finally:
            self.client.disconnect()
            self.client.loop_stop()
        return taken


# -- RocketMQ 5: rocketmq-python-client, producer and simple consumer ----------------


def _rocket_config(address: Address) -> Any:
    return ClientConfiguration(f"{address[0]}:{address[1]}", Credentials(), request_timeout=5)


class RocketProducer(Producer):
    """FIFO messages of one message group: the server keeps a group in one queue,
    the one place RocketMQ promises order (normal messages go to whichever queue the
    server picks, which no client call tells)."""

    GROUP = "in-order"

    def __init__(self, tag: str, rate: float, address: Address, topic: str) -> None:
        super().__init__(tag, rate)
        self.address, self.topic = address, topic
        self.client: Any = None
        self.failures = 0

    def open(self) -> None:
        if self.client is None:
            client = RocketClient(_rocket_config(self.address), (self.topic,))
            client.startup()
            self.client = client

    def send(self, raw: bytes) -> str:
        message = RocketMessage()
        message.topic = self.topic
        message.body = raw
        message.message_group = self.GROUP
        self.client.send(message)  # the client tries up to three times itself
        self.failures = 0
        return self.GROUP

    def reset(self) -> None:
        # A client failing for long gets replaced, as a plain application would.
        self.failures += 1
        if self.failures >= 20 and self.client is not None:
            client, self.client, self.failures = self.client, None, 0
            client.shutdown()

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown()


def rocket_consumer(address: Address, group: str, topic: str) -> Any:
    consumer = SimpleConsumer(
        _rocket_config(address), group, {topic: FilterExpression()}, await_duration=2
    )
    consumer.startup()
    # One receive registers the group before anything is sent (what it finds, the
    # placement probe, is acked).
    for message, _ in _rocket_receive(consumer, 32):
        consumer.ack(message)
    return consumer


def _rocket_receive(consumer: Any, most: int) -> list[tuple[Any, Delivery]]:
    try:
        messages = consumer.receive(most, INVISIBLE_S)
    except Exception:  # MESSAGE_NOT_FOUND after the long poll, among others
        return []
    # The client does not say which queue a message came from: the sender's
    # receipt does (the checks take it from there).
    return [(m, Delivery(bytes(m.body), "", (m.delivery_attempt or 1) > 1)) for m in messages]


def rocket_take(consumer: Any, count: int) -> Taken:
    """``count`` messages received, each acked; an ack that raised is not counted."""
    taken = Taken()
    deadline = time.monotonic() + WAIT_S
    while len(taken.deliveries) < count:
        assert time.monotonic() < deadline, f"rocketmq: took {len(taken.deliveries)} of {count}"
        for message, delivery in _rocket_receive(consumer, count - len(taken.deliveries)):
            taken.deliveries.append(delivery)
            try:
                consumer.ack(message)
            except Exception:
                continue
            if (message_id := parse(delivery.raw)) is not None:
                taken.acked.add(message_id)
    return taken


def rocket_drain(consumer: Any, wanted: set[MessageId], not_before: float) -> Taken:
    taken = Taken()

    def receive() -> list[Delivery]:
        got = _rocket_receive(consumer, 32)
        for message, _ in got:
            with contextlib.suppress(Exception):
                consumer.ack(message)
        return [delivery for _, delivery in got]

    _until_seen(taken, wanted, receive, not_before)
    return taken


# -- MNS: aliyun-mns-sdk ---------------------------------------------------------------

_KEY = "replicated"  # open auth mode lets any key in


def mns_queue(address: Address, name: str) -> Any:
    account = Account(f"http://{address[0]}:{address[1]}", _KEY, _KEY)
    account.mns_client.set_connection_timeout(10)
    queue = account.get_queue(name)
    queue.set_encoding(True)  # base64 on the wire: the body's bytes go as they are
    return queue


def _mns_text(raw: bytes) -> str:
    return raw.decode("latin-1")  # one character a byte; the SDK sends it as UTF-8


def _mns_raw(text: str | bytes) -> bytes:
    """The batch receive hands back the base64-decoded UTF-8 bytes."""
    return (text.decode() if isinstance(text, bytes) else text).encode("latin-1")


class MnsProducer(Producer):
    def __init__(self, tag: str, rate: float, address: Address, queue: str) -> None:
        super().__init__(tag, rate)
        self.queue = mns_queue(address, queue)

    def open(self) -> None:
        pass

    def send(self, raw: bytes) -> str:
        self.queue.send_message(MnsMessage(_mns_text(raw)))
        return "q"

    def close(self) -> None:
        pass


def _mns_receive(queue: Any, most: int) -> list[tuple[str, Delivery]]:
    try:
        messages = queue.batch_receive_message(most, 1)
    except MNSServerException as e:
        if e.type == "MessageNotExist":
            return []
        raise
    return [
        (
            m.receipt_handle,
            Delivery(_mns_raw(m.message_body), "q", int(m.dequeue_count or 1) > 1),
        )
        for m in messages
    ]


def mns_take(address: Address, name: str, count: int) -> Taken:
    """``count`` messages received, each deleted (204: acknowledged)."""
    queue, taken = mns_queue(address, name), Taken()
    deadline = time.monotonic() + WAIT_S
    while len(taken.deliveries) < count:
        assert time.monotonic() < deadline, f"mns: took {len(taken.deliveries)} of {count}"
        for handle, delivery in _mns_receive(queue, count - len(taken.deliveries)):
            taken.deliveries.append(delivery)
            queue.delete_message(handle)
            if (message_id := parse(delivery.raw)) is not None:
                taken.acked.add(message_id)
    return taken


def mns_drain(address: Address, name: str, wanted: set[MessageId], not_before: float) -> Taken:
    queue, taken = mns_queue(address, name), Taken()

    def receive() -> list[Delivery]:
        got = _mns_receive(queue, 16)
        for handle, _ in got:
            queue.delete_message(handle)
        return [delivery for _, delivery in got]

    _until_seen(taken, wanted, receive, not_before)
    return taken
