"""A Kafka connection's read deadlines, kept by one timer per connection
(``connection._ReadDeadline``) rather than an ``asyncio.timeout`` per read: the idle
timeout for a request's first byte, the frame timeout for the rest of it. The timer
fires at most every frame timeout and is moved on lazily, so these check what that
could get wrong: a deadline longer than the timer's period (the idle one) is neither
cut short nor lost, a frame begun after an idle spell still gets only the frame
timeout, steady requests are never timed out, and somebody else's cancel (an admin's
kick) is not taken for a timeout. On uvloop, as ``polymq run`` serves."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator

import pytest
import uvloop
from kio.schema.errors import ErrorCode

from polymq.protocols.kafka.listener import KafkaListener
from tests.kafka.raw import RawKafka, seconds_until_closed
from tests.live_server import LiveServer, live_server

FRAME_TIMEOUT_MS = 300
GIVE_UP_S = 20.0  # far beyond every deadline under test: reaching it means no close


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with live_server(
        tmp_path_factory.mktemp("kafka-deadline"),
        ("kafka",),
        overrides={"limits.frame_timeout_ms": str(FRAME_TIMEOUT_MS)},
        loop_factory=uvloop.new_event_loop,
    ) as live:
        yield live


@pytest.fixture
def idle_timeout(served: LiveServer) -> Iterator[KafkaListener]:
    """The listener, whose ``services.idle_timeout_s`` a test sets (read by each new
    connection); put back afterwards."""
    listener = served.gateway.listeners.get("kafka")
    assert isinstance(listener, KafkaListener)
    before = listener.services.idle_timeout_s
    try:
        yield listener
    finally:
        listener.services.idle_timeout_s = before


def _closed_after(sock: socket.socket) -> float | None:
    return seconds_until_closed(sock, GIVE_UP_S)


def _api_versions_ok(client: RawKafka) -> bool:
    return bool(client.request(18, 3, {}).error_code is ErrorCode.none)


def test_idle_timeout_longer_than_the_frame_timeout_is_kept(
    served: LiveServer, idle_timeout: KafkaListener
) -> None:
    """The timer fires at the frame timeout's period while the connection idles: it
    must wait on to the idle deadline, then close."""
    idle_timeout.services.idle_timeout_s = 1.5
    with RawKafka(*served.address("kafka")) as client:
        assert _api_versions_ok(client)
        waited = _closed_after(client.sock)
    assert waited is not None, "an idle connection was never closed"
    assert waited > 1.0, f"closed after {waited:.2f} s idle, before its 1.5 s idle timeout"


def test_steady_requests_are_never_timed_out(
    served: LiveServer, idle_timeout: KafkaListener
) -> None:
    """Requests every half frame timeout, for several idle and frame timeouts: every
    one is answered (a stale deadline would close the connection between them)."""
    idle_timeout.services.idle_timeout_s = 0.6
    with RawKafka(*served.address("kafka")) as client:
        until = time.monotonic() + 2.5
        while time.monotonic() < until:
            assert _api_versions_ok(client)
            time.sleep(FRAME_TIMEOUT_MS / 1000 / 2)


def test_a_frame_begun_after_an_idle_spell_gets_the_frame_timeout(
    served: LiveServer, idle_timeout: KafkaListener
) -> None:
    """A frame begun after the timer was last moved on (while idle, at its period) is
    closed at the frame timeout, long before the idle deadline."""
    idle_timeout.services.idle_timeout_s = 10.0
    with RawKafka(*served.address("kafka")) as client:
        assert _api_versions_ok(client)
        time.sleep(FRAME_TIMEOUT_MS / 1000 * 1.7)
        client.send_bytes(struct.pack(">ih", 40, 18))  # a size and half a header
        waited = _closed_after(client.sock)
    assert waited is not None, "a stalled frame was never closed"
    assert waited < 5.0, f"a stalled frame was closed after {waited:.2f} s, not at 0.3 s"


def test_a_kick_while_reading_is_no_timeout(
    served: LiveServer, idle_timeout: KafkaListener, caplog: pytest.LogCaptureFixture
) -> None:
    """An admin's kick cancels the connection's task in its read: the connection
    closes at once, and not as if a deadline had passed."""
    idle_timeout.services.idle_timeout_s = 10.0
    registry = served.gateway.connections
    with RawKafka(*served.address("kafka")) as client:
        assert _api_versions_ok(client)
        here = client.sock.getsockname()
        (conn,) = [c for c in registry.list(protocol="kafka") if c.peer.endswith(f":{here[1]}")]
        with caplog.at_level(logging.INFO, logger="polymq.protocols.kafka.connection"):
            served.call(lambda: registry.close(conn.id))
            waited = _closed_after(client.sock)
    assert waited is not None and waited < 5.0, waited
    timeouts = [r.getMessage() for r in caplog.records if "no request for" in r.getMessage()]
    assert not timeouts, timeouts
