"""Hostile MQTT input (issue 14): what one peer sends may cost it its own connection,
with MQTT's own error and one log line, and nothing more: deep topics, huge
SUBSCRIBEs, bad will topics, sockets that never say CONNECT, packets begun and never
finished, large packets declared before login."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.sync.client import connect as ws_connect
from websockets.typing import Subprotocol

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.broker import MqttBroker
from polymq.protocols.mqtt.services import serving
from polymq.protocols.mqtt.transport import TcpTransport
from polymq.protocols.mqtt.ws_handshake import _send_eof_once
from tests.live_server import LiveServer
from tests.mqtt.helpers import TIMEOUT, Paho, RawClient, mqtt_server, wait_until

DEEP = 1500  # levels: past Python's recursion limit, as in the issue
MAX_FILTERS = 1000  # config.mqtt.max_filters_per_subscribe's default
ANONYMOUS_MAX = 4096  # limits.max_unauthenticated_frame_bytes in the hostile server
BUDGET = 1_100_000  # limits.max_buffered_frame_bytes in the hostile server


def _deep(levels: int, last: str = "x") -> str:
    return "/".join(["d"] * (levels - 1) + [last])


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def _still_serving(server: LiveServer) -> None:
    """A fresh client publishes and gets its message back."""
    client = Paho(server.port("mqtt"), v5=True).connect()
    assert client.connack == (False, 0)
    client.subscribe("alive/#", qos=1)
    assert client.publish("alive/x", b"ok", qos=1) == 0
    assert [m.payload for m in client.wait_messages(1)] == [b"ok"]
    client.disconnect()


def _closed_without_reply(sock: socket.socket) -> bytes:
    """What the server sent before closing a raw socket (b"" when nothing)."""
    sock.settimeout(TIMEOUT)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    overrides = {
        "limits.handshake_timeout_ms": "300",
        "limits.max_unauthenticated_frame_bytes": str(ANONYMOUS_MAX),
        "limits.max_buffered_frame_bytes": str(BUDGET),
    }
    with mqtt_server(tmp_path_factory.mktemp("hostile"), overrides) as server:
        yield server


@pytest.fixture
def served(hostile: LiveServer, caplog: pytest.LogCaptureFixture) -> Iterator[LiveServer]:
    """The hostile server; after the test it still serves and logged no traceback."""
    caplog.set_level(logging.INFO)
    yield hostile
    _still_serving(hostile)
    _no_tracebacks(caplog)


# -- topic levels (finding 5) ------------------------------------------------------------


def test_deep_subscription_is_refused_and_deep_publish_gets_0x90(served: LiveServer) -> None:
    subscriber = Paho(served.port("mqtt"), v5=True).connect()
    assert subscriber.subscribe(_deep(DEEP, "+"), qos=1) == [0x8F]  # topic filter invalid
    assert subscriber.subscribe(_deep(128, "#"), qos=1) == [1]  # at the limit: granted
    publisher = Paho(served.port("mqtt"), v5=True).connect()
    publisher.client.reconnect_delay_set(60, 120)  # no resend of the PUBLISH meanwhile
    publisher.publish(_deep(DEEP), b"deep", qos=1, wait=False)
    publisher.wait(lambda: bool(publisher.disconnects), "DISCONNECT")
    publisher.client.loop_stop()
    assert publisher.disconnects[0] == 0x90  # topic name invalid, as EMQX
    assert subscriber.messages == []
    subscriber.disconnect()


def test_deep_publish_v311_closes_only_that_connection(served: LiveServer) -> None:
    subscriber = RawClient(served.port("mqtt"), level=4)
    subscriber.connect("deep-sub3")
    assert subscriber.subscribe(_deep(DEEP, "#"), qos=1).reasons == [0x80]
    publisher = RawClient(served.port("mqtt"), level=4)
    publisher.connect("deep-pub3")
    publisher.send(codec.Publish(topic=_deep(DEEP), payload=b"x", qos=1, packet_id=1))
    assert publisher.closed() == []
    subscriber.send(codec.PingReq())
    assert subscriber.receive() == codec.PingResp()


def test_shared_filter_levels_are_counted_without_the_share_prefix(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.connect("share-levels")
    assert raw.subscribe("$share/g/" + _deep(128, "#"), qos=1).reasons == [1]
    assert raw.subscribe("$share/g/" + _deep(129, "#"), qos=1, packet_id=2).reasons == [0x8F]


def test_deep_will_topic_is_refused_at_connect(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    ack = raw.connect("deep-will", will_topic=_deep(DEEP), will_payload=b"w")
    assert ack.reason == 0x90
    assert raw.closed() == []


# -- will topics (finding 6) -------------------------------------------------------------


@pytest.mark.parametrize("topic", ["\x01bad", "bad\x1f/x", "a/+", "#", "x" * 300])
def test_bad_will_topic_v5_gets_connack_0x90(served: LiveServer, topic: str) -> None:
    raw = RawClient(served.port("mqtt"))
    ack = raw.connect("bad-will", will_topic=topic, will_payload=b"w")
    assert (ack.reason, ack.session_present) == (0x90, False)
    assert raw.closed() == []


def test_bad_will_topic_v311_gets_return_code_3(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"), level=4)
    ack = raw.connect("bad-will3", will_topic="\x01bad", will_payload=b"w")
    assert ack.reason == 3  # server unavailable: EMQX's v3 code for 0x90
    assert raw.closed() == []


def test_will_with_control_character_in_a_deeper_level_is_published(served: LiveServer) -> None:
    """Only the first level names a storage topic: a control character further down
    is a valid topic name, and the will goes out at session end without error."""
    watcher = Paho(served.port("mqtt"), v5=True).connect()
    watcher.subscribe("will/#", qos=1)
    raw = RawClient(served.port("mqtt"))
    ack = raw.connect("odd-will", will_topic="will/\x01odd", will_payload=b"gone")
    assert ack.reason == 0
    raw.close()  # no DISCONNECT: the will is sent
    assert [(m.topic, m.payload) for m in watcher.wait_messages(1)] == [("will/\x01odd", b"gone")]
    watcher.disconnect()


@pytest.mark.parametrize("client_id", ["\x01ctl", "c" * 300])
def test_unstorable_client_id_of_a_persistent_session_is_refused(
    served: LiveServer, client_id: str
) -> None:
    """A kept session is stored under its client id: one storage cannot name gets
    "client identifier not valid" (v5 0x85, v3 2), not "server unavailable"."""
    raw = RawClient(served.port("mqtt"))
    ack = raw.connect(client_id, clean_start=False, properties={codec.SESSION_EXPIRY: 60})
    assert ack.reason == 0x85
    assert raw.closed() == []
    raw3 = RawClient(served.port("mqtt"), level=4)
    assert raw3.connect(client_id, clean_start=False).reason == 2
    clean = RawClient(served.port("mqtt"))  # nothing stored: any client id will do
    assert clean.connect(client_id).reason == 0
    clean.send(codec.Disconnect())
    assert clean.closed() == []


@pytest.mark.parametrize("prop", [codec.RECEIVE_MAXIMUM, codec.MAXIMUM_PACKET_SIZE])
def test_connect_property_of_zero_is_a_protocol_error(served: LiveServer, prop: int) -> None:
    raw = RawClient(served.port("mqtt"))
    assert raw.connect("zero", properties={prop: 0}).reason == 0x82  # v5 3.1.2.11.3-4
    assert raw.closed() == []


def test_topic_aliases_hold_at_most_one_packet_of_topics(served: LiveServer) -> None:
    """65,535 aliases of 64 KiB topics would hold 4 GiB of one connection's topics:
    together they may hold mqtt.max_packet_bytes (1 MiB); re-setting an alias frees
    its old topic."""
    raw = RawClient(served.port("mqtt"))
    raw.connect("aliases")
    long_topic = "alive/" + "t" * 60_000
    for i in range(40):  # one alias, re-set: 60 KB held, not 2.4 MB
        raw.send(
            codec.Publish(
                topic=long_topic, qos=1, packet_id=i + 1, properties={codec.TOPIC_ALIAS: 1}
            )
        )
        assert raw.receive() == codec.PubAck(packet_id=i + 1)
    # 60 KB more each: the 18th goes past 1 MiB. One at a time, each acknowledged, so
    # the client never writes into a connection the server has closed (a reset would
    # discard the DISCONNECT before it is read).
    for alias in range(2, 40):
        packet_id = 100 + alias
        raw.send(
            codec.Publish(
                topic=long_topic, qos=1, packet_id=packet_id, properties={codec.TOPIC_ALIAS: alias}
            )
        )
        answer = raw.receive()
        if not isinstance(answer, codec.PubAck):
            break
        assert answer == codec.PubAck(packet_id=packet_id)
    assert alias > 2, "refused at once: one alias's topic is within the limit"
    assert isinstance(answer, codec.Disconnect) and answer.reason == 0x97, answer


# -- filters per SUBSCRIBE (finding 4) ---------------------------------------------------


def _subscribe_many(count: int, prefix: str = "f") -> codec.Subscribe:
    subs = [codec.Subscription(filter=f"{prefix}/{i}", retain_handling=2) for i in range(count)]
    return codec.Subscribe(packet_id=1, subscriptions=subs)


def test_100k_filter_subscribe_is_refused_v5(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.connect("many")
    raw.send(_subscribe_many(100_000))
    [goodbye] = raw.closed()
    assert isinstance(goodbye, codec.Disconnect) and goodbye.reason == 0x97  # quota exceeded
    assert "1000" in goodbye.properties[codec.REASON_STRING]


def test_100k_filter_subscribe_v311_closes(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"), level=4)
    raw.connect("many3")
    raw.send(_subscribe_many(100_000))
    assert raw.closed() == []


def test_100k_filter_unsubscribe_is_refused(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.connect("unmany")
    raw.send(codec.Unsubscribe(packet_id=1, filters=[f"u/{i}" for i in range(100_000)]))
    [goodbye] = raw.closed()
    assert isinstance(goodbye, codec.Disconnect) and goodbye.reason == 0x97


def test_subscribe_at_the_filter_limit_is_granted(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.connect("at-limit")
    raw.send(_subscribe_many(MAX_FILTERS, "lim"))
    ack = raw.receive()
    assert isinstance(ack, codec.SubAck) and ack.reasons == [0] * MAX_FILTERS
    raw.send(codec.Unsubscribe(packet_id=2, filters=[f"lim/{i}" for i in range(MAX_FILTERS)]))
    unack = raw.receive()
    assert isinstance(unack, codec.UnsubAck) and unack.reasons == [0] * MAX_FILTERS


def _broker_of(server: LiveServer, client_id: str) -> MqttBroker:
    services = serving(server.gateway.processor)
    assert services is not None
    return next(b for b in services.brokers.loaded() if client_id in b.sessions)


def _has_data(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


@contextmanager
def _answers_written(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """The (client port, MQTT packet type) of each write the server makes, in the
    server's own order: the test's thread shares the GIL with the server and may look
    at its sockets hundreds of milliseconds late, so what arrived first is read where
    it was written."""
    written: list[tuple[int, int]] = []
    write = TcpTransport.write

    def recording(transport: TcpTransport, data: bytes) -> None:
        peer = transport.get_extra_info("peername")
        written.append((peer[1], data[0] >> 4))
        write(transport, data)

    monkeypatch.setattr(TcpTransport, "write", recording)
    yield written


@contextmanager
def _switching_often() -> Iterator[None]:
    """Threads switch every 0.1 ms instead of 5: the test's thread then sees the
    server's thread's progress (and sends right after) to within a few filters."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


# Filters in the SUBSCRIBE that must not hold the loop: hundreds of slices, so the
# SUBACK comes long after a ping answered between two of them.
BIG_SUBSCRIBE = 20_000
_PINGRESP, _SUBACK = 13, 9  # MQTT packet types


@pytest.fixture(scope="module")
def big_subscribes(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[LiveServer]:
    overrides = {"mqtt.max_filters_per_subscribe": str(BIG_SUBSCRIBE)}
    with mqtt_server(tmp_path_factory.mktemp("big"), overrides) as server:
        yield server


def test_big_subscribe_hands_the_loop_back(
    big_subscribes: LiveServer, server_form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PINGREQ another client sends once a 20,000-filter SUBSCRIBE is being handled
    is answered before that SUBACK: the filters are handled in slices. (The ping must
    reach the server while half the filters are still to go, or the run proves
    nothing and is repeated with new filters.)"""
    if server_form == "cluster":
        # The slicing is MQTT's own code, the same in both forms; in the cluster form the
        # storage nodes share the server's thread and loop with the gateway, and their
        # RPC steps made the order this test reads flaky (1 run in 3 on a clean clone).
        pytest.skip("the slicing is form-independent; checked against the merged server")
    served = big_subscribes
    port = served.port("mqtt")
    pinger = RawClient(port)
    pinger.connect("pinger")
    holder = RawClient(port)
    holder.connect("holder")
    pinger_port = pinger.sock.getsockname()[1]
    holder_port = holder.sock.getsockname()[1]
    broker = _broker_of(served, "holder")
    for attempt in range(20):
        # First one filter, so that the storage topic's tail is running and the big
        # SUBSCRIBE waits on no I/O: only slicing can then let the ping through.
        holder.subscribe(f"hold{attempt}/warm", packet_id=2)
        base = len(broker.index)
        with _answers_written(monkeypatch) as written, _switching_often():
            holder.send(_subscribe_many(BIG_SUBSCRIBE, f"hold{attempt}"))
            deadline = time.monotonic() + TIMEOUT
            while len(broker.index) == base:  # busy: wait_until's 10 ms naps are a slice
                assert time.monotonic() < deadline, "the SUBSCRIBE never started"
            pinger.send(codec.PingReq())
            progress = len(broker.index) - base
        assert pinger.receive() == codec.PingResp()
        ack = holder.receive()
        assert isinstance(ack, codec.SubAck) and len(ack.reasons) == BIG_SUBSCRIBE
        order = [
            kind
            for peer, kind in written
            if (peer, kind) in {(pinger_port, _PINGRESP), (holder_port, _SUBACK)}
        ]
        # A ping read at the end of slice k is answered after slice k + 1: sent while
        # half the filters were still to go, it must be written before the last slice
        # ends with the SUBACK. Without slices the whole SUBSCRIBE is one step of the
        # loop, and the ping waits.
        if progress < BIG_SUBSCRIBE // 2:
            assert order == [_PINGRESP, _SUBACK], f"SUBACK written first (ping at {progress})"
            return
    pytest.fail("the ping never reached the server within the SUBSCRIBE's first half")


# -- handshake and packet deadlines, packet sizes before login (findings 2, 3) -----------


def _closed_for_no_handshake(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the server logged closing a connection after the configured 0.3 s
    (not after some longer default)."""
    return any("within 0.3 s" in r.getMessage() for r in caplog.records)


def test_silent_socket_is_closed_after_the_handshake_timeout(
    served: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port("mqtt")))
    assert _closed_without_reply(sock) == b""
    assert _closed_for_no_handshake(caplog)


def test_half_connect_is_closed_after_the_handshake_timeout(
    served: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port("mqtt")))
    sock.sendall(b"\x10\x64\x00\x04MQ")  # a CONNECT of 100 bytes, never finished
    assert _closed_without_reply(sock) == b""
    assert _closed_for_no_handshake(caplog)


def test_silent_websocket_is_closed_after_the_handshake_timeout(
    served: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port("mqtt_ws")))  # no upgrade
    assert _closed_without_reply(sock) == b""
    [line] = _lines_about(caplog, sock)
    assert line.endswith("no WebSocket upgrade within 0.3 s")  # not websockets' silence
    url = f"ws://127.0.0.1:{served.port('mqtt_ws')}/mqtt"
    with (
        ws_connect(url, subprotocols=[Subprotocol("mqtt")]) as ws,
        pytest.raises(ConnectionClosed),  # upgraded, but no CONNECT
    ):
        ws.recv(timeout=TIMEOUT)
    assert _closed_for_no_handshake(caplog)


def test_websocket_upgrade_and_connect_share_one_handshake_deadline(
    served: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The deadline counts from the TCP accept, the upgrade included: a socket that
    upgrades late (after a second socket was accepted) and never sends CONNECT is
    closed before that second, silent, one. With a deadline of its own after the
    upgrade it would be closed after it."""
    port = served.port("mqtt_ws")
    late = socket.create_connection(("127.0.0.1", port))
    time.sleep(0.05)  # the attacker's pace, not a wait for the server
    silent = socket.create_connection(("127.0.0.1", port))
    time.sleep(0.05)
    late.sendall(_UPGRADE)
    late.settimeout(TIMEOUT)
    assert late.recv(12) == b"HTTP/1.1 101"
    wait_until(
        lambda: bool(_lines_about(caplog, late)) and bool(_lines_about(caplog, silent)),
        what="both sockets closed",
    )
    [late_line] = _lines_about(caplog, late)
    [silent_line] = _lines_about(caplog, silent)
    assert late_line.endswith("no CONNECT within 0.3 s")
    assert silent_line.endswith("no WebSocket upgrade within 0.3 s")
    lines = [r.getMessage() for r in caplog.records]
    assert lines.index(late_line) < lines.index(silent_line)


def test_connected_client_is_not_held_to_the_handshake_timeout(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.connect("patient")
    deadline = time.monotonic() + 1.0  # past the 0.3 s handshake deadline
    while time.monotonic() < deadline:
        raw.send(codec.PingReq())
        assert raw.receive() == codec.PingResp()


def test_large_packet_before_connect_is_refused(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    raw.send(codec.Connect(level=5, client_id="big-login", password=b"p" * ANONYMOUS_MAX))
    assert raw.closed() == []


def test_large_packets_are_fine_after_connect_even_pipelined(served: LiveServer) -> None:
    raw = RawClient(served.port("mqtt"))
    big = codec.Publish(topic="alive/big", payload=b"b" * (4 * ANONYMOUS_MAX), qos=1, packet_id=7)
    raw.send(codec.encode(codec.Connect(level=5, client_id="pipelined"), 5) + codec.encode(big, 5))
    ack = raw.receive()
    assert isinstance(ack, codec.ConnAck) and ack.reason == 0
    assert ack.properties[codec.MAXIMUM_PACKET_SIZE] == 1 << 20
    assert raw.receive() == codec.PubAck(packet_id=7)


def test_packets_being_read_hold_the_frame_budget(served: LiveServer) -> None:
    """Declared-but-unsent bytes are held from the gateway's budget while they arrive:
    a second large packet waits for the first, and both get through; a connection
    dropped mid-packet gives its bytes back."""
    budget = served.gateway.frame_budget
    first = RawClient(served.port("mqtt"))
    first.connect("budget-1")
    second = RawClient(served.port("mqtt"))
    second.connect("budget-2")
    one = codec.encode(
        codec.Publish(topic="alive/1", payload=b"1" * 1_000_000, qos=1, packet_id=1), 5
    )
    two = codec.encode(
        codec.Publish(topic="alive/2", payload=b"2" * 200_000, qos=1, packet_id=2), 5
    )
    first.send(one[:1000])
    wait_until(lambda: budget.held == len(one), what="the first packet's reservation")
    second.send(two[:1000])  # does not fit beside the first: waits, unread
    second.send(two[1000:])
    assert budget.held == len(one)
    first.send(one[1000:])
    assert first.receive() == codec.PubAck(packet_id=1)
    assert second.receive() == codec.PubAck(packet_id=2)
    wait_until(lambda: budget.held == 0, what="the budget to be given back")
    dropped = RawClient(served.port("mqtt"))
    dropped.connect("budget-3")
    dropped.send(one[:1000])
    wait_until(lambda: budget.held == len(one), what="the dropped packet's reservation")
    dropped.close()
    wait_until(lambda: budget.held == 0, what="a dropped connection's bytes back")


# -- MQTT over WebSocket: what websockets makes of a bad upgrade --------------------------

_UPGRADE = (
    b"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
)
_UNMASKED = b"\x82\x01\x00"  # a client's frame must be masked (RFC 6455 5.1)


def _lines_about(caplog: pytest.LogCaptureFixture, sock: socket.socket) -> list[str]:
    """What the server logged about the peer ``sock`` is."""
    host, port = sock.getsockname()[:2]
    peer = f"{host}:{port}"
    return [r.getMessage() for r in caplog.records if peer in r.getMessage()]


def _upgrade_refused(
    served: LiveServer, caplog: pytest.LogCaptureFixture, data: bytes, *, half_close: bool
) -> tuple[bytes, str]:
    """Send ``data`` (then EOF if ``half_close``) and keep the socket open until the
    server has logged why it closed it (a peer hanging up first would spare websockets
    the path that fails). What it answered and its one line about the peer."""
    sock = socket.create_connection(("127.0.0.1", served.port("mqtt_ws")))
    sock.sendall(data)
    if half_close:
        sock.shutdown(socket.SHUT_WR)
    wait_until(lambda: bool(_lines_about(caplog, sock)), what="the server's line about it")
    answer = _closed_without_reply(sock)
    [line] = _lines_about(caplog, sock)
    sock.close()
    return answer, line


@pytest.mark.parametrize(
    ("data", "half_close", "says"),
    [
        pytest.param(  # websockets: InvalidMessage, logged as ERROR with a traceback
            b"GET / HTTP/1.1\r\nHost: x\r\nSec-WebSocket-Pro\xff\xffcol: mqtt\r\n\r\n",
            False,
            "invalid HTTP header name: Sec-WebSocket-Pro\\xff\\xffcol",
            id="bad-header-name",
        ),
        pytest.param(
            _UPGRADE[:40], True, "did not receive a valid HTTP request", id="eof-mid-request"
        ),
        pytest.param(  # websockets: ConnectionClosedError (RuntimeError writing its 101)
            _UPGRADE + _UNMASKED,
            False,
            "the bytes after the request are not frames: incorrect masking",
            id="upgrade-then-unmasked-frame",
        ),
        pytest.param(  # websockets: AssertionError (a second EOF after its rejection)
            _UPGRADE.replace(b"Upgrade: websocket\r\n", b"") + _UNMASKED,
            False,
            "the bytes after the request are not frames: incorrect masking",
            id="refused-upgrade-then-unmasked-frame",
        ),
    ],
)
def test_bad_websocket_upgrade_is_closed_with_one_line(
    served: LiveServer,
    caplog: pytest.LogCaptureFixture,
    data: bytes,
    half_close: bool,
    says: str,
) -> None:
    answer, line = _upgrade_refused(served, caplog, data, half_close=half_close)
    assert answer == b""
    assert says in line, line
    assert line.isascii()


@pytest.mark.parametrize(
    ("header", "value"),
    [("Upgrade", b"websock\xe5t"), ("Sec-WebSocket-Version", b"\x80\x80 13")],
)
def test_non_ascii_upgrade_header_gets_400(
    served: LiveServer, caplog: pytest.LogCaptureFixture, header: str, value: bytes
) -> None:
    """websockets would quote the value in its own 400 and fail encoding it
    (UnicodeEncodeError, logged as ERROR with a traceback, and no answer)."""
    start = f"{header}: ".encode()
    lines = [start + value if line.startswith(start) else line for line in _UPGRADE.split(b"\r\n")]
    answer, line = _upgrade_refused(served, caplog, b"\r\n".join(lines), half_close=False)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert f"{header} is not ASCII" in line


def test_broken_websocket_frame_after_the_upgrade_is_one_line(
    served: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port("mqtt_ws")))
    sock.sendall(_UPGRADE)
    sock.settimeout(TIMEOUT)
    assert sock.recv(12) == b"HTTP/1.1 101"
    sock.sendall(_UNMASKED)
    wait_until(lambda: bool(_lines_about(caplog, sock)), what="the server's line about it")
    [line] = _lines_about(caplog, sock)
    assert line.endswith("1002 (protocol error) incorrect masking")


def test_sockets_that_never_upgrade_count_against_the_connection_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Registered on the TCP accept, as TCP listeners do, not after the upgrade: one
    address cannot hold sockets past its limit by never upgrading them. A registry
    kick closes one that has not upgraded; a closed one gives its slot back."""
    caplog.set_level(logging.INFO)
    with mqtt_server(tmp_path, {"limits.max_connections_per_address": "2"}) as limited:
        registry, port = limited.gateway.connections, limited.port("mqtt_ws")
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        wait_until(lambda: registry.count(protocol="mqtt") == 2, what="two registered")
        with socket.create_connection(("127.0.0.1", port)) as extra:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                extra.sendall(_UPGRADE)
            assert _closed_without_reply(extra) == b""  # aborted unanswered
            [line] = _lines_about(caplog, extra)
            assert "refused: connection limit of 2 per address" in line
        host, kept = held[0].getsockname()[:2]
        [kicked] = [c for c in registry.list(protocol="mqtt") if c.peer == f"{host}:{kept}"]
        limited.call(lambda: registry.close(kicked.id))
        assert _closed_without_reply(held[0]) == b""
        held[1].close()
        wait_until(lambda: registry.count(protocol="mqtt") == 0, what="the slots back")
        url = f"ws://127.0.0.1:{port}/mqtt"
        with ws_connect(url, subprotocols=[Subprotocol("mqtt")]) as ws:
            ws.send(codec.encode(codec.Connect(level=5, client_id="after-the-limit"), 5))
            [ack] = codec.Decoder(level=5).feed(cast(bytes, ws.recv(timeout=TIMEOUT)))
            assert isinstance(ack, codec.ConnAck) and ack.reason == 0
    _no_tracebacks(caplog)


def test_refusal_after_the_parser_failed_sends_one_eof() -> None:
    """The library's side of the race the live test above cannot pin down: bytes that
    are not frames arrive after a request and before its answer (websockets half-closes
    at once), then the answer is a refusal, which half-closes again: ``assert not
    self.eof_sent`` (15.0.1 to 17.4) unless the second EOF is a no-op."""
    protocol = ServerProtocol()
    _send_eof_once(protocol)
    protocol.receive_data(_UPGRADE.replace(b"Upgrade: websocket\r\n", b"") + _UNMASKED)
    [request] = protocol.events_received()
    assert isinstance(request, Request) and protocol.eof_sent
    protocol.send_response(protocol.accept(request))  # 426: no AssertionError
    sent = protocol.data_to_send()
    assert sent[-1].startswith(b"HTTP/1.1 426") and sent.count(b"") == 1  # one EOF


# -- a server with a short packet deadline and deeper topics allowed ---------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    overrides = {"limits.frame_timeout_ms": "300", "mqtt.max_topic_levels": str(DEEP + 10)}
    with mqtt_server(tmp_path_factory.mktemp("quick"), overrides) as server:
        yield server


def test_index_walk_serves_topics_deeper_than_the_recursion_limit(
    quick: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    subscriber = Paho(quick.port("mqtt"), v5=True).connect()
    assert subscriber.subscribe(_deep(DEEP, "+"), qos=1) == [1]
    assert subscriber.subscribe(_deep(DEEP - 1, "#"), qos=1) == [1]
    publisher = Paho(quick.port("mqtt"), v5=True).connect()
    assert publisher.publish(_deep(DEEP), b"deep", qos=1) == 0
    assert [m.payload for m in subscriber.wait_messages(1)] == [b"deep"]  # one copy (v5 3.3.4)
    assert publisher.disconnects == []
    subscriber.disconnect()
    publisher.disconnect()
    _no_tracebacks(caplog)


def test_packet_begun_and_never_finished_is_closed(quick: LiveServer) -> None:
    raw = RawClient(quick.port("mqtt"))
    raw.connect("unfinished")
    raw.send(b"\x32\xe8\x07\x00\x05alive")  # PUBLISH QoS 1 of 1,000 bytes: 8 sent
    [goodbye] = raw.closed()
    assert isinstance(goodbye, codec.Disconnect) and goodbye.reason == 0x8D
    assert "not whole" in goodbye.properties[codec.REASON_STRING]


def test_packet_dripped_byte_by_byte_is_closed(quick: LiveServer) -> None:
    """One byte every 20 ms keeps the keep-alive happy but not the packet deadline."""
    raw = RawClient(quick.port("mqtt"))
    raw.connect("dripping", keep_alive=60)
    packet = codec.encode(
        codec.Publish(topic="alive/drip", payload=b"d" * 1000, qos=1, packet_id=1), 5
    )
    for byte in packet:
        if _has_data(raw.sock):
            break
        try:
            raw.send(bytes((byte,)))
        except OSError:
            break
        time.sleep(0.02)  # the attacker's pace, not a wait for the server
    else:
        pytest.fail("the whole packet went through a byte at a time")
    [goodbye] = raw.closed()
    assert isinstance(goodbye, codec.Disconnect) and goodbye.reason == 0x8D
