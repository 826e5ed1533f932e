"""Per-account quotas against a live gateway, with each protocol's real client: every
client is held back the way its own broker would hold it back, nothing it sent is
lost, the connection limit refuses the one connection too many with the protocol's
own error while the others carry on, and ``/metrics`` shows all of it per account.

No wall-clock bounds: the rates are far below what a client sends in a burst, so the
throttling is certain; what is asserted is the protocol's signal, the server's
counters and that every message arrived.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import httpx
import pika
import pika.exceptions
import pytest
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message as MnsMessage
from mns.queue import QueueMeta
from prometheus_client.parser import text_string_to_metric_families
from rocketmq import ClientConfiguration, Credentials
from rocketmq import Message as RocketMessage
from rocketmq import Producer as RocketProducer
from rocketmq.v5.exception import TooManyRequestsException

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.config import AccountConfig, AuthConfig, QuotaConfig
from polymq.gateway.processor import Caller
from tests.live_server import LiveServer, live_server, server_config
from tests.mns.signed import sign_headers
from tests.mqtt.helpers import Paho

TIMEOUT = 60.0
PASSWORD = "secret"
RATE = 20_000  # bytes/s: a burst of COUNT x SIZE owes two seconds
COUNT, SIZE = 30, 2_000
MNS_KEY, MNS_SECRET = "mns-ak", "mns-sk"
LIMITED_KEY, LIMITED_SECRET = "limited-ak", "limited-sk"
ROCKET_KEY, ROCKET_SECRET = "rocket-ak", "rocket-sk"


def _account(
    user: str,
    quota: QuotaConfig | None,
    access_key: str | None = None,
    secret_key: str | None = None,
) -> AccountConfig:
    return AccountConfig(
        user=user, password=PASSWORD, quota=quota, access_key=access_key, secret_key=secret_key
    )


AUTH = AuthConfig(
    mode="accounts",
    accounts=(
        _account("kprod", QuotaConfig(produce_bytes_per_s=RATE)),
        _account("apub", QuotaConfig(produce_bytes_per_s=RATE)),
        _account("mpub", QuotaConfig(produce_bytes_per_s=RATE)),
        _account("msub", QuotaConfig(consume_bytes_per_s=RATE)),
        _account("asub", QuotaConfig(consume_bytes_per_s=RATE)),
        _account("kcons", QuotaConfig(consume_bytes_per_s=RATE)),
        _account("rprod", QuotaConfig(produce_bytes_per_s=RATE), ROCKET_KEY, ROCKET_SECRET),
        _account("mns", QuotaConfig(requests_per_s=1), access_key=MNS_KEY, secret_key=MNS_SECRET),
        _account(
            "limited",
            QuotaConfig(connections=2),
            access_key=LIMITED_KEY,
            secret_key=LIMITED_SECRET,
        ),
        _account("reader", None),
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("quotas")
    listeners = ("kafka", "amqp", "mqtt", "http", "rocketmq")
    config = dataclasses.replace(server_config(data, listeners), auth=AUTH)
    with live_server(data, listeners, config=config) as s:
        yield s


_ADMIN = Caller(principal=ANONYMOUS, namespace="default", protocol="test")


def _name() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


def _wait(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _http(server: LiveServer) -> str:
    host, port = server.address("http")
    return f"http://{host}:{port}"


def metrics(server: LiveServer) -> dict[tuple[str, str, str], float]:
    """The per-account samples of /metrics: (sample name, account, protocol) -> value."""
    text = httpx.get(_http(server) + "/metrics", timeout=30).text
    return {
        (s.name, s.labels["account"], s.labels["protocol"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("polymq_account_")
        for s in family.samples
    }


def _payload(i: int) -> bytes:
    return f"{i:06d}".encode() + b"x" * (SIZE - 6)


def _kafka(server: LiveServer, user: str, **extra: object) -> dict[str, object]:
    host, port = server.address("kafka")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": user,
        "sasl.password": PASSWORD,
        **extra,
    }


def _pika(server: LiveServer, user: str) -> pika.ConnectionParameters:
    host, port = server.address("amqp")
    return pika.ConnectionParameters(
        host=host, port=port, credentials=pika.PlainCredentials(user, PASSWORD)
    )


# -- rates -------------------------------------------------------------------------


def test_kafka_producer_over_its_quota_gets_throttle_time_and_loses_nothing(
    server: LiveServer,
) -> None:
    topic = _name()
    throttles: list[int] = []
    failures: list[object] = []
    producer = confluent_kafka.Producer(
        _kafka(server, "kprod", throttle_cb=lambda event: throttles.append(event.throttle_time))
    )

    def delivered(err: object, msg: object) -> None:
        if err is not None:
            failures.append(err)

    for i in range(COUNT):
        producer.produce(topic, value=_payload(i), on_delivery=delivered)
    assert producer.flush(TIMEOUT) == 0
    assert failures == []  # throttled, never an error
    deadline = time.monotonic() + TIMEOUT
    while not any(t > 0 for t in throttles) and time.monotonic() < deadline:
        producer.poll(0.1)  # throttle events are served by poll
    assert any(t > 0 for t in throttles), throttles

    consumer = confluent_kafka.Consumer(
        _kafka(server, "reader", **{"group.id": _name(), "enable.auto.commit": False})
    )
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    values: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    while len(values) < COUNT and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            value = msg.value()
            assert value is not None
            values.append(value)
    consumer.close()
    assert values == [_payload(i) for i in range(COUNT)]

    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "kprod", "kafka")] >= 1
    assert seen[("polymq_account_throttle_seconds_total", "kprod", "kafka")] > 0
    assert seen[("polymq_account_produce_bytes_total", "kprod", "kafka")] >= COUNT * SIZE


def test_amqp_publisher_over_its_quota_is_blocked_then_unblocked(server: LiveServer) -> None:
    queue = _name()
    connection = pika.BlockingConnection(_pika(server, "apub"))  # announces connection.blocked
    blocked: list[str] = []
    unblocked: list[bool] = []
    connection.add_on_connection_blocked_callback(
        lambda _conn, frame: blocked.append(frame.method.reason)
    )
    connection.add_on_connection_unblocked_callback(lambda _conn, _frame: unblocked.append(True))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue)
    for i in range(COUNT):
        channel.basic_publish("", queue, _payload(i), mandatory=True)  # raises unless confirmed
    deadline = time.monotonic() + TIMEOUT
    while not unblocked and time.monotonic() < deadline:
        connection.process_data_events(time_limit=0.1)
    assert blocked and "publish rate" in blocked[0]
    assert unblocked
    connection.close()

    reader = pika.BlockingConnection(_pika(server, "reader"))
    got: list[bytes] = []
    ch = reader.channel()
    deadline = time.monotonic() + TIMEOUT
    while len(got) < COUNT and time.monotonic() < deadline:
        _, _, body = ch.basic_get(queue, auto_ack=True)
        if body is not None:
            got.append(body)
    reader.close()
    assert got == [_payload(i) for i in range(COUNT)]
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "apub", "amqp")] >= 1


def test_kafka_consumer_over_its_quota_gets_throttle_time_and_every_record(
    server: LiveServer,
) -> None:
    topic = _name()
    producer = confluent_kafka.Producer(_kafka(server, "reader"))
    for i in range(COUNT):
        producer.produce(topic, value=_payload(i))
    assert producer.flush(TIMEOUT) == 0
    throttles: list[int] = []
    consumer = confluent_kafka.Consumer(
        _kafka(
            server,
            "kcons",
            **{
                "group.id": _name(),
                "enable.auto.commit": False,
                "throttle_cb": lambda event: throttles.append(event.throttle_time),
            },
        )
    )
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    values: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    while (len(values) < COUNT or not any(throttles)) and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is not None and msg.error() is None:
            value = msg.value()
            assert value is not None
            values.append(value)
    consumer.close()
    assert values == [_payload(i) for i in range(COUNT)]
    assert any(t > 0 for t in throttles), throttles
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "kcons", "kafka")] >= 1
    assert seen[("polymq_account_consume_bytes_total", "kcons", "kafka")] >= COUNT * SIZE


def test_amqp_consumer_over_its_quota_gets_every_message_later(server: LiveServer) -> None:
    queue = _name()
    publisher = pika.BlockingConnection(_pika(server, "reader"))
    channel = publisher.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue)
    for i in range(COUNT):
        channel.basic_publish("", queue, _payload(i), mandatory=True)
    publisher.close()
    consumer = pika.BlockingConnection(_pika(server, "asub"))
    ch = consumer.channel()
    ch.basic_qos(prefetch_count=4)  # several turns, each charged what it delivered
    got: list[bytes] = []
    for method, _, body in ch.consume(queue, inactivity_timeout=TIMEOUT):
        assert method is not None and body is not None, f"only {len(got)} of {COUNT} delivered"
        got.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(got) == COUNT:
            break
    ch.cancel()
    consumer.close()
    assert got == [_payload(i) for i in range(COUNT)]
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "asub", "amqp")] >= 1


def test_rocketmq_producer_over_its_quota_gets_too_many_requests(server: LiveServer) -> None:
    topic = _name()
    config = ClientConfiguration(
        f"127.0.0.1:{server.port('rocketmq')}", Credentials(ROCKET_KEY, ROCKET_SECRET), ""
    )
    producer = RocketProducer(config, (topic,))
    producer.startup()
    refused: list[TooManyRequestsException] = []
    try:
        for i in range(COUNT):
            message = RocketMessage()
            message.topic = topic
            message.body = _payload(i)
            deadline = time.monotonic() + TIMEOUT
            while True:  # the Python client gives up on 42900; the application retries
                try:
                    producer.send(message)
                    break
                except TooManyRequestsException as e:
                    refused.append(e)
                    assert time.monotonic() < deadline, "still refused"
                    time.sleep(0.1)
    finally:
        producer.shutdown()
    assert refused and "42900" in str(refused[0])
    stored = server.call(lambda: server.gateway.processor.describe_topic(_ADMIN, topic))
    assert sum(q.latest for q in stored.queues) == COUNT  # every message, once
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "rprod", "rocketmq")] >= 1


def test_mqtt_publisher_over_its_quota_is_read_slowly_and_loses_nothing(
    server: LiveServer,
) -> None:
    topic = f"quota/{_name()}"
    port = server.port("mqtt")
    subscriber = Paho(port, v5=True, username="reader", password=PASSWORD).connect()
    assert subscriber.subscribe(topic, qos=1) == [1]
    publisher = Paho(port, v5=True, username="mpub", password=PASSWORD)
    announced: list[int] = []
    recorded: Any = publisher.client.on_connect

    def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        announced.append(props.ReceiveMaximum)
        recorded(client, userdata, flags, reason, props)

    publisher.client.on_connect = on_connect
    assert publisher.connect().connack == (False, 0)
    assert announced == [8]  # a small Receive Maximum for a rate-limited account
    mids = [publisher.client.publish(topic, _payload(i), qos=1).mid for i in range(COUNT)]
    publisher.wait(lambda: all(m in publisher.published for m in mids), "every PUBACK", TIMEOUT)
    assert all(publisher.published[m] == 0 for m in mids)
    got = subscriber.wait_messages(COUNT)
    assert sorted(m.payload for m in got) == [_payload(i) for i in range(COUNT)]
    assert publisher.disconnects == []
    publisher.disconnect()
    subscriber.disconnect()
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "mpub", "mqtt")] >= 1


def test_mqtt_subscriber_over_its_consume_quota_is_delayed_and_loses_nothing(
    server: LiveServer,
) -> None:
    topic = f"quota/{_name()}"
    port = server.port("mqtt")
    subscriber = Paho(port, v5=True, username="msub", password=PASSWORD).connect()
    assert subscriber.subscribe(topic, qos=1) == [1]
    publisher = Paho(port, v5=True, username="reader", password=PASSWORD).connect()
    mids = [publisher.client.publish(topic, _payload(i), qos=1).mid for i in range(COUNT)]
    publisher.wait(lambda: all(m in publisher.published for m in mids), "every PUBACK", TIMEOUT)
    got = subscriber.wait_messages(COUNT)
    assert [m.payload for m in got] == [_payload(i) for i in range(COUNT)]  # in order
    publisher.disconnect()
    subscriber.disconnect()
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "msub", "mqtt")] >= 1
    assert seen[("polymq_account_consume_bytes_total", "msub", "mqtt")] >= COUNT * SIZE


def test_mns_requests_over_the_quota_get_429_too_many_requests(server: LiveServer) -> None:
    account = Account(_http(server), MNS_KEY, MNS_SECRET)
    queue = account.get_queue(_name())
    queue.create(QueueMeta())
    refused: MNSServerException | None = None
    sent = 0
    for i in range(50):  # one request a second is allowed: a burst is refused at once
        try:
            queue.send_message(MnsMessage(f"m{i}"))
            sent += 1
        except MNSServerException as e:
            refused = e
            break
    assert refused is not None and refused.type == "TooManyRequests", refused
    # The raw answer: 429, MNS's error document and Retry-After.
    resource = f"/queues/{queue.queue_name}"
    headers = sign_headers("GET", resource, access_key=MNS_KEY, secret_key=MNS_SECRET)
    answer = httpx.get(_http(server) + resource, headers=headers, timeout=30)
    assert answer.status_code == 429
    assert "<Code>TooManyRequests</Code>" in answer.text
    assert int(answer.headers["retry-after"]) >= 1
    # Waiting as told, every message sent is there.
    _wait(lambda: _mns_receivable(account, queue.queue_name) == sent, f"{sent} messages")
    seen = metrics(server)
    assert seen[("polymq_account_throttled_total", "mns", "http")] >= 2


def _mns_receivable(account: Account, name: str) -> int | None:
    """The queue's active message count, or None while the account is refused."""
    try:
        return int(account.get_queue(name).get_attributes().active_messages)
    except MNSServerException as e:
        if e.type != "TooManyRequests":
            raise
        time.sleep(0.2)  # as Retry-After asks
        return None


# -- connections -------------------------------------------------------------------


def test_the_connection_too_many_is_refused_with_each_protocols_error(
    server: LiveServer,
) -> None:
    """``limited`` may hold two connections: an AMQP and an MQTT one take them; a
    third is refused by every protocol with its own error, and the two carry on."""
    queue, topic = _name(), f"quota/{_name()}"
    first = pika.BlockingConnection(_pika(server, "limited"))
    channel = first.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue)
    mqtt_first = Paho(server.port("mqtt"), v5=True, username="limited", password=PASSWORD)
    assert mqtt_first.connect().connack == (False, 0)

    # AMQP: connection.close 530 NOT_ALLOWED at connection.open (RabbitMQ's per-user
    # connection limit).
    # (pika names a close at connection.open "probable access denied".)
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as closed:
        pika.BlockingConnection(_pika(server, "limited"))
    assert '(530) "NOT_ALLOWED' in str(closed.value)
    assert "connection limit of 2 reached" in str(closed.value)

    # MQTT: CONNACK 0x97 quota exceeded (v5), 3 server unavailable (3.1.1).
    port = server.port("mqtt")
    v5 = Paho(port, v5=True, username="limited", password=PASSWORD).connect()
    assert v5.connack == (False, 0x97)
    v3 = Paho(port, username="limited", password=PASSWORD).connect()
    assert v3.connack == (False, 0x88)  # paho 2 reports 3.1.1's return code 3 as 0x88
    for refused in (v5, v3):
        refused.client.loop_stop()

    # Kafka: SaslAuthenticate fails with the reason, and the connection closes.
    errors: list[confluent_kafka.KafkaError] = []
    producer = confluent_kafka.Producer(_kafka(server, "limited", error_cb=errors.append))
    deadline = time.monotonic() + TIMEOUT
    while not errors and time.monotonic() < deadline:
        producer.poll(0.1)
    assert errors and errors[0].code() == confluent_kafka.KafkaError._AUTHENTICATION
    assert "connection limit" in errors[0].str()
    del producer

    # MNS: 429 TooManyRequests.
    resource = "/queues"
    headers = sign_headers("GET", resource, access_key=LIMITED_KEY, secret_key=LIMITED_SECRET)
    answer = httpx.get(_http(server) + resource, headers=headers, timeout=30)
    assert answer.status_code == 429
    assert "<Code>TooManyRequests</Code>" in answer.text

    # RocketMQ: the telemetry stream (its connection) is refused, and so are the
    # sends of the client without one: TOO_MANY_REQUESTS.
    rocket = RocketProducer(
        ClientConfiguration(
            f"127.0.0.1:{server.port('rocketmq')}",
            Credentials(LIMITED_KEY, LIMITED_SECRET),
            "",
        ),
        (topic.replace("/", "-"),),
    )
    rocket.startup()
    try:
        message = RocketMessage()
        message.topic = _name()
        message.body = b"refused"
        with pytest.raises(TooManyRequestsException, match="connection limit"):
            rocket.send(message)
    finally:
        rocket.shutdown()

    # The two connections holding the slots carry on.
    channel.basic_publish("", queue, b"still here", mandatory=True)
    assert mqtt_first.publish(topic, b"still here", qos=1) == 0
    first.close()
    mqtt_first.disconnect()
    # A slot freed is a slot taken again.
    _wait(lambda: _connections(server, "limited") == 0, "the slots to be given back")
    again = pika.BlockingConnection(_pika(server, "limited"))
    again.close()

    seen = metrics(server)
    for protocol in ("amqp", "mqtt", "kafka", "http", "rocketmq"):
        assert seen[("polymq_account_connections_refused_total", "limited", protocol)] >= 1


def _connections(server: LiveServer, account: str) -> float:
    """The account's open connections, as /metrics shows them."""
    return sum(
        value
        for (name, who, _), value in metrics(server).items()
        if name == "polymq_account_connections" and who == account
    )


# -- open mode ---------------------------------------------------------------------


def test_open_mode_default_quota_limits_the_anonymous_principal(
    tmp_path: Path, server_form: str
) -> None:
    """With no accounts everyone is ``anonymous``; ``[quotas.default]`` (set here as a
    flag or environment variable would set it) then limits them all together."""
    overrides = {"quotas.default.requests_per_s": "1"}
    with live_server(tmp_path, ("http",), overrides=overrides) as open_server:
        base = _http(open_server)
        answers = [httpx.get(base + "/queues", timeout=30) for _ in range(20)]
        codes = [a.status_code for a in answers]
        assert codes[0] == 200 and 429 in codes, codes
        refused = answers[codes.index(429)]
        assert "<Code>TooManyRequests</Code>" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
