"""The gRPC server against grpcio's client on real sockets: every kind of call, what a
handler sees of its call, messages larger than every window (flow control both
ways), many calls at once, the statuses of calls that fail, cancellation, a
graceful stop, and TLS with ALPN h2."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme

from polymq.gateway.config import TlsConfig
from polymq.gateway.tls import ServerTls
from polymq.protocols.grpc_server.calls import Call, Method
from polymq.protocols.grpc_server.connection import Limits
from tests.grpc_server.harness import (
    BIDI_ECHO,
    COUNT,
    ECHO,
    FAIL,
    HOLD,
    INFO,
    WAIT_S,
    Probe,
    Served,
    serving,
    wait_until,
)

MiB = 1 << 20


@pytest.fixture
def served() -> Iterator[Served]:
    with serving() as server:
        yield server


@pytest.fixture
def channel(served: Served) -> Iterator[Any]:
    with served.channel() as channel:
        yield channel


def _code(error: pytest.ExceptionInfo[grpc.RpcError]) -> Any:
    return error.value.code()


# -- unary calls and what the handler sees --------------------------------------------


def test_unary_echo(served: Served, channel: Any) -> None:
    assert served.echo(channel, b"hello") == b"hello"
    assert served.echo(channel, b"") == b""


def test_handler_sees_metadata_peer_and_deadline(served: Served, channel: Any) -> None:
    info = channel.unary_unary(INFO)
    answer = json.loads(
        info(
            b"",
            timeout=WAIT_S,
            metadata=[
                ("x-text", "hello world"),
                ("x-data-bin", b"\x00\x01\xfe\xff"),
                ("x-twice", "one"),
                ("x-twice", "two"),
            ],
        )
    )
    metadata = [(key, value) for key, value in answer["metadata"]]
    assert ("x-text", "hello world") in metadata
    assert ("x-data-bin", {"bytes": "0001feff"}) in metadata
    assert [v for k, v in metadata if k == "x-twice"] == ["one", "two"]
    keys = {key for key, _ in metadata}
    assert not keys & {"content-type", "te", "grpc-timeout", "user-agent", "grpc-accept-encoding"}
    assert not any(key.startswith(":") for key in keys)

    peer = re.fullmatch(r"ipv4:127\.0\.0\.1:(\d+)", answer["peer"])
    assert peer is not None, answer["peer"]
    assert 0 < int(peer.group(1)) < 65536 and int(peer.group(1)) != served.port
    # grpc-timeout is the time left when the client sent it, and gRPC's encoding "may
    # round up" (its timeout_encoding.h): a 30 s call was once sent as 30.1 s
    assert WAIT_S / 2 < answer["remaining"] <= WAIT_S + 0.1

    assert json.loads(info(b""))["remaining"] is None


# -- large and many --------------------------------------------------------------------


def test_messages_larger_than_every_window_both_ways(served: Served, channel: Any) -> None:
    """3 MiB each way, over and again on one connection: more than the client's and
    the server's initial windows (stream and connection), so the calls need window
    updates in both directions; three calls are more than the server's whole
    connection window, which must be given back as calls take their bytes."""
    echo = channel.unary_unary(ECHO)
    for _ in range(3):
        request = os.urandom(3 * MiB)
        assert echo(request, timeout=WAIT_S) == request


def test_many_concurrent_calls_on_one_channel(served: Served, channel: Any) -> None:
    echo = channel.unary_unary(ECHO)
    requests = [b"%d:" % i + os.urandom(i * 97 % 20_000) for i in range(200)]
    start = threading.Barrier(20)

    def one(request: bytes) -> bytes:
        if requests.index(request) < 20:
            start.wait(WAIT_S)  # the first twenty leave at once
        answer: bytes = echo(request, timeout=WAIT_S)
        return answer

    with concurrent.futures.ThreadPoolExecutor(max_workers=40) as pool:
        answers = list(pool.map(one, requests))
    assert answers == requests


# -- streaming -------------------------------------------------------------------------


def test_server_streaming(channel: Any) -> None:
    count = channel.unary_stream(COUNT)
    call = count(b"5", timeout=WAIT_S)
    assert list(call) == [b"0", b"1", b"2", b"3", b"4"]
    assert call.code() == grpc.StatusCode.OK
    assert list(count(b"0", timeout=WAIT_S)) == []


def test_server_streaming_beyond_the_windows(channel: Any) -> None:
    """40 answers of 256 KiB: the handler's answers wait for the client's window."""
    answers = list(channel.unary_stream(COUNT)(b"40:262144", timeout=WAIT_S))
    assert [a[: a.index(b".")] for a in answers] == [b"%d" % i for i in range(40)]
    assert all(len(a) == len(b"%d" % i) + 262_144 for i, a in enumerate(answers))


def test_bidi_echoes_each_request_as_it_comes(served: Served, channel: Any) -> None:
    """The client sends its next request only once the last one's echo is back: the
    server answers each as it arrives, not once the client half-closes. Then the
    handler sees the end of the requests."""
    answered: queue.Queue[bytes] = queue.Queue()
    sent: list[bytes] = []

    def requests() -> Iterator[bytes]:
        for i in range(5):
            sent.append(b"request %d" % i)
            yield sent[-1]
            assert answered.get(timeout=WAIT_S) == sent[-1]

    answers = []
    call = channel.stream_stream(BIDI_ECHO)(requests(), timeout=WAIT_S)
    for answer in call:
        answers.append(answer)
        answered.put(answer)
    assert answers == [*sent, b"end"]
    assert len(sent) == 5
    assert served.probe.ended.is_set()
    assert call.code() == grpc.StatusCode.OK


# -- calls that fail -------------------------------------------------------------------


def test_unknown_method_is_unimplemented(served: Served, channel: Any) -> None:
    with pytest.raises(grpc.RpcError) as error:
        channel.unary_unary("/test.Grpc/Nothing%41here")(b"x", timeout=WAIT_S)
    assert _code(error) == grpc.StatusCode.UNIMPLEMENTED
    # grpc-message is percent-encoded on the wire; grpcio decodes it back
    assert error.value.details() == "Method not found: /test.Grpc/Nothing%41here"
    assert served.echo(channel) == b"still serving"


def test_a_request_over_the_limit_is_resource_exhausted() -> None:
    limits = Limits(max_message_bytes=64 << 10, handshake_timeout_s=WAIT_S)
    with serving(limits) as served, served.channel() as channel:
        echo = channel.unary_unary(ECHO)
        assert echo(b"x" * (64 << 10), timeout=WAIT_S) == b"x" * (64 << 10)  # the limit itself
        with pytest.raises(grpc.RpcError) as error:
            echo(b"x" * ((64 << 10) + 1), timeout=WAIT_S)
        assert _code(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as error:
            echo(b"x" * (8 * MiB), timeout=WAIT_S)  # more than the connection window
        assert _code(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert served.echo(channel) == b"still serving"


def test_a_failing_handler_is_unknown_and_the_server_serves_on(
    served: Served, channel: Any
) -> None:
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(FAIL)(b"x", timeout=WAIT_S)
        assert _code(error) == grpc.StatusCode.UNKNOWN
        assert "the handler failed" not in error.value.details()
        assert served.echo(channel) == b"still serving"


def _failing_parse(probe: Probe) -> dict[str, Method]:
    def parse(data: bytes) -> bytes:
        raise ValueError("not a request")

    async def never(request: bytes, call: Call) -> bytes:
        raise AssertionError("a request that did not parse reached its handler")

    return {"/test.Grpc/Unparsable": Method(never, parse, bytes)}


def test_a_request_that_does_not_parse_fails_its_call_only() -> None:
    """A parser that raises fails its call with INTERNAL (as grpcio's server answers a
    deserializer's failure); the other calls on the connection go on."""
    with serving(extra=_failing_parse) as served, served.channel() as channel:
        held = channel.unary_unary(HOLD).future(b"held", timeout=WAIT_S)
        wait_until(served.probe.entered.is_set, "the held call")
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/test.Grpc/Unparsable")(b"x", timeout=WAIT_S)
        assert _code(error) == grpc.StatusCode.INTERNAL
        served.release()
        assert held.result() == b"held"  # the other call on the connection lives on


@pytest.mark.parametrize("how", ["cancel", "deadline", "bidi cancel"])
def test_a_call_the_client_gives_up_is_cancelled_on_the_server(
    served: Served, channel: Any, how: str
) -> None:
    if how == "bidi cancel":
        future = channel.stream_stream(BIDI_ECHO)(iter(lambda: b"x", None), timeout=WAIT_S)
    else:
        timeout = 0.5 if how == "deadline" else WAIT_S
        future = channel.unary_unary(HOLD).future(b"x", timeout=timeout)
    wait_until(served.probe.entered.is_set, "the handler to start")
    if how != "deadline":
        future.cancel()
    assert served.probe.cancelled.wait(WAIT_S), "the handler was not cancelled"
    expected = grpc.StatusCode.DEADLINE_EXCEEDED if how == "deadline" else grpc.StatusCode.CANCELLED
    assert future.code() == expected
    assert served.echo(channel) == b"still serving"


# -- stopping --------------------------------------------------------------------------


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()
    except ConnectionRefusedError:
        return True
    return False


def test_stop_lets_a_call_in_flight_finish_and_refuses_new_connections() -> None:
    with serving() as served, served.channel() as channel:
        held = channel.unary_unary(HOLD).future(b"in flight", timeout=WAIT_S)
        wait_until(served.probe.entered.is_set, "the held call")
        stopping = concurrent.futures.Future[None]()
        served.loop.call_soon_threadsafe(
            lambda: served.loop.create_task(served.server.stop(WAIT_S)).add_done_callback(
                lambda task: stopping.set_result(task.result())
            )
        )
        wait_until(lambda: _refused(served.port), "the listener to close")
        assert not stopping.done()  # waiting for the call
        served.release()
        assert held.result() == b"in flight"
        stopping.result(WAIT_S)
        assert served.server.connections == 0
        assert _refused(served.port)
        assert not served.probe.cancelled.is_set()


def test_stop_cuts_a_call_still_running_after_the_grace() -> None:
    with serving() as served, served.channel() as channel:
        held = channel.unary_unary(HOLD).future(b"x", timeout=WAIT_S)
        wait_until(served.probe.entered.is_set, "the held call")
        served.run(served.server.stop(0.2))
        assert served.probe.cancelled.wait(WAIT_S)
        assert held.code() == grpc.StatusCode.UNAVAILABLE
        assert served.server.connections == 0


# -- TLS -------------------------------------------------------------------------------


def test_tls_with_alpn_h2(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    chain, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.cert_chain_pems[0].write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    context = ServerTls(TlsConfig(cert_file=chain, key_file=key)).h2_context
    with serving(tls=context) as served:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(
            served.target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
        ) as channel:
            assert served.echo(channel, b"over tls") == b"over tls"
            assert list(channel.unary_stream(COUNT)(b"3", timeout=WAIT_S)) == [b"0", b"1", b"2"]
