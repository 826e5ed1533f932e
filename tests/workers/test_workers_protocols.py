"""``polymq run --workers 2`` with real clients: the connections really are spread
over both worker processes (the kernel's SO_REUSEPORT choice, read from /proc), and
state one gateway kept in memory works across workers as it does across gateways of
the separated form: a persistent MQTT session picked up on the other worker with its
queued QoS 1 messages, a client-id takeover from the other worker, an AMQP publisher
on one worker and its consumer on the other, MNS over HTTP. It is the same data as
``--workers 1``: what two workers stored, one process serves after a restart."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.mqtt.helpers import Paho
from tests.workers.helpers import (
    Workers,
    owner_pid,
    running_workers,
    source_port_on,
    wait_until,
)

ONE_FORM = True  # starts its own server processes, not tests.live_server's forms
_MAX_TRIES = 64  # connections opened at most to land on a given worker (2**-63 odds)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with running_workers(tmp_path_factory.mktemp("workers") / "data") as running:
        yield running


def _pika_owner(workers: Workers, connection: pika.BlockingConnection) -> int | None:
    sock = connection._impl._transport._sock
    return owner_pid(sock.getsockname()[1], workers.port("amqp"), list(workers.pids.values()))


def _paho_owner(workers: Workers, client: Paho) -> int | None:
    sock: Any = client.client.socket()
    return owner_pid(sock.getsockname()[1], workers.port("mqtt"), list(workers.pids.values()))


def _pika_on(
    workers: Workers, pid: int | None, *, other_than: bool = False
) -> pika.BlockingConnection:
    """A pika connection served by worker ``pid`` (or by any other one)."""
    for _ in range(_MAX_TRIES):
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", workers.port("amqp"), heartbeat=0)
        )
        owner = _pika_owner(workers, connection)
        if pid is None or (owner != pid if other_than else owner == pid):
            return connection
        connection.close()
    raise AssertionError(f"no connection landed {'off' if other_than else 'on'} worker {pid}")


def _paho_on(
    workers: Workers, client_id: str, pid: int, *, other_than: bool = False, **kwargs: Any
) -> Paho:
    """A connected paho client with ``client_id`` served by worker ``pid`` (or by
    another one), connecting once: from a source port that lands there."""
    port = source_port_on(workers, "mqtt", pid, other_than=other_than)
    client = Paho(workers.port("mqtt"), client_id=client_id, **kwargs)
    client.client.connect("127.0.0.1", workers.port("mqtt"), bind_port=port)
    client.client.loop_start()
    client.wait(lambda: client.connack is not None, "CONNACK")
    assert (
        _paho_owner(workers, client) != pid if other_than else _paho_owner(workers, client) == pid
    )
    return client


def test_connections_spread_over_both_workers(workers: Workers) -> None:
    seen: set[int] = set()
    connections = []
    try:
        for _ in range(_MAX_TRIES):
            connection = pika.BlockingConnection(
                pika.ConnectionParameters("127.0.0.1", workers.port("amqp"), heartbeat=0)
            )
            connections.append(connection)
            owner = _pika_owner(workers, connection)
            assert owner is not None and owner in workers.pids.values()
            seen.add(owner)
            if len(seen) == len(workers.pids):
                break
        assert seen == set(workers.pids.values())
    finally:
        for connection in connections:
            connection.close()


def test_amqp_publisher_on_one_worker_consumer_on_the_other(workers: Workers) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    publisher = _pika_on(workers, None)
    consumer = _pika_on(workers, _pika_owner(workers, publisher), other_than=True)
    try:
        channel = publisher.channel()
        channel.queue_declare(queue, durable=True)
        channel.confirm_delivery()
        for i in range(20):
            channel.basic_publish("", queue, str(i).encode())
        got: list[int] = []
        receiving = consumer.channel()
        receiving.basic_qos(prefetch_count=5)

        def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
            got.append(int(body))
            ch.basic_ack(method.delivery_tag)

        receiving.basic_consume(queue, on_message)
        wait_until(lambda: (consumer.process_data_events(0.05), len(got) >= 20)[1], "20 messages")
        assert sorted(got) == list(range(20))
    finally:
        publisher.close()
        consumer.close()


def test_amqp_exclusive_queue_is_its_connections_on_every_worker(workers: Workers) -> None:
    """An exclusive queue declared on one worker is refused (405) to a connection
    served by the other, as to another connection of the same gateway."""
    owner = _pika_on(workers, None)
    other = _pika_on(workers, _pika_owner(workers, owner), other_than=True)
    try:
        queue = f"x-{uuid.uuid4().hex[:8]}"
        owner.channel().queue_declare(queue, exclusive=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            other.channel().queue_declare(queue, passive=True, exclusive=True)
        assert refused.value.reply_code == 405
    finally:
        owner.close()
        other.close()


def test_mqtt_persistent_session_moves_to_the_other_worker(workers: Workers) -> None:
    topic = f"w/{uuid.uuid4().hex[:8]}"
    client_id = f"persistent-{uuid.uuid4().hex[:8]}"
    first = workers.pids["worker-1"]
    subscriber = _paho_on(workers, client_id, first, clean=False)
    assert subscriber.subscribe(topic, qos=1) == [1]
    subscriber.disconnect()
    publisher = Paho(workers.port("mqtt")).connect()
    for i in range(5):
        assert publisher.publish(topic, f"m{i}".encode(), qos=1) == 0
    publisher.disconnect()
    again = _paho_on(workers, client_id, first, other_than=True, clean=False)
    try:
        assert again.connack == (True, 0)  # session present, on the other worker
        received = again.wait_messages(5, "the queued QoS 1 messages")
        assert sorted(m.payload for m in received) == [f"m{i}".encode() for i in range(5)]
    finally:
        again.disconnect()


def test_mqtt_client_id_takeover_across_workers(workers: Workers) -> None:
    client_id = f"taken-{uuid.uuid4().hex[:8]}"
    first_pid = workers.pids["worker-1"]
    first = _paho_on(workers, client_id, first_pid)
    first.client.reconnect_delay_set(60, 60)  # paho must not win it back meanwhile
    second = _paho_on(workers, client_id, first_pid, other_than=True)
    try:
        first.wait(lambda: bool(first.disconnects), "the first connection closed by the takeover")
        assert second.connack is not None and second.connack[1] == 0
    finally:
        first.client.loop_stop()
        second.disconnect()


def _mns(workers: Workers, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{workers.port('http')}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read()
        return json.loads(text) if text else response.status


def test_mns_round_trips_over_http(workers: Workers) -> None:
    queue = f"mns-{uuid.uuid4().hex[:8]}"
    assert _mns(workers, "PUT", f"/queues/{queue}") == 201
    for i in range(10):  # ten requests, ten connections: both workers serve some
        _mns(workers, "POST", f"/queues/{queue}/messages", {"MessageBody": f"b{i}"})
    bodies = []
    for _ in range(10):
        reply = _mns(workers, "GET", f"/queues/{queue}/messages?waitseconds=5")
        bodies.append(reply["MessageBody"])
        handle = urllib.parse.quote(reply["ReceiptHandle"])
        assert _mns(workers, "DELETE", f"/queues/{queue}/messages?ReceiptHandle={handle}") == 204
    assert sorted(bodies) == sorted(f"b{i}" for i in range(10))


def test_the_same_data_as_one_process(tmp_path: Path) -> None:
    """What two workers stored, ``--workers 1`` (today's single process) serves."""
    data = tmp_path / "data"
    with running_workers(data) as two:
        connection = _pika_on(two, None)
        channel = connection.channel()
        channel.queue_declare("kept", durable=True)
        channel.confirm_delivery()
        channel.basic_publish(
            "", "kept", b"stored by two workers", pika.BasicProperties(delivery_mode=2)
        )
        connection.close()
    with running_workers(data, 1) as one:
        assert not one.pids  # one process: no workers
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", one.port("amqp"), heartbeat=0)
        )
        try:
            method, _, body = connection.channel().basic_get("kept", auto_ack=True)
            assert method is not None and body == b"stored by two workers"
        finally:
            connection.close()
