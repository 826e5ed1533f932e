"""rocketmq-client-nodejs: a producer and a simple consumer from node, and the same
messages read by the Python client (one storage, two clients)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from rocketmq.grpc_protocol import Code, definition_pb2

from polymq.protocols.rocketmq import RocketMQListener
from polymq.protocols.rocketmq.activities.telemetry import print_thread_stack_trace, verify_message
from tests.live_server import LiveServer
from tests.rocketmq.conftest import (
    endpoint,
    message,
    producer,
    receive_all,
    simple_consumer,
    unique,
    wait_until,
)

NODE_DIR = Path(__file__).resolve().parents[1] / "nodejs"
SCRIPT = NODE_DIR / "rocketmq_produce_consume.js"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None
    or not (NODE_DIR / "node_modules" / "rocketmq-client-nodejs").exists(),
    reason="node or rocketmq-client-nodejs is not installed",
)


def test_node_producer_and_simple_consumer(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    # a Python consumer group subscribed first sees the node messages too
    with simple_consumer(server, unique("py"), topic) as python_consumer:
        done = subprocess.run(
            ["node", str(SCRIPT), endpoint(server), topic, group, "5"],
            cwd=NODE_DIR.parent.parent,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        from_python = receive_all(python_consumer, 5)
        for m in from_python:
            python_consumer.ack(m)
    received = result["received"]
    assert sorted(m["id"] for m in received) == sorted(result["sent"])
    assert sorted(m["body"] for m in received) == [f"node-{i}" for i in range(5)]
    assert {m["tag"] for m in received} == {"node"}
    assert {m["origin"] for m in received} == {"node"}
    assert sorted(k for m in received for k in m["keys"]) == [f"key-{i}" for i in range(5)]
    assert {m.message_id for m in from_python} == set(result["sent"])
    assert {m.body for m in from_python} == {f"node-{i}".encode() for i in range(5)}


def test_node_client_answers_diagnostics(server: LiveServer) -> None:
    listener = server.gateway.listeners.get("rocketmq")
    assert isinstance(listener, RocketMQListener)
    sessions = listener.services.sessions
    proc = subprocess.Popen(
        ["node", str(NODE_DIR / "rocketmq_idle_client.js"), endpoint(server), unique("t")],
        cwd=NODE_DIR.parent.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        client_id = json.loads(proc.stdout.readline())["clientId"]
        session = wait_until(lambda: sessions.get(client_id))
        trace = server.call(lambda: print_thread_stack_trace(session, timeout_s=20))
        assert trace  # the node client sends a (mock) stack
        status = server.call(lambda: verify_message(session, definition_pb2.Message(), 20))
        assert status is not None and status.code == Code.NOT_IMPLEMENTED
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def test_node_push_consumer_with_retry(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p:
        p.send(message(topic, b"warm-up"))  # creates the topic
        proc = subprocess.Popen(
            [
                "node",
                str(NODE_DIR / "rocketmq_push_consumer.js"),
                endpoint(server),
                topic,
                group,
                "4",
            ],
            cwd=NODE_DIR.parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline()) == {"started": True}
            for i in range(3):
                p.send(message(topic, f"push-{i}".encode()))
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-2000:]
    deliveries = json.loads(out.strip().splitlines()[-1])["deliveries"]
    bodies = {"warm-up", "push-0", "push-1", "push-2"}
    # each message failed once, then came back as attempt 2 and succeeded
    assert sorted((d["body"], d["attempt"]) for d in deliveries) == sorted(
        (b, a) for b in bodies for a in (1, 2)
    )
