"""``polymq run --workers 2`` when processes die: a worker killed with SIGKILL is
restarted by the parent on the same ports (its own Kafka port too), clients
reconnect (to either worker) and nothing acknowledged is lost (AMQP confirms, Kafka
acks=all); SIGTERM of the parent stops every worker and exits 0; a parent killed
with SIGKILL takes its workers with it (no worker is left holding the shared
ports)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pika
import pytest
from confluent_kafka import Consumer

from tests.mqtt.helpers import Paho
from tests.workers.helpers import (
    TIMEOUT,
    Workers,
    consume_values,
    owner_pid,
    produce_values,
    running_workers,
    source_port_on,
    wait_until,
)

ONE_FORM = True  # starts its own server processes


def _paho_on(workers: Workers, client_id: str, pid: int, *, other_than: bool = False) -> Paho:
    """A paho client (persistent session) connected once, to worker ``pid`` (or not)."""
    client = Paho(workers.port("mqtt"), client_id=client_id, clean=False)
    port = source_port_on(workers, "mqtt", pid, other_than=other_than)
    client.client.connect("127.0.0.1", workers.port("mqtt"), bind_port=port)
    client.client.loop_start()
    client.wait(lambda: client.connack is not None, "CONNACK")
    return client


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _amqp_on(workers: Workers, pid: int) -> pika.BlockingConnection:
    """A pika connection served by worker ``pid`` (connections elsewhere closed)."""
    for _ in range(64):
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", workers.port("amqp"), heartbeat=0)
        )
        port = connection._impl._transport._sock.getsockname()[1]
        if owner_pid(port, workers.port("amqp"), [pid]) == pid:
            return connection
        connection.close()
    raise AssertionError(f"no connection landed on worker {pid}")


def _publish(connection: pika.BlockingConnection, queue: str, values: range) -> None:
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()  # each publish returns once confirmed
    for i in values:
        channel.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))


def test_killed_worker_is_restarted_and_nothing_acknowledged_is_lost(tmp_path: Path) -> None:
    queue, topic = f"q-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    with running_workers(tmp_path / "data") as workers:
        victim = workers.pids["worker-1"]
        before = _amqp_on(workers, victim)
        _publish(before, queue, range(50))
        produce_values(workers, topic, range(100))
        mark = len(workers.lines)
        os.kill(victim, signal.SIGKILL)
        workers.wait_line(r"worker-1 exited \(killed by SIGKILL\)", "the exit", after=mark)
        workers.wait_line(r"worker-1 restarted \(pid \d+", "the restart", after=mark)
        own = workers.kafka_ports["worker-1"]  # Kafka clients know it as a broker there
        workers.wait_line(
            rf"\[worker-1\] .*listener kafka: 127\.0\.0\.1:{own}$", "its own port", after=mark
        )
        reborn = workers.pids["worker-1"]
        assert reborn != victim and not _alive(victim) and _alive(reborn)
        with pytest.raises(pika.exceptions.AMQPError):  # its connection died with it
            before.channel()
        after = _amqp_on(workers, reborn)  # the restarted worker serves the shared port
        _publish(after, queue, range(50, 100))
        produce_values(workers, topic, range(100, 200))

        got: list[int] = []
        channel = after.channel()
        while len(got) < 100:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            got.append(int(body))
        after.close()
        assert sorted(got) == list(range(100))

        consumer = Consumer(
            {
                "bootstrap.servers": f"127.0.0.1:{workers.port('kafka')}",
                "group.id": f"g-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
            }
        )
        consumer.subscribe([topic])
        records = consume_values(consumer, 200, distinct=True)
        consumer.close()
        assert set(records) == set(range(200))


def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    with running_workers(tmp_path / "data") as workers:
        pids = list(workers.pids.values())
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(TIMEOUT) == 0
        wait_until(lambda: not any(_alive(pid) for pid in pids), "every worker gone")


def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    with running_workers(tmp_path / "data") as workers:
        pids = list(workers.pids.values())
        workers.process.kill()
        workers.process.wait(TIMEOUT)
        wait_until(lambda: not any(_alive(pid) for pid in pids), "every worker gone")


def test_mqtt_session_outlives_its_killed_worker(tmp_path: Path) -> None:
    """A persistent session connected to the worker that is killed: the QoS 1
    messages published (and acknowledged by the other worker) while it is down reach
    the client when it reconnects, on whichever worker."""
    topic, client_id = f"k/{uuid.uuid4().hex[:8]}", f"kept-{uuid.uuid4().hex[:8]}"
    with running_workers(tmp_path / "data") as workers:
        victim = workers.pids["worker-1"]
        subscriber = _paho_on(workers, client_id, victim)
        assert subscriber.subscribe(topic, qos=1) == [1]
        subscriber.client.reconnect_delay_set(60, 60)  # we reconnect it ourselves
        mark = len(workers.lines)
        os.kill(victim, signal.SIGKILL)
        subscriber.wait(lambda: bool(subscriber.disconnects), "the connection lost")
        subscriber.client.loop_stop()
        publisher = _paho_on(workers, f"pub-{uuid.uuid4().hex[:8]}", victim, other_than=True)
        for i in range(5):
            assert publisher.publish(topic, f"m{i}".encode(), qos=1) == 0  # PUBACK: stored
        publisher.disconnect()
        workers.wait_line(r"worker-1 restarted \(pid \d+", "the restart", after=mark)
        again = Paho(workers.port("mqtt"), client_id=client_id, clean=False).connect()
        try:
            assert again.connack == (True, 0)
            received = again.wait_messages(5, "the messages published while it was down")
            assert sorted({m.payload for m in received}) == [f"m{i}".encode() for i in range(5)]
        finally:
            again.disconnect()
