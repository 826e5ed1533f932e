"""amqplib from node checks RabbitMQ's requeue semantics (tests/nodejs/amqp_requeue.js):
reject / nack with requeue, and closing a channel or a connection, make messages
ready at once, redelivered, in their original order."""

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
def test_amqplib_requeue_is_ready_at_once_in_place(server: LiveServer) -> None:
    assert NODE is not None
    run = subprocess.run(
        [NODE, str(NODE_DIR / "amqp_requeue.js"), str(server.port("amqp")), uuid.uuid4().hex[:8]],
        cwd=NODE_DIR.parent.parent,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    in_place = [[0, True], [1, True], [2, True], [3, False], [4, False]]
    assert (results["held"], results["afterReject"], results["afterNack"]) == (2, 3, 5)
    assert results["order"] == in_place
    assert results["afterChannelClose"] == 5
    assert results["heldByConnection"] == 2
    assert results["afterConnectionClose"] == 5
    assert results["afterCloses"] == in_place
