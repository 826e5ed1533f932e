"""The cost of TLS: the same scenarios over a plaintext listener and its TLS twin of
one polymq server, in the same run, with the ratios.

- Kafka: confluent-kafka produce, 100 B records, acks=all, linger 5 ms, one
  partition, over ``kafka`` (PLAINTEXT) and ``kafka_tls`` (SSL, server authenticated).
- MQTT: paho QoS 1, one publisher and one subscriber, 100 B, over ``mqtt`` and
  ``mqtts``.

Each row prints msgs/s and the server's CPU µs per message (its process's user+system
time over the scenario, divided by the messages). Certificates are made for the run
with trustme (ECDSA P-256, TLS 1.3 negotiated by both clients); the order of the
plaintext and TLS rows alternates over ``--rounds`` so neither always runs on a
warmer server.

    .venv/bin/python -m bench.tls [--rounds 2] [--kafka-count 200000] [--mqtt-count 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import ssl
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import trustme
from confluent_kafka import KafkaError, Producer
from paho.mqtt.enums import CallbackAPIVersion

from bench._server import HOST, Meter, _polymq_env, free_port, process_server

PAYLOAD = 100
SCENARIO_LIMIT_S = 60.0
LISTENERS = ("kafka", "kafka_tls", "mqtt", "mqtts")

Row = dict[str, Any]


@contextlib.contextmanager
def tls_polymq(
    folder: Path, ca: trustme.CA | None = None
) -> Iterator[tuple[dict[str, int], int, Path]]:
    """``polymq run`` with the four listeners on free ports and [tls] from a fresh
    certificate of ``ca`` (a new CA by default) in ``folder`` (``server.pem``,
    ``server.key``: replace them and send SIGHUP to reload); yields the ports, the
    server's pid and the CA file."""
    ca = ca or trustme.CA()
    ca_file = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf = ca.issue_cert(HOST, "localhost")
    chain, key = folder / "server.pem", folder / "server.key"
    for i, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(str(chain), append=i > 0)
    leaf.private_key_pem.write_to_path(str(key))
    settings = {"tls.cert_file": str(chain), "tls.key_file": str(key)}
    env = _polymq_env(LISTENERS, settings)
    ports = {name: free_port() for name in LISTENERS}
    data_dir = folder / "data"
    command = [sys.executable, "-m", "polymq.gateway", "run", "--data-dir", str(data_dir)]
    command += ["--durability", "sync", "--log-level", "warning"]
    for name, port in ports.items():
        command += [f"--{name.replace('_', '-')}-port", str(port)]
    # mqtts starts last of the four (the listener table's order): all listen then.
    with process_server(command, ports["mqtts"], env=env) as server:
        assert server.pid is not None
        yield ports, server.pid, ca_file


def kafka_produce(port: int, count: int, tls: dict[str, str]) -> tuple[int, float]:
    producer = Producer(
        {
            "bootstrap.servers": f"{HOST}:{port}",
            "acks": "all",
            "linger.ms": 5,
            "queue.buffering.max.messages": 1_000_000,
            **tls,
        }
    )
    topic = f"tls-bench-{uuid.uuid4().hex[:8]}"
    value = b"x" * PAYLOAD
    delivered = 0

    def on_delivery(error: KafkaError | None, _: object) -> None:
        nonlocal delivered
        if error is None:
            delivered += 1

    # The first record waits for the connection, the handshake and topic creation:
    # outside the timed part, as in bench/kafka.py's warm-up.
    producer.produce(topic, value=value, partition=0)
    producer.flush(SCENARIO_LIMIT_S)
    start = time.perf_counter()
    sent = 0
    while sent < count and time.perf_counter() - start < SCENARIO_LIMIT_S:
        try:
            producer.produce(topic, value=value, partition=0, on_delivery=on_delivery)
            sent += 1
        except BufferError:
            producer.poll(0.01)
    producer.flush(SCENARIO_LIMIT_S)
    return delivered, time.perf_counter() - start


def _mqtt_client(port: int, context: ssl.SSLContext | None) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"b-{uuid.uuid4().hex[:10]}")
    client.max_inflight_messages_set(100)
    client.max_queued_messages_set(0)
    if context is not None:
        client.tls_set_context(context)
    connected = threading.Event()
    client.on_connect = lambda *args: connected.set()
    client.connect(HOST, port, keepalive=120)
    client.loop_start()
    if not connected.wait(30):
        raise RuntimeError("no CONNACK")
    return client


def mqtt_qos1(port: int, count: int, context: ssl.SSLContext | None) -> tuple[int, float]:
    """One publisher, one subscriber at QoS 1: every message PUBACKed and delivered."""
    received = 0
    done = threading.Condition()

    def on_message(*_: Any) -> None:
        nonlocal received
        with done:
            received += 1
            done.notify_all()

    subscribed = threading.Event()
    sub = _mqtt_client(port, context)
    sub.on_message = on_message
    sub.on_subscribe = lambda *args: subscribed.set()
    topic = f"tls-bench/{uuid.uuid4().hex[:8]}"
    sub.subscribe(topic, 1)
    if not subscribed.wait(30):
        raise RuntimeError("no SUBACK")
    pub = _mqtt_client(port, context)
    payload = b"x" * PAYLOAD
    start = time.perf_counter()
    infos = [pub.publish(topic, payload, 1) for _ in range(count)]
    for info in infos:
        info.wait_for_publish(SCENARIO_LIMIT_S)
    with done:
        done.wait_for(lambda: received >= count, SCENARIO_LIMIT_S)
    seconds = time.perf_counter() - start
    for client in (pub, sub):
        client.disconnect()
        client.loop_stop()
    return received, seconds


def measure(meter: Meter, scenario: str, run: Callable[[], tuple[int, float]]) -> Row:
    cpu0 = meter.cpu()
    messages, seconds = run()
    cpu = meter.cpu() - cpu0
    row: Row = {
        "scenario": scenario,
        "messages": messages,
        "msgs_per_s": round(messages / seconds) if seconds else 0,
        "server_cpu_us_per_msg": round(cpu * 1e6 / messages, 1) if messages else None,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kafka-count", type=int, default=200_000)
    parser.add_argument("--mqtt-count", type=int, default=10_000)
    args = parser.parse_args()
    print(f"# TLS cost ({ssl.OPENSSL_VERSION}), {PAYLOAD} B payloads, sync durability")
    with (
        tempfile.TemporaryDirectory(prefix="polymq-bench-tls-") as temp,
        tls_polymq(Path(temp)) as (ports, pid, ca_file),
    ):
        meter = Meter(pid)
        client_tls = ssl.create_default_context(cafile=str(ca_file))
        kafka_ssl = {"security.protocol": "SSL", "ssl.ca.location": str(ca_file)}
        scenarios: dict[str, Callable[[], tuple[int, float]]] = {
            "kafka produce plaintext": lambda: kafka_produce(ports["kafka"], args.kafka_count, {}),
            "kafka produce SSL": lambda: kafka_produce(
                ports["kafka_tls"], args.kafka_count, kafka_ssl
            ),
            "mqtt qos1 plaintext": lambda: mqtt_qos1(ports["mqtt"], args.mqtt_count, None),
            "mqtt qos1 TLS": lambda: mqtt_qos1(ports["mqtts"], args.mqtt_count, client_tls),
        }
        rows: dict[str, list[Row]] = {name: [] for name in scenarios}
        names = list(scenarios)
        for round_ in range(args.rounds):
            pairs = [names[0:2], names[2:4]]
            for pair in pairs:
                for name in pair if round_ % 2 == 0 else reversed(pair):
                    rows[name].append(measure(meter, name, scenarios[name]))
    print("# TLS / plaintext (best of the rounds each)")
    for plain, secure in (names[0:2], names[2:4]):
        best_plain = max(rows[plain], key=lambda r: r["msgs_per_s"])
        best_tls = max(rows[secure], key=lambda r: r["msgs_per_s"])
        cpu_plain = min(r["server_cpu_us_per_msg"] or 0 for r in rows[plain])
        cpu_tls = min(r["server_cpu_us_per_msg"] or 0 for r in rows[secure])
        ratio = {
            "scenario": secure,
            "msgs_per_s": [best_plain["msgs_per_s"], best_tls["msgs_per_s"]],
            "ratio_msgs_per_s": round(best_tls["msgs_per_s"] / best_plain["msgs_per_s"], 2)
            if best_plain["msgs_per_s"]
            else None,
            "server_cpu_us_per_msg": [cpu_plain, cpu_tls],
            "ratio_cpu_per_msg": round(cpu_tls / cpu_plain, 2) if cpu_plain else None,
        }
        print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
