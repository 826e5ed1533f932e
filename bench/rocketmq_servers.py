"""What one RocketMQ ``SendMessage`` call costs a bare gRPC server, per server model.

Issue 21 asks which gRPC server model polymq's RocketMQ listener should use. This
runs the same trivial ``MessagingService/SendMessage`` (parse the request, answer a
fixed ``SendMessageResponse``: no storage, no adapter) on each candidate, one at a
time, in its own process, and drives it from this process with a raw grpc stub
(grpcio's C-core sync channel: the cheapest client at hand, so the server's cost
is what shows), one call at a time and then with calls in flight:

- ``aio``: ``grpc.aio.server`` on uvloop (what the listener ran until polymq's own);
- ``sync``: ``grpc.server`` with a thread pool (grpcio's classic model);
- ``grpclib``: grpclib 0.4 over the pure-Python ``h2`` HTTP/2 stack, on uvloop;
- ``h2raw``: a hand-written HTTP/2 framing loop on a uvloop ``Protocol`` (``hpack``
  for the request headers, the response's frames precomputed), unary calls only, no
  flow control beyond a large window: not a server anyone could run, the floor of
  what a gRPC server written for this one job could cost in Python;
- ``polymq``: polymq's own gRPC server (``polymq.protocols.grpc_server``), what the
  listener runs since grpc.aio's per-call cost was found to be most of RocketMQ's.
  (The ``h2`` library's state machine under a bare protocol cost 456-622 µs a call
  here, more than grpc.aio: it is not a row.)

    .venv/bin/python -m bench.rocketmq_servers [--servers aio,sync,grpclib] [--runs 3]

Prints calls/s, the server's CPU per call and the client's CPU per call (medians of
``--runs``). grpclib is not a dependency of polymq: ``pip install grpclib`` for its row
(it is skipped when missing); ``h2raw`` needs ``hpack``, which grpclib brings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench._server import HOST, Meter, free_port

SERVERS = ("aio", "sync", "grpclib", "h2raw", "polymq")
METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"
CALLS = 3_000
IN_FLIGHT = 16
START_TIMEOUT_S = 20.0


def _response() -> bytes:
    from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

    status = definition_pb2.Status(code=Code.OK, message="OK")
    entry = service_pb2.SendResultEntry(status=status, message_id="01" + "0" * 32, offset=1)
    return bytes(
        service_pb2.SendMessageResponse(status=status, entries=[entry]).SerializeToString()
    )


def _request(size: int) -> Any:
    from rocketmq.grpc_protocol import definition_pb2, service_pb2

    msg = definition_pb2.Message(body=b"x" * size)
    msg.topic.name = "bench"
    msg.system_properties.message_id = "01" + "0" * 32
    msg.system_properties.message_type = definition_pb2.NORMAL
    msg.system_properties.body_encoding = definition_pb2.IDENTITY
    return service_pb2.SendMessageRequest(messages=[msg])


def _serve_aio(port: int) -> None:
    import grpc
    from rocketmq.grpc_protocol import service_pb2

    answer = _response()

    async def send(request: Any, context: Any) -> bytes:
        return answer

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            send, request_deserializer=service_pb2.SendMessageRequest.FromString
        )
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "apache.rocketmq.v2.MessagingService", {"SendMessage": handler}
                ),
            )
        )
        server.add_insecure_port(f"{HOST}:{port}")
        await server.start()
        await server.wait_for_termination()

    _run(main())


def _serve_sync(port: int) -> None:
    import grpc
    from rocketmq.grpc_protocol import service_pb2

    answer = _response()

    def send(request: Any, context: Any) -> bytes:
        return answer

    server = grpc.server(ThreadPoolExecutor(IN_FLIGHT))
    handler = grpc.unary_unary_rpc_method_handler(
        send, request_deserializer=service_pb2.SendMessageRequest.FromString
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "apache.rocketmq.v2.MessagingService", {"SendMessage": handler}
            ),
        )
    )
    server.add_insecure_port(f"{HOST}:{port}")
    server.start()
    server.wait_for_termination()


def _serve_grpclib(port: int) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server
    from rocketmq.grpc_protocol import service_pb2

    answer = service_pb2.SendMessageResponse.FromString(_response())

    class Service:
        async def send(self, stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(answer)

        def __mapping__(self) -> dict[str, Any]:
            return {
                METHOD: Handler(
                    self.send,
                    Cardinality.UNARY_UNARY,
                    service_pb2.SendMessageRequest,
                    service_pb2.SendMessageResponse,
                )
            }

    async def main() -> None:
        server = Server([Service()])
        await server.start(HOST, port)
        await server.wait_closed()

    _run(main())


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME = struct.Struct(">I B I")  # length << 8 | type, flags, stream id
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
# :status 200 (static index 8); content-type: application/grpc, literal without
# indexing (static name 31): no HPACK state, so the same bytes on every stream.
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
_TRAILERS = b"\x00\x0bgrpc-status\x010"
_BIG_WINDOW = (1 << 31) - 1 - 65_535


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return _FRAME.pack(len(payload) << 8 | kind, flags, stream) + payload


def _serve_h2raw(port: int) -> None:
    import hpack
    from rocketmq.grpc_protocol import service_pb2

    answer = _response()
    body = b"\x00" + struct.pack(">I", len(answer)) + answer
    parse = service_pb2.SendMessageRequest.FromString

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buffer = b""
            self.preface = False
            self.decoder = hpack.Decoder()
            self.streams: dict[int, bytearray] = {}
            self.received = 0
            transport.write(
                _frame(_SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 30))  # initial window
                + _frame(_WINDOW, 0, 0, struct.pack(">I", _BIG_WINDOW))
            )

        def data_received(self, data: bytes) -> None:
            buffer = self.buffer + data if self.buffer else data
            if not self.preface:
                if len(buffer) < len(_PREFACE):
                    self.buffer = buffer
                    return
                buffer = buffer[len(_PREFACE) :]
                self.preface = True
            out: list[bytes] = []
            at, end = 0, len(buffer)
            while end - at >= 9:
                head, flags, stream = _FRAME.unpack_from(buffer, at)
                length, kind = head >> 8, head & 0xFF
                if end - at - 9 < length:
                    break
                payload = buffer[at + 9 : at + 9 + length]
                at += 9 + length
                stream &= 0x7FFFFFFF
                if kind == _DATA:
                    if flags & _PADDED:
                        payload = payload[1 : len(payload) - payload[0]]
                    self.streams.setdefault(stream, bytearray()).extend(payload)
                    self.received += length
                    if flags & _END_STREAM:
                        self._answer(stream, out)
                elif kind == _HEADERS:
                    if flags & _PADDED:
                        payload = payload[1 : len(payload) - payload[0]]
                    if flags & _PRIORITY:
                        payload = payload[5:]
                    self.decoder.decode(payload, raw=True)  # keeps the HPACK table in step
                    self.streams[stream] = bytearray()
                elif kind == _SETTINGS and not flags & _ACK:
                    out.append(_frame(_SETTINGS, _ACK, 0, b""))
                elif kind == _PING and not flags & _ACK:
                    out.append(_frame(_PING, _ACK, 0, payload))
                elif kind in (_RST, _GOAWAY):
                    self.streams.pop(stream, None)
            self.buffer = buffer[at:]
            if self.received > 1 << 29:  # give the window back, now and then
                out.append(_frame(_WINDOW, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
            if out:
                self.transport.write(b"".join(out))

        def _answer(self, stream: int, out: list[bytes]) -> None:
            message = self.streams.pop(stream)
            parse(bytes(message[5:]))
            out.append(_frame(_HEADERS, _END_HEADERS, stream, _RESPONSE_HEADERS))
            out.append(_frame(_DATA, 0, stream, body))
            out.append(_frame(_HEADERS, _END_HEADERS | _END_STREAM, stream, _TRAILERS))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Connection, HOST, port)
        await server.serve_forever()

    _run(main())


def _serve_polymq(port: int) -> None:
    from rocketmq.grpc_protocol import service_pb2

    from polymq.protocols.grpc_server.calls import Method
    from polymq.protocols.grpc_server.connection import Limits
    from polymq.protocols.grpc_server.server import GrpcServer

    answer = service_pb2.SendMessageResponse.FromString(_response())

    async def send(request: Any, call: Any) -> Any:
        return answer

    async def main() -> None:
        method = Method(
            send,
            service_pb2.SendMessageRequest.FromString,
            service_pb2.SendMessageResponse.SerializeToString,
        )
        server = GrpcServer(
            {METHOD: method}, Limits(max_message_bytes=4 << 20, handshake_timeout_s=10.0)
        )
        await server.start(HOST, port)
        await asyncio.Event().wait()

    _run(main())


def _run(main: Any) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)


_SERVE: dict[str, Callable[[int], None]] = {
    "aio": _serve_aio,
    "sync": _serve_sync,
    "grpclib": _serve_grpclib,
    "h2raw": _serve_h2raw,
    "polymq": _serve_polymq,
}


@contextlib.contextmanager
def _server(kind: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.rocketmq_servers", "--serve", kind, "--port", str(port)]
    )
    try:
        import grpc

        channel = grpc.insecure_channel(f"{HOST}:{port}")
        grpc.channel_ready_future(channel).result(START_TIMEOUT_S)
        channel.close()
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _drive(port: int, pid: int, in_flight: int) -> tuple[float, float, float]:
    """calls/s, server CPU µs per call, client CPU µs per call."""
    import grpc

    request = _request(100)
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        call = channel.unary_unary(
            METHOD, request_serializer=lambda r: r.SerializeToString(), response_deserializer=bytes
        )
        for _ in range(50):
            call(request)
        meter = Meter(pid)
        per_thread = CALLS // in_flight
        server0, client0, start = meter.cpu(), _cpu_self(), time.perf_counter()

        def loop() -> None:
            for _ in range(per_thread):
                call(request)

        threads = [threading.Thread(target=loop) for _ in range(in_flight)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        calls = per_thread * in_flight
        return (
            calls / elapsed,
            (meter.cpu() - server0) / calls * 1e6,
            (_cpu_self() - client0) / calls * 1e6,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _SERVE[args.serve](args.port)
        return
    print(
        f"# bare SendMessage per gRPC server model, {CALLS} calls of 100 B, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'server':<10} {'in flight':>9} {'calls/s':>9} "
        f"{'server us/call':>15} {'client us/call':>15}"
    )
    for kind in args.servers.split(","):
        if kind in ("grpclib", "h2raw"):
            try:
                import grpclib  # noqa: F401
                import hpack  # noqa: F401
            except ImportError:
                print(f"{kind:<10} skipped: grpclib/hpack are not installed")
                continue
        for in_flight in (1, IN_FLIGHT):
            rows = []
            for _ in range(args.runs):
                with _server(kind) as (port, pid):
                    rows.append(_drive(port, pid, in_flight))
            rate, server, client = (statistics.median(col) for col in zip(*rows, strict=True))
            print(
                f"{kind:<10} {in_flight:>9} {rate:>9.0f} {server:>15.0f} {client:>15.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
