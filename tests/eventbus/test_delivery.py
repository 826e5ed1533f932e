"""Delivery: a matching event arrives as a native message at a real Kafka consumer, a
pika consumer (exchange ``T``, the natural mapping), a paho subscriber and an MNS
queue; at a local webhook in structured and binary mode (checked with the
CloudEvents SDK), transformed; retries end in the dead-letter target; messages other
protocols store in a bus's source topic are events; replay from the archive."""

from __future__ import annotations

import json
import queue
import time

import httpx
import paho.mqtt.client as mqtt
import pika
from cloudevents.core.bindings import http as ce_http
from kafka import KafkaProducer
from paho.mqtt.enums import CallbackAPIVersion

from tests.eventbus.harness import WAIT_S, Webhook, kafka_read, post_binary, put_rule, run_id
from tests.live_server import LiveServer


def test_an_event_reaches_kafka_amqp_mqtt_and_mns_consumers(
    server: LiveServer, client: httpx.Client
) -> None:
    run = run_id()
    topic, mns_queue = f"orders-{run}", f"q-{run}"
    assert client.put(f"/queues/{mns_queue}", content=b"").status_code in (201, 204)
    put_rule(
        client,
        "default",
        f"fan-{run}",
        {
            "pattern": {"type": ["order.created"], "data": {"shop": [run]}},
            "targets": [
                {"id": "topic", "type": "topic", "name": topic},
                {"id": "queue", "type": "queue", "name": mns_queue},
            ],
        },
    )
    # AMQP: a queue of the application's own, bound to exchange `topic`.
    amqp = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", server.port("amqp")))
    channel = amqp.channel()
    channel.exchange_declare(topic, "fanout")
    amqp_queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(amqp_queue, topic)
    # MQTT: a subscriber of `topic`.
    got: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    subscribed = queue.Queue[int]()
    paho = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    paho.on_message = lambda c, u, m: got.put(m)
    paho.on_subscribe = lambda c, u, mid, codes, p: subscribed.put(mid)
    paho.connect("127.0.0.1", server.port("mqtt"))
    paho.loop_start()
    try:
        paho.subscribe(f"{topic}/#", qos=1)
        subscribed.get(timeout=WAIT_S)
        post_binary(client, "default", "order.created", b'{"shop":"other"}')
        post_binary(
            client,
            "default",
            "order.created",
            json.dumps({"shop": run}).encode(),
            id=f"e-{run}",
            subject="order-1",
        )

        record = kafka_read(server.port("kafka"), topic, 1)[0]
        assert json.loads(record.value) == {"shop": run}
        assert dict(record.headers)["ce_id"] == f"e-{run}".encode()

        body = None
        deadline = time.monotonic() + WAIT_S
        while body is None and time.monotonic() < deadline:
            _method, properties, body = channel.basic_get(amqp_queue, auto_ack=True)
            if body is None:
                amqp.sleep(0.2)
        assert body is not None, "nothing reached the AMQP queue"
        assert json.loads(body) == {"shop": run}
        assert properties.content_type == "application/json"
        assert properties.headers["ce_type"] in (b"order.created", "order.created")

        message = got.get(timeout=WAIT_S)
        assert json.loads(message.payload) == {"shop": run}
        user = dict(getattr(message.properties, "UserProperty", []))
        assert user["ce_id"] == f"e-{run}"

        received = client.get(f"/queues/{mns_queue}/messages", params={"waitseconds": 10})
        assert received.status_code == 200, received.text
        assert run in received.text
    finally:
        paho.loop_stop()
        paho.disconnect()
        amqp.close()


def test_webhooks_structured_binary_and_transformed(client: httpx.Client) -> None:
    run = run_id()
    hook = Webhook()
    try:
        put_rule(
            client,
            "default",
            f"hooks-{run}",
            {
                "pattern": {"source": [f"/hooks/{run}"]},
                "targets": [
                    {"id": "s", "type": "http", "endpoint": f"{hook.url}/s"},
                    {"id": "b", "type": "http", "endpoint": f"{hook.url}/b", "mode": "binary"},
                    {
                        "id": "t",
                        "type": "http",
                        "endpoint": f"{hook.url}/t",
                        "input": {
                            "paths": {"who": "$.data.user.name", "kind": "$.type"},
                            "template": "<who> did <kind>",
                        },
                    },
                ],
            },
        )
        data = {"user": {"name": "ann"}, "n": 1}
        post_binary(
            client,
            "default",
            "user.login",
            json.dumps(data).encode(),
            source=f"/hooks/{run}",
            id=f"w-{run}",
            traceparent="00-abc-def-01",
        )
        received = hook.wait_for(3)
        by_target = {}
        for headers, body in received:
            event = ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=body))
            by_target[headers["x-test-path"].rsplit("/", 1)[1]] = (headers, event)
        headers, structured = by_target["s"]
        assert headers["content-type"].startswith("application/cloudevents+json")
        assert structured.get_id() == f"w-{run}"
        assert structured.get_data() == data
        assert structured.get_extension("traceparent") == "00-abc-def-01"
        headers, binary = by_target["b"]
        assert headers["ce-id"] == f"w-{run}"
        assert headers["content-type"] == "application/json"
        assert binary.get_id() == f"w-{run}"
        assert binary.get_data() == data  # the SDK decodes JSON data
        _, templated = by_target["t"]
        assert templated.get_data() == "ann did user.login"
        assert str(templated.get_datacontenttype()).startswith("text/plain")
    finally:
        hook.close()


def test_retries_end_in_the_dead_letter_target(server: LiveServer, client: httpx.Client) -> None:
    run = run_id()
    hook = Webhook(fail=1_000)
    try:
        put_rule(
            client,
            "default",
            f"dlq-{run}",
            {
                "pattern": {"type": [f"dlq.{run}"]},
                "targets": [
                    {
                        "id": "down",
                        "type": "http",
                        "endpoint": hook.url,
                        "retry": {"maximum_attempts": 3, "backoff_ms": 50},
                    }
                ],
                "dead_letter": {"type": "topic", "name": f"dead-{run}"},
            },
        )
        post_binary(client, "default", f"dlq.{run}", b'{"x":1}', id=f"d-{run}")
        record = kafka_read(server.port("kafka"), f"dead-{run}", 1)[0]
        headers = dict(record.headers)
        assert headers["ce_id"] == f"d-{run}".encode()
        assert headers["ce_deadlettertarget"] == b"down"
        assert headers["ce_deadletterreason"] == b"HTTP 500"
        assert len(hook.wait_for(3)) == 3  # every attempt was made before giving up
    finally:
        hook.close()


def test_other_protocols_messages_are_events_of_a_bus(
    server: LiveServer, client: httpx.Client
) -> None:
    run = run_id()
    bus, source, out = f"src-{run}", f"sensors-{run}", f"hot-{run}"
    assert client.put(f"/buses/{bus}", json={"sources": [source]}).status_code == 201
    put_rule(
        client,
        bus,
        "hot",
        {
            "pattern": {
                # Kafka's key, AMQP's routing key, MQTT's topic name: the subject.
                "subject": [{"prefix": "room-"}, {"prefix": f"{source}/room-"}],
                "data": {"t": [{"numeric": [">=", 30]}]},
            },
            "targets": [{"id": "t", "type": "topic", "name": out}],
        },
    )
    producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{server.port('kafka')}")
    try:
        producer.send(source, key=b"room-1", value=b'{"t": 31}', headers=[("site", b"north")])
        producer.send(source, key=b"room-2", value=b'{"t": 12}')
        producer.send(source, key=b"hall", value=b'{"t": 40}')
        producer.flush(timeout=WAIT_S)
    finally:
        producer.close()
    amqp = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", server.port("amqp")))
    try:
        channel = amqp.channel()
        channel.exchange_declare(source, "topic")
        properties = pika.BasicProperties(headers={"site": "south"})
        channel.basic_publish(source, "room-7", b'{"t": 32}', properties)
        channel.basic_publish(source, "room-8", b'{"t": 3}')
    finally:
        amqp.close()
    paho = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    paho.connect("127.0.0.1", server.port("mqtt"))
    paho.loop_start()
    try:
        paho.publish(f"{source}/room-9", b'{"t": 33}', qos=1).wait_for_publish(WAIT_S)
        paho.publish(f"{source}/hall", b'{"t": 50}', qos=1).wait_for_publish(WAIT_S)
    finally:
        paho.loop_stop()
        paho.disconnect()
    records = kafka_read(server.port("kafka"), out, 3)
    by_subject = {r.key: r for r in records}
    assert set(by_subject) == {b"room-1", b"room-7", f"{source}/room-9".encode()}
    kafka = dict(by_subject[b"room-1"].headers)
    assert by_subject[b"room-1"].value == b'{"t": 31}'
    assert kafka["ce_type"] == b"com.polymq.message"
    assert kafka["ce_source"] == f"polymq://default/topics/{source}".encode()
    assert kafka["ce_site"] == b"north"
    assert dict(by_subject[b"room-7"].headers)["ce_site"] == b"south"
    assert len(kafka_read(server.port("kafka"), out, 3, timeout=2.0)) == 3  # no more came


def test_replay_sends_archived_events_through_the_bus_again(
    server: LiveServer, client: httpx.Client
) -> None:
    run = run_id()
    bus, out = f"replay-{run}", f"replayed-{run}"
    assert client.put(f"/buses/{bus}").status_code == 201
    seen = {
        "pattern": {"type": ["early"]},
        "targets": [{"id": "t", "type": "topic", "name": f"seen-{run}"}],
    }
    put_rule(client, bus, "seen", seen)
    start = int(time.time() * 1000) - 60_000
    post_binary(client, bus, "early", b"1", id="before-the-rule")
    kafka_read(server.port("kafka"), f"seen-{run}", 1)  # dispatched before rule "all" was
    put_rule(
        client,
        bus,
        "all",
        {"pattern": {"type": ["early"]}, "targets": [{"id": "t", "type": "topic", "name": out}]},
    )
    response = client.post(
        f"/buses/{bus}/replays", json={"start": start, "end": int(time.time() * 1000) + 1000}
    )
    assert response.status_code == 200, response.text
    assert response.json()["replayed"] == 1
    record = kafka_read(server.port("kafka"), out, 1)[0]
    headers = dict(record.headers)
    assert headers["ce_id"] == b"before-the-rule"
    assert headers["ce_replayname"] == response.json()["name"].encode()
    bad = client.post(f"/buses/{bus}/replays", json={"start": "soon", "end": 1})
    assert bad.status_code == 400 and "start" in bad.json()["message"]
