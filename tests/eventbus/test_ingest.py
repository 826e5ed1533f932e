"""CloudEvents ingest over HTTP with the official SDK (binary and structured mode),
httpx and curl (batches), the spec's checks as 400s naming the problem, and the
bus/rule API; what is ingested is read back from a rule's target topic with a real
Kafka consumer (binary-mode Kafka binding: ``ce_`` headers)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent

from tests.eventbus.harness import kafka_read, put_rule, run_id
from tests.live_server import LiveServer


def _headers(record: object) -> dict[str, bytes]:
    return {name: value for name, value in record.headers}  # type: ignore[attr-defined]


def test_sdk_binary_and_structured_events_reach_a_topic(
    server: LiveServer, client: httpx.Client
) -> None:
    run = run_id()
    topic = f"ingested-{run}"
    put_rule(
        client,
        "default",
        f"sdk-{run}",
        {
            "pattern": {"source": [f"/sdk/{run}"], "data": {"n": [{"numeric": [">", 0]}]}},
            "targets": [{"id": "t", "type": "topic", "name": topic}],
        },
    )
    binary = CloudEvent(
        {"type": "com.example.b", "source": f"/sdk/{run}", "subject": "s1", "region": "eu"},
        {"n": 1},
    )
    message = ce_http.to_binary_event(binary)
    response = client.post("/buses/default/events", headers=message.headers, content=message.body)
    assert response.status_code == 202, response.text
    assert response.json()["events"][0]["id"] == binary.get_id()
    structured = CloudEvent({"type": "com.example.s", "source": f"/sdk/{run}"}, {"n": 2})
    message = ce_http.to_structured_event(structured)
    response = client.post("/buses/default/events", headers=message.headers, content=message.body)
    assert response.status_code == 202, response.text
    # n = 0 does not match the rule: it must not arrive.
    ignored = CloudEvent({"type": "com.example.s", "source": f"/sdk/{run}"}, {"n": 0})
    message = ce_http.to_structured_event(ignored)
    assert client.post("/buses/default/events", headers=message.headers, content=message.body)

    records = kafka_read(server.port("kafka"), topic, 2)
    by_id = {_headers(r)["ce_id"].decode(): r for r in records}
    assert set(by_id) == {binary.get_id(), structured.get_id()}
    first = by_id[binary.get_id()]
    assert json.loads(first.value) == {"n": 1}
    assert first.key == b"s1"  # the subject is the key
    headers = _headers(first)
    assert headers["ce_type"] == b"com.example.b"
    assert headers["ce_region"] == b"eu"
    assert headers["ce_specversion"] == b"1.0"
    assert json.loads(by_id[structured.get_id()].value) == {"n": 2}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_batches_with_httpx_and_curl(server: LiveServer, client: httpx.Client) -> None:
    run = run_id()
    topic = f"batched-{run}"
    put_rule(
        client,
        "default",
        f"batch-{run}",
        {
            "pattern": {"type": [f"batch.{run}"]},
            "targets": [{"id": "t", "type": "topic", "name": topic}],
        },
    )
    events = [
        {"specversion": "1.0", "id": f"h{i}", "source": "/httpx", "type": f"batch.{run}", "data": i}
        for i in range(3)
    ]
    response = client.post(
        "/buses/default/events",
        content=json.dumps(events),
        headers={"content-type": "application/cloudevents-batch+json"},
    )
    assert response.status_code == 202, response.text
    assert [e["id"] for e in response.json()["events"]] == ["h0", "h1", "h2"]
    curl_batch = [
        {
            "specversion": "1.0",
            "id": "c0",
            "source": "/curl",
            "type": f"batch.{run}",
            "datacontenttype": "text/plain",
            "data": "from curl",
        }
    ]
    url = f"http://127.0.0.1:{server.port('http')}/buses/default/events"
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-X",
            "POST",
            url,
            "-H",
            "Content-Type: application/cloudevents-batch+json",
            "--data-binary",
            json.dumps(curl_batch),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.rsplit("\n", 1)[1] == "202", done.stdout
    records = kafka_read(server.port("kafka"), topic, 4)
    bodies = {_headers(r)["ce_id"].decode(): r.value for r in records}
    assert bodies == {"h0": b"0", "h1": b"1", "h2": b"2", "c0": b"from curl"}


@pytest.mark.parametrize(
    ("headers", "body", "named"),
    [
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "1.0", "source": "/x", "type": "t"},
            "'id' is missing",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "0.3", "id": "1", "source": "/x", "type": "t"},
            "specversion",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "1.0", "id": "1", "source": "/x", "type": "t", "Bad_Name": "v"},
            "'Bad_Name'",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {
                "specversion": "1.0",
                "id": "1",
                "source": "/x",
                "type": "t",
                "averyveryverylongextensionname": "v",
            },
            "at most 20",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "1.0", "id": "1", "source": "/x", "type": "t", "time": "yesterday"},
            "RFC 3339",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "1.0", "id": 7, "source": "/x", "type": "t"},
            "'id' must be a string",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            {"specversion": "1.0", "id": "1", "source": "/x", "type": "t", "ext": {"a": 1}},
            "extension 'ext'",
        ),
        (
            {"content-type": "application/cloudevents-batch+json"},
            [{"specversion": "1.0", "id": "1", "source": "/x", "type": "t"}, {"id": "2"}],
            "event 1: ",
        ),
        ({"content-type": "application/cloudevents-batch+json"}, {"not": "a list"}, "JSON array"),
        ({"content-type": "application/json"}, {"a": 1}, "ce-specversion"),
        (
            {
                "content-type": "application/json",
                "ce-specversion": "1.0",
                "ce-id": "1",
                "ce-source": "/x",
            },
            {"a": 1},
            "'type' is missing",
        ),
    ],
)
def test_invalid_events_are_refused_naming_the_problem(
    client: httpx.Client, headers: dict[str, str], body: object, named: str
) -> None:
    response = client.post("/buses/default/events", headers=headers, content=json.dumps(body))
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["error"] == "InvalidEvent"
    assert named in error["message"]


def test_buses_and_rules(client: httpx.Client) -> None:
    run = run_id()
    bus = f"bus-{run}"
    assert client.get(f"/buses/{bus}").status_code == 404
    assert client.put(f"/buses/{bus}", json={"retention_ms": 3_600_000}).status_code == 201
    assert client.get(f"/buses/{bus}").json()["retention_ms"] == 3_600_000
    names = [b["name"] for b in client.get("/buses").json()["buses"]]
    assert "default" in names and bus in names
    rule = {
        "pattern": {"type": ["a"]},
        "targets": [{"id": "t", "type": "topic", "name": f"t-{run}"}],
    }
    assert client.put(f"/buses/{bus}/rules/r", json=rule).status_code == 201
    assert client.put(f"/buses/{bus}/rules/r", json=rule).status_code == 200
    assert client.get(f"/buses/{bus}/rules/r").json()["pattern"] == {"type": ["a"]}
    assert [r["name"] for r in client.get(f"/buses/{bus}/rules").json()["rules"]] == ["r"]
    bad = client.put(
        f"/buses/{bus}/rules/bad",
        json={"pattern": {"type": [{"numeric": [">", "x"]}]}, "targets": rule["targets"]},
    )
    assert bad.status_code == 400 and "type.numeric" in bad.json()["message"]
    no_queue = client.put(
        f"/buses/{bus}/rules/q",
        json={
            "pattern": {"type": ["a"]},
            "targets": [{"id": "q", "type": "queue", "name": "none"}],
        },
    )
    assert no_queue.status_code == 400 and "does not exist" in no_queue.json()["message"]
    assert client.post(f"/buses/nope-{run}/events", json={}).status_code == 404
    assert client.delete(f"/buses/{bus}/rules/r").status_code == 204
    assert client.get(f"/buses/{bus}/rules/r").status_code == 404
    assert client.delete(f"/buses/{bus}").status_code == 204
    assert client.get(f"/buses/{bus}").status_code == 404
    assert client.delete("/buses/default").status_code == 400
