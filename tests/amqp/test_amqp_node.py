"""amqplib from node drives the core flows (tests/nodejs/amqp_client.js): work queue,
fanout, confirms, returns, nack/requeue, RPC, priorities, DLX + TTL, a 404."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.live_server import LiveServer

NODE_DIR = Path(__file__).resolve().parents[1] / "nodejs"
NODE = shutil.which("node")


@pytest.mark.skipif(
    NODE is None or not (NODE_DIR / "node_modules" / "amqplib").exists(),
    reason="node or amqplib is not installed",
)
def test_amqplib_core_flows(server: LiveServer) -> None:
    assert NODE is not None
    run = subprocess.run(
        [NODE, str(NODE_DIR / "amqp_client.js"), str(server.port("amqp")), uuid.uuid4().hex[:8]],
        cwd=NODE_DIR.parent.parent,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results["work"] == list(range(20))
    assert results["redelivered"] is True
    assert results["headers"] == {"n": 3, "s": "x"}
    assert results["fanout"] == ["to-all", "to-all"]
    assert results["returnCode"] == 312
    assert results["rpc"] == ["HELLO", "c9"]
    assert results["priorities"] == ["3", "2", "1", "0"]
    assert results["deadLettered"] == ["late", "expired"]
    assert results["missingExchange"] == 404
    assert results["afterError"].startswith("node-work-")
