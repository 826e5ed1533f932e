"""``rocketmq.flush``, RocketMQ's flushDiskType, after a SIGKILL and a simulated power
loss (``tests/powerloss.py``: every commit-log segment cut back to what the server had
fsynced): with ``sync`` every acknowledged send is there; with ``async`` (Apache's
default, and polymq's) the sends acknowledged after the last fsync are gone, which
shows their acknowledgement did not wait for one. A SIGKILL alone loses neither
(``test_rocketmq_crash.py``, on the default). The flush interval is set far out so no
timer fsyncs the sends before the kill.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Producer, SimpleConsumer

from tests.crash_server import crash_server
from tests.powerloss import lose_unsynced, prelude
from tests.rocketmq.conftest import message

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOPIC = "flush"
COUNT = 5
INVISIBLE_S = 30
TIMEOUT_S = 30.0


def _config(port: int) -> Any:
    return ClientConfiguration(f"127.0.0.1:{port}", Credentials("", ""), "")


def _sent_then_power_lost(data: Path, sync_log: Path, flush: str) -> list[bytes]:
    """Sends COUNT messages (each acknowledged before the next), then the kill and the
    power loss; the bodies sent."""
    settings = {"storage.flush_interval_ms": "600000", "rocketmq.flush": flush}
    bodies = [b"m%d" % i for i in range(COUNT)]
    with crash_server(data, "rocketmq", settings=settings, prelude=prelude(sync_log)) as port:
        producer = Producer(_config(port), (TOPIC,))
        producer.startup()
        for body in bodies:
            producer.send(message(TOPIC, body))
    with contextlib.suppress(Exception):
        producer.shutdown()
    lose_unsynced(data, sync_log)
    return bodies


def _survivors(data: Path) -> list[bytes]:
    """Every message a new consumer group receives, until a long poll comes back empty."""
    with crash_server(data, "rocketmq") as port:
        consumer = SimpleConsumer(
            _config(port), "flush-check", {TOPIC: FilterExpression()}, await_duration=1
        )
        consumer.startup()
        try:
            got: list[bytes] = []
            deadline = time.monotonic() + TIMEOUT_S
            while batch := consumer.receive(32, INVISIBLE_S):
                assert time.monotonic() < deadline, f"still receiving after {len(got)}"
                got += [bytes(m.body) for m in batch]
            return got
        finally:
            with contextlib.suppress(Exception):
                consumer.shutdown()


def test_sync_flush_keeps_every_acknowledged_send(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    sent = _sent_then_power_lost(data, sync_log, "sync")
    assert sorted(_survivors(data)) == sorted(sent)


def test_async_flush_answers_before_the_fsync(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    _sent_then_power_lost(data, sync_log, "async")
    assert _survivors(data) == [], "an async-flush send waited for its fsync"
