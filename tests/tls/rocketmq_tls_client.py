"""rocketmq-python-client over TLS, in a process of its own: grpc reads the roots it
trusts (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH) once per process, and the client's
``tls_enable`` uses grpc's default channel credentials.

Usage: python -m tests.tls.rocketmq_tls_client ENDPOINT AK SK NAMESPACE TOPIC.
Sends one message and receives it with a simple consumer; prints JSON."""

from __future__ import annotations

import json
import sys
import time

from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

TIMEOUT_S = 60.0


def main(endpoint: str, ak: str, sk: str, namespace: str, topic: str) -> None:
    config = ClientConfiguration(endpoint, Credentials(ak, sk), namespace)
    producer = Producer(config, (topic,), tls_enable=True)
    producer.startup()
    try:
        message = Message()
        message.topic = topic
        message.body = b"over grpc tls"
        receipt = producer.send(message)
    finally:
        producer.shutdown()
    consumer = SimpleConsumer(
        config, f"g-{topic}", {topic: FilterExpression()}, await_duration=3, tls_enable=True
    )
    consumer.startup()
    bodies: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not bodies and time.monotonic() < deadline:
            for got in consumer.receive(16, 30):
                bodies.append(got.body.decode())
                consumer.ack(got)
    finally:
        consumer.shutdown()
    print(json.dumps({"sent": receipt.message_id is not None, "received": bodies}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
