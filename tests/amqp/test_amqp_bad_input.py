"""Bad peers get the spec's reply code on a raw socket, and the server keeps serving
everyone else; credentials and vhosts are checked against the accounts."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from pamqp import commands
from pamqp.heartbeat import Heartbeat
from pika.exceptions import ProbableAccessDeniedError, ProbableAuthenticationError

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.protocols.amqp.codec import (
    HEARTBEAT_BYTES,
    PROTOCOL_HEADER,
    FrameReader,
    InFrame,
    content_frames,
    method_frame,
)
from polymq.protocols.amqp.properties import encode_properties
from tests.amqp.conftest import FACTORIES, WAIT_S, connect, unique
from tests.live_server import LiveServer, live_server, server_config


class RawClient:
    """Just enough of a client to break the rules on purpose."""

    def __init__(self, server: LiveServer) -> None:
        self.sock = socket.create_connection(server.address("amqp"), timeout=WAIT_S)
        self.frames = FrameReader(frame_max=0, hard_max=1 << 24, expect_header=False)

    def read_all(self) -> bytes:
        chunks = []
        while data := self.sock.recv(65536):
            chunks.append(data)
        return b"".join(chunks)

    def next(self) -> InFrame:
        while (frame := self.frames.next_frame()) is None:
            data = self.sock.recv(65536)
            assert data, "the server closed without a frame"
            self.frames.receive_data(data)
        return frame

    def send(self, channel: int, method: object) -> None:
        self.sock.sendall(method_frame(channel, method))  # type: ignore[arg-type]

    def open(self, heartbeat: int = 0) -> None:
        """Handshake to an open connection (PLAIN guest/guest, open mode)."""
        self.sock.sendall(PROTOCOL_HEADER)
        assert isinstance(self.next().value, commands.Connection.Start)
        self.send(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest"
            ),
        )
        tune = self.next().value
        assert isinstance(tune, commands.Connection.Tune)
        self.send(
            0,
            commands.Connection.TuneOk(
                channel_max=0, frame_max=tune.frame_max, heartbeat=heartbeat
            ),
        )
        self.send(0, commands.Connection.Open(virtual_host="/"))
        assert isinstance(self.next().value, commands.Connection.OpenOk)

    def expect_close(self, code: int) -> commands.Connection.Close:
        frame = self.next()
        assert isinstance(frame.value, commands.Connection.Close), frame.value
        assert frame.value.reply_code == code, frame.value.reply_text
        self.send(0, commands.Connection.CloseOk())
        assert self.read_all() == b""
        return frame.value

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server: LiveServer) -> Iterator[RawClient]:
    client = RawClient(server)
    yield client
    client.close()
    _still_serving(server)


def _still_serving(server: LiveServer) -> None:
    with connect(server) as conn:
        conn.channel().queue_declare(unique("alive"))


def test_garbage_bytes_get_the_protocol_header_back(raw: RawClient) -> None:
    raw.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.read_all() == PROTOCOL_HEADER


@pytest.mark.parametrize("header", [b"AMQP\x00\x00\x08\x00", b"AMQP\x03\x01\x00\x00"])
def test_wrong_protocol_version_gets_ours_back(raw: RawClient, header: bytes) -> None:
    raw.sock.sendall(header)
    assert raw.read_all() == PROTOCOL_HEADER


def test_oversize_frame_is_a_frame_error(raw: RawClient) -> None:
    raw.open()
    raw.send(1, commands.Channel.Open())
    assert isinstance(raw.next().value, commands.Channel.OpenOk)
    raw.sock.sendall(struct.pack(">BHI", 1, 1, 64 << 20))  # announces 64 MiB
    close = raw.expect_close(501)
    assert "frame_max" in close.reply_text


def test_bad_frame_end_is_a_frame_error(raw: RawClient) -> None:
    raw.open()
    frame = bytearray(method_frame(1, commands.Channel.Open()))
    frame[-1] = 0x00
    raw.sock.sendall(bytes(frame))
    raw.expect_close(501)


def test_frame_on_an_unopened_channel_is_a_channel_error(raw: RawClient) -> None:
    raw.open()
    raw.send(5, commands.Queue.Declare(queue="nope"))
    raw.expect_close(504)


def test_content_without_a_method_is_unexpected(raw: RawClient) -> None:
    raw.open()
    raw.send(1, commands.Channel.Open())
    assert isinstance(raw.next().value, commands.Channel.OpenOk)
    raw.sock.sendall(struct.pack(">BHI", 3, 1, 3) + b"abc\xce")
    raw.expect_close(505)


def test_undecodable_method_is_a_frame_error(raw: RawClient) -> None:
    raw.open()
    raw.sock.sendall(struct.pack(">BHI", 1, 1, 6) + b"\x00\x99\x00\x99\xff\xff\xce")
    raw.expect_close(501)


def test_method_before_handshake_is_refused(raw: RawClient) -> None:
    raw.sock.sendall(PROTOCOL_HEADER)
    assert isinstance(raw.next().value, commands.Connection.Start)
    raw.send(1, commands.Channel.Open())
    raw.expect_close(504)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[LiveServer]:
    config = server_config(tmp_path, ("amqp",))
    auth = AuthConfig(
        mode="accounts",
        accounts=(AccountConfig(user="alice", password="s3cret", namespaces=("tenant-a",)),),
    )
    with live_server(
        tmp_path, ("amqp",), config=dataclasses.replace(config, auth=auth), factories=FACTORIES
    ) as live:
        yield live


def _params(
    server: LiveServer, user: str, password: str, vhost: str = "/"
) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        "127.0.0.1",
        server.port("amqp"),
        virtual_host=vhost,
        credentials=pika.PlainCredentials(user, password),
        connection_attempts=1,
    )


def test_bad_credentials_are_refused_with_403(guarded: LiveServer) -> None:
    with pytest.raises(ProbableAuthenticationError) as info:
        pika.BlockingConnection(_params(guarded, "alice", "wrong"))
    assert "ACCESS_REFUSED" in str(info.value)
    with pika.BlockingConnection(_params(guarded, "alice", "s3cret")) as conn:
        conn.channel().queue_declare(unique("tenant"))


def test_vhost_maps_to_a_namespace_the_user_may_use(guarded: LiveServer) -> None:
    with pika.BlockingConnection(_params(guarded, "alice", "s3cret", "tenant-a")) as conn:
        conn.channel().queue_declare(unique("by-name"))
    with pytest.raises(ProbableAccessDeniedError):
        pika.BlockingConnection(_params(guarded, "alice", "s3cret", "other-tenant"))


def test_amqplain_login(guarded: LiveServer) -> None:
    client = RawClient(guarded)
    try:
        client.sock.sendall(PROTOCOL_HEADER)
        assert isinstance(client.next().value, commands.Connection.Start)
        from pamqp import encode

        table = encode.field_table({"LOGIN": "alice", "PASSWORD": "s3cret"})[4:]
        client.send(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="AMQPLAIN", response=table.decode("latin-1")
            ),
        )
        assert isinstance(client.next().value, commands.Connection.Tune)
    finally:
        client.close()


def test_heartbeats_are_sent_and_a_silent_peer_is_dropped(raw: RawClient) -> None:
    raw.open(heartbeat=1)
    assert isinstance(raw.next().value, Heartbeat)  # the server beats
    # We send nothing back: after two intervals the server hangs up.
    rest = raw.read_all()  # returns at end of stream, raises on timeout
    assert rest == HEARTBEAT_BYTES * (len(rest) // len(HEARTBEAT_BYTES))


def test_unacked_deliveries_come_back_when_a_peer_vanishes(server: LiveServer) -> None:
    queue = unique("vanish")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for i in range(3):
            ch.basic_publish("", queue, str(i).encode())
    client = RawClient(server)
    client.open()
    client.send(1, commands.Channel.Open())
    assert isinstance(client.next().value, commands.Channel.OpenOk)
    client.send(1, commands.Basic.Consume(queue=queue, consumer_tag="t"))
    assert isinstance(client.next().value, commands.Basic.ConsumeOk)
    delivered = [client.next().value for _ in range(9)]  # 3 x (deliver, header, body)
    assert sum(isinstance(v, commands.Basic.Deliver) for v in delivered) == 3
    client.sock.close()  # no close handshake, no acks
    with connect(server) as conn:
        ch = conn.channel()
        got: list[bytes] = []
        deadline = time.monotonic() + WAIT_S
        while len(got) < 3 and time.monotonic() < deadline:
            method, _, body = ch.basic_get(queue, auto_ack=True)
            if method is not None:
                assert method.redelivered
                got.append(body)
        assert sorted(got) == [b"0", b"1", b"2"]


def test_publishes_before_a_hang_up_are_stored(server: LiveServer) -> None:
    queue = unique("hangup")
    with connect(server) as conn:
        conn.channel().queue_declare(queue)
    client = RawClient(server)
    client.open()
    client.send(1, commands.Channel.Open())
    assert isinstance(client.next().value, commands.Channel.OpenOk)
    raw_properties = encode_properties(commands.Basic.Properties())
    # Each publish is followed by a channel.flow-ok (a no-op without a reply), so each
    # is its own append: at the hang-up most of them are still queued in the channel.
    burst = b"".join(
        method_frame(1, commands.Basic.Publish(exchange="", routing_key=queue))
        + content_frames(1, raw_properties, str(i).encode(), 4096)
        + method_frame(1, commands.Channel.FlowOk(active=True))
        for i in range(300)
    )
    client.sock.sendall(burst)
    client.sock.close()  # straight after: no close handshake
    with connect(server) as conn:
        ch = conn.channel()
        deadline = time.monotonic() + WAIT_S
        while ch.queue_declare(queue, passive=True).method.message_count < 300:
            assert time.monotonic() < deadline, "publishes were lost"
            conn.sleep(0.02)
        assert ch.basic_get(queue, auto_ack=True)[2] == b"0"


def test_random_frames_get_a_protocol_error_never_a_crash(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fuzz after a handshake: random frame types, channels and payloads (some with a
    real method id). Each connection ends with the protocol's answer; none is logged
    as our own bug, and the server keeps serving."""
    rng = random.Random(20241129)
    method_ids = list(commands.INDEX_MAPPING)
    caplog.set_level(logging.ERROR)
    for _ in range(60):
        client = RawClient(server)
        try:
            client.open()
            client.send(1, commands.Channel.Open())
            assert isinstance(client.next().value, commands.Channel.OpenOk)
            payload = rng.randbytes(rng.randint(0, 60))
            if rng.random() < 0.6:
                payload = struct.pack(">I", rng.choice(method_ids)) + payload
            frame_type = rng.choice([1, 1, 1, 2, 3, 8, 9])
            channel = rng.choice([0, 1, 1, 2])
            header = struct.pack(">BHI", frame_type, channel, len(payload))
            client.sock.sendall(header + payload + b"\xce")
            bye = commands.Connection.Close(
                reply_code=200, reply_text="bye", class_id=0, method_id=0
            )
            client.send(0, bye)
            client.sock.settimeout(5)
            with contextlib.suppress(TimeoutError):
                client.read_all()
        finally:
            client.close()
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert bugs == []


def test_an_error_found_off_the_reader_closes_a_silent_peer(raw: RawClient) -> None:
    """A connection error raised by a channel's task (here basic.publish with
    immediate, refused when the publish is handled) while the reader waits on the
    socket: connection.close is sent and, although the peer neither answers close-ok
    nor sends anything else (no heartbeats either), the server ends the connection
    after its close-ok wait. The reader's wait is interrupted for it; a reader left
    waiting would hold the socket open for as long as the peer stays silent."""
    raw.open(heartbeat=0)
    raw.send(1, commands.Channel.Open())
    assert isinstance(raw.next().value, commands.Channel.OpenOk)
    raw.send(1, commands.Basic.Publish(exchange="", routing_key=unique("q"), immediate=True))
    raw.sock.sendall(content_frames(1, encode_properties(commands.Basic.Properties()), b"x", 0))
    close = raw.next().value
    assert isinstance(close, commands.Connection.Close), close
    assert close.reply_code == 540, close.reply_text
    assert raw.read_all() == b""  # closed by the server, within the socket's WAIT_S
