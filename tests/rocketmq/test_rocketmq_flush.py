"""``rocketmq.flush``, RocketMQ's flushDiskType, after a SIGKILL and a simulated power
loss (``tests/powerloss.py``: every commit-log segment cut back to what the server had
fsynced): with ``sync`` every acknowledged send is there; with ``async`` (Apache's
default, and polymq's) the sends acknowledged after the last fsync are gone, which
shows their acknowledgement did not wait for one. Acks (and hand-outs) follow the same
switch: with ``async`` an acked message comes back after the power loss (at least
once), with ``sync`` it does not. A SIGKILL alone loses nothing of either
(``test_rocketmq_crash.py``, on the default). The flush interval is set far out so no
timer fsyncs anything before the kill.
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
MIN_INVISIBLE_S = 10  # the least a simple consumer may ask (RocketMQOptions)
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


def _received(
    port: int,
    group: str,
    *,
    ack: bool = False,
    until: int = 0,
    invisible_s: int = INVISIBLE_S,
    watch_s: float = 0.0,
) -> list[bytes]:
    """Every message ``group`` receives (acking each if ``ack``), until a long poll
    comes back empty (and ``watch_s`` have passed) or ``until`` were received (then no
    further receive follows the acks: a receive with sync flush would fsync them
    whatever the acks asked)."""
    consumer = SimpleConsumer(_config(port), group, {TOPIC: FilterExpression()}, await_duration=1)
    consumer.startup()
    try:
        got: list[bytes] = []
        watch_until = time.monotonic() + watch_s
        deadline = watch_until + TIMEOUT_S

        while not (until and len(got) >= until):
            assert time.monotonic() < deadline, f"still receiving after {len(got)}"
            batch = consumer.receive(32, invisible_s)
            if not batch and time.monotonic() >= watch_until:
                break
            for m in batch:
                if ack:
                    consumer.ack(m)
                got.append(bytes(m.body))
        return got
    finally:
        with contextlib.suppress(Exception):
            consumer.shutdown()


def _survivors(data: Path, group: str = "flush-check", watch_s: float = 0.0) -> list[bytes]:
    """Every message a consumer group receives after a restart (for ``watch_s`` at
    least: long enough for a message handed out before the kill to come back)."""
    with crash_server(data, "rocketmq") as port:
        return _received(port, group, watch_s=watch_s)


def _acked_then_power_lost(data: Path, sync_log: Path, flush: str) -> list[bytes]:
    """COUNT messages sent and fsynced (``sync`` flush), the server stopped; then, on a
    server with ``flush``, all received and acked by group "acker" (each ack answered),
    the kill and the power loss. The bodies."""
    bodies = _sent_then_power_lost(data, sync_log, "sync")
    settings = {"storage.flush_interval_ms": "600000", "rocketmq.flush": flush}
    with crash_server(data, "rocketmq", settings=settings, prelude=prelude(sync_log)) as port:
        got = _received(port, "acker", ack=True, until=COUNT, invisible_s=MIN_INVISIBLE_S)
        assert sorted(got) == sorted(bodies)
    lose_unsynced(data, sync_log)
    return bodies


def test_sync_flush_keeps_every_acknowledged_send(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    sent = _sent_then_power_lost(data, sync_log, "sync")
    assert sorted(_survivors(data)) == sorted(sent)


def test_async_flush_answers_before_the_fsync(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    _sent_then_power_lost(data, sync_log, "async")
    assert _survivors(data) == [], "an async-flush send waited for its fsync"


def test_sync_flush_acks_survive_a_power_loss(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    _acked_then_power_lost(data, sync_log, "sync")
    # The hand-out was fsynced: a lost ack would show once its invisible time ran out.
    assert _survivors(data, "acker", watch_s=MIN_INVISIBLE_S + 2) == []


def test_async_flush_acks_are_answered_before_the_fsync(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    sent = _acked_then_power_lost(data, sync_log, "async")
    assert sorted(_survivors(data, "acker")) == sorted(sent), "an async-flush ack waited"
