"""A :class:`GrpcServer` on a uvloop loop of its own thread (as ``polymq run`` serves),
on 127.0.0.1 and a port the system picks, serving generic methods over raw bytes; and
grpcio channels to it.

The loop's exception handler is watched: an error nobody handled on the server's loop
(a task's exception never retrieved, a protocol callback that raised) fails the test
that caused it when its server stops."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import uvloop

from polymq.protocols.grpc_server.calls import Call, Method
from polymq.protocols.grpc_server.connection import Limits
from polymq.protocols.grpc_server.server import GrpcServer
from tests.workers.helpers import wait_until

__all__ = [
    "BIDI_ECHO",
    "COUNT",
    "ECHO",
    "FAIL",
    "HOLD",
    "INFO",
    "SINK",
    "WAIT_S",
    "Probe",
    "Served",
    "methods",
    "serving",
    "wait_until",
]

WAIT_S = 30.0  # how long a test waits for anything before it fails
STOP_GRACE_S = 5.0

ECHO = "/test.Grpc/Echo"  # unary: the request back
INFO = "/test.Grpc/Info"  # unary: what the handler saw of its call, as JSON
FAIL = "/test.Grpc/Fail"  # unary: the handler raises
HOLD = "/test.Grpc/Hold"  # unary: waits for probe.released, then the request back
COUNT = "/test.Grpc/Count"  # server streaming: b"n" or b"n:size" -> n answers
BIDI_ECHO = "/test.Grpc/BidiEcho"  # each request back as it comes, then b"end"
SINK = "/test.Grpc/Sink"  # bidi: reads nothing until probe.released, then counts

T = TypeVar("T")


class Probe:
    """What a test sees of (and does to) its server's handlers."""

    def __init__(self) -> None:
        self.entered = threading.Event()  # a HOLD, SINK or BIDI_ECHO handler started
        self.cancelled = threading.Event()  # a handler saw CancelledError
        self.ended = threading.Event()  # a BIDI_ECHO handler saw its requests end
        self.released = asyncio.Event()  # set on the server's loop: Served.release()


def methods(probe: Probe) -> dict[str, Method]:
    async def echo(request: bytes, call: Call) -> bytes:
        return request

    async def info(request: bytes, call: Call) -> bytes:
        shown = [
            [key, {"bytes": value.hex()} if isinstance(value, bytes) else value]
            for key, value in call.invocation_metadata()
        ]
        return json.dumps(
            {"peer": call.peer(), "metadata": shown, "remaining": call.time_remaining()}
        ).encode()

    async def fail(request: bytes, call: Call) -> bytes:
        raise RuntimeError("the handler failed (on purpose)")

    async def hold(request: bytes, call: Call) -> bytes:
        probe.entered.set()
        try:
            await probe.released.wait()
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        return request

    async def count(request: bytes, call: Call) -> AsyncIterator[bytes]:
        n, _, size = request.partition(b":")
        for i in range(int(n)):
            yield b"%d" % i + b"." * (int(size) if size else 0)

    async def bidi_echo(requests: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
        probe.entered.set()
        try:
            async for request in requests:
                yield request
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        probe.ended.set()
        yield b"end"

    async def sink(requests: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
        probe.entered.set()
        await probe.released.wait()
        taken = 0
        async for _ in requests:
            taken += 1
        yield b"%d" % taken

    return {
        ECHO: Method(echo, bytes, bytes),
        INFO: Method(info, bytes, bytes),
        FAIL: Method(fail, bytes, bytes),
        HOLD: Method(hold, bytes, bytes),
        COUNT: Method(count, bytes, bytes, server_streaming=True),
        BIDI_ECHO: Method(bidi_echo, bytes, bytes, client_streaming=True, server_streaming=True),
        SINK: Method(sink, bytes, bytes, client_streaming=True, server_streaming=True),
    }


class Served:
    """A running server: its loop, its port, and grpcio channels to it."""

    def __init__(
        self, server: GrpcServer, loop: asyncio.AbstractEventLoop, port: int, probe: Probe
    ) -> None:
        self.server = server
        self.loop = loop
        self.port = port
        self.probe = probe
        self.target = f"127.0.0.1:{port}"

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = WAIT_S) -> T:
        """``coroutine`` run on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def release(self) -> None:
        """Let the HOLD and SINK handlers go on."""
        self.loop.call_soon_threadsafe(self.probe.released.set)

    def channel(self, *options: tuple[str, Any]) -> Any:
        return grpc.insecure_channel(
            self.target,
            options=[("grpc.max_receive_message_length", -1), ("grpc.enable_retries", 0), *options],
        )

    def echo(self, channel: Any, payload: bytes = b"still serving") -> bytes:
        answer: bytes = channel.unary_unary(ECHO)(payload, timeout=WAIT_S)
        return answer

    def assert_serving(self) -> None:
        """A normal grpcio call on a fresh channel is answered."""
        with self.channel() as channel:
            assert self.echo(channel) == b"still serving"


@contextmanager
def serving(
    limits: Limits | None = None,
    *,
    tls: ssl.SSLContext | None = None,
    extra: Callable[[Probe], dict[str, Method]] | None = None,
) -> Iterator[Served]:
    """A server of :func:`methods` (and ``extra``'s) until the block ends."""
    limits = limits or Limits(max_message_bytes=4 << 20, handshake_timeout_s=WAIT_S)
    probe = Probe()
    table = methods(probe) | (extra(probe) if extra is not None else {})
    errors: list[dict[str, Any]] = []
    loop = uvloop.new_event_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    thread = threading.Thread(target=loop.run_forever, name="grpc-server", daemon=True)
    thread.start()
    server = GrpcServer(table, limits)
    try:
        _, port = asyncio.run_coroutine_threadsafe(
            server.start("127.0.0.1", 0, tls=tls), loop
        ).result(WAIT_S)
        yield Served(server, loop, port, probe)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(_stopped(server), loop).result(WAIT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(WAIT_S)
            loop.close()
    assert not errors, f"unhandled errors on the server's loop: {errors}"


async def _stopped(server: GrpcServer) -> None:
    await server.stop(STOP_GRACE_S)
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
