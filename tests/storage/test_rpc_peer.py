"""The storage RPC over real loopback sockets: many calls in flight on one connection,
typed errors, cancellation reaching the server, lost and refused connections, and bad
peers that cost only their own connection."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgpack
import pytest

from polymq.storage import errors
from polymq.storage.model import Message, QueueRef, StoredMessage
from polymq.storage.rpc import RpcClient, RpcServer, codec
from polymq.storage.rpc.peer import Handler

WAIT = 10.0  # seconds: generous bound on waits for a condition, never a timing claim

ServerFactory = Callable[[Mapping[str, Handler]], Awaitable[RpcServer]]


@pytest.fixture(params=[True, False], ids=["eager", "tasks"])
async def serve(request: pytest.FixtureRequest) -> AsyncIterator[ServerFactory]:
    """Servers of both kinds: handlers started at once or each in a task."""
    servers: list[RpcServer] = []

    async def start(handlers: Mapping[str, Handler]) -> RpcServer:
        server = RpcServer(handlers, eager_start=request.param)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[RpcServer], RpcClient]]:
    made: list[RpcClient] = []

    def connect(server: RpcServer) -> RpcClient:
        client = RpcClient(*server.address)
        made.append(client)
        return client

    yield connect
    for client in made:
        await client.close()


async def echo(*args: Any, **kwargs: Any) -> Any:
    return [list(args), kwargs]


class Blocking:
    """A handler that waits until it is cancelled, and says when it started and when
    it was cancelled."""

    def __init__(self, *, yields_first: bool = False) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self._yields_first = yields_first

    async def __call__(self) -> None:
        if self._yields_first:  # so it is cancelled in its task, not in its first step
            await asyncio.sleep(0)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_values_cross_unchanged(serve: ServerFactory, clients: Any) -> None:
    client = clients(await serve({"echo": echo}))
    message = StoredMessage(
        message=Message(body=b"\x00hi", properties=(("k", b"v"), ("k", b"w"))),
        queue=QueueRef("ns", "t", 1),
        offset=4,
        message_id="id",
        store_timestamp_ms=9,
    )
    args, kwargs = await client.call("echo", message, (1, 2), tags=frozenset({"a"}))
    assert args == [message, (1, 2)]
    assert kwargs == {"tags": frozenset({"a"})}


async def test_many_calls_are_in_flight_at_once_on_one_connection(
    serve: ServerFactory, clients: Any
) -> None:
    """Every call must reach the server before any returns (a barrier): calls sent one
    at a time, or served one at a time, would never finish."""
    count = 200
    arrived = 0
    all_in = asyncio.Event()

    async def barrier(n: int) -> int:
        nonlocal arrived
        arrived += 1
        if arrived == count:
            all_in.set()
        await all_in.wait()
        return n * 2

    server = await serve({"barrier": barrier})
    client = clients(server)
    async with asyncio.timeout(WAIT):
        results = await asyncio.gather(*(client.call("barrier", n) for n in range(count)))
    assert results == [n * 2 for n in range(count)]
    assert len(server._connections) == 1


async def test_calls_made_in_one_tick_go_out_in_one_write() -> None:
    """A raw listener sees every frame of a burst in its first read."""
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await received.put(await reader.read(1 << 20))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    client = RpcClient(*listener.sockets[0].getsockname()[:2])
    calls = [asyncio.ensure_future(client.call("m", n)) for n in range(50)]
    async with asyncio.timeout(WAIT):
        first_read = await received.get()
        await asyncio.gather(*calls, return_exceptions=True)
    frames = codec.FrameDecoder().feed(first_read)
    assert [f.args for f in frames if isinstance(f, codec.Request)] == [[n] for n in range(50)]
    await client.close()
    listener.close()


@pytest.mark.parametrize(
    "error",
    [
        errors.TopicNotFound("no topic 't'"),
        errors.InvalidReceipt("stale"),
        errors.StorageFailed("disk"),
        errors.StorageUnavailable("node down"),
        errors.MessageTooLarge("big"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_storage_errors_keep_their_type(
    serve: ServerFactory, clients: Any, error: errors.StorageError
) -> None:
    async def fail() -> None:
        raise error

    client = clients(await serve({"fail": fail}))
    with pytest.raises(type(error)) as raised:
        await client.call("fail")
    assert type(raised.value) is type(error)
    assert str(raised.value) == str(error)


async def test_offset_out_of_range_keeps_its_bounds(serve: ServerFactory, clients: Any) -> None:
    async def fail() -> None:
        raise errors.OffsetOutOfRange("offset 1 is below 3", earliest=3, latest=9)

    client = clients(await serve({"fail": fail}))
    with pytest.raises(errors.OffsetOutOfRange) as raised:
        await client.call("fail")
    assert (raised.value.earliest, raised.value.latest) == (3, 9)


async def test_a_handler_bug_is_a_storage_error_and_the_server_goes_on(
    serve: ServerFactory, clients: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken() -> None:
        raise ZeroDivisionError("oops")

    async def unencodable() -> object:
        return object()

    client = clients(await serve({"broken": broken, "unencodable": unencodable, "echo": echo}))
    for method in ("broken", "unencodable"):
        with pytest.raises(errors.StorageError) as raised:
            await client.call(method)
        assert type(raised.value) is errors.StorageError
    assert "ZeroDivisionError" in caplog.text
    assert await client.call("echo", 1) == [[1], {}]


async def test_unknown_method_is_invalid_argument_and_the_connection_stays(
    serve: ServerFactory, clients: Any
) -> None:
    server = await serve({"echo": echo})
    client = clients(server)
    with pytest.raises(errors.InvalidArgument, match="nope"):
        await client.call("nope")
    assert await client.call("echo") == [[], {}]
    assert len(server._connections) == 1


async def test_wrong_arguments_are_an_error_not_a_crash(serve: ServerFactory, clients: Any) -> None:
    async def one(x: int) -> int:
        return x

    client = clients(await serve({"one": one}))
    with pytest.raises(errors.StorageError):
        await client.call("one", 1, 2)
    assert await client.call("one", 3) == 3


async def test_an_unencodable_argument_fails_the_call_only(
    serve: ServerFactory, clients: Any
) -> None:
    client = clients(await serve({"echo": echo}))
    with pytest.raises(errors.InvalidArgument):
        await client.call("echo", object())
    with pytest.raises(errors.InvalidArgument):
        await client.call("echo", 2**64)
    assert await client.call("echo", 2) == [[2], {}]


async def test_handlers_that_wait_several_times_run_to_the_end(
    serve: ServerFactory, clients: Any
) -> None:
    """A handler runs at once until it first waits, then in a task: every kind of
    wait after that (a bare yield, a future, a timer) still resumes it correctly."""
    release = asyncio.Event()

    async def steps(n: int) -> list[int]:
        seen = [n]
        await asyncio.sleep(0)
        seen.append(n + 1)
        await release.wait()
        await asyncio.sleep(0.001)
        seen.append(n + 2)
        return seen

    client = clients(await serve({"steps": steps}))
    calls = [asyncio.ensure_future(client.call("steps", n)) for n in (0, 10)]
    await asyncio.sleep(0.01)
    release.set()
    async with asyncio.timeout(WAIT):
        assert await asyncio.gather(*calls) == [[0, 1, 2], [10, 11, 12]]


@pytest.mark.parametrize("yields_first", [False, True])
async def test_cancelling_a_call_cancels_the_work_on_the_server(
    serve: ServerFactory, clients: Any, yields_first: bool
) -> None:
    wait_forever = Blocking(yields_first=yields_first)
    started, cancelled = wait_forever.started, wait_forever.cancelled
    client = clients(await serve({"wait": wait_forever, "echo": echo}))
    call = asyncio.ensure_future(client.call("wait"))
    async with asyncio.timeout(WAIT):
        await started.wait()
        call.cancel()
        await cancelled.wait()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await client.call("echo", "after") == [["after"], {}]


async def test_a_result_answered_after_the_cancel_goes_to_undo(
    serve: ServerFactory, clients: Any
) -> None:
    """A server that finished before the cancel reached it answers anyway: an
    undoable call hands that late result to its undo; a plain call drops it."""
    started, cancel_seen = asyncio.Event(), asyncio.Event()

    async def finishes_anyway(value: str) -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancel_seen.set()
        return value

    server = await serve({"pop": finishes_anyway, "echo": echo})
    client = clients(server)
    undone: list[Any] = []
    for call in (
        client.call_undoable(undone.append, "pop", "undo me"),
        client.call("pop", "dropped"),
    ):
        started.clear()
        cancel_seen.clear()
        task = asyncio.ensure_future(call)
        async with asyncio.timeout(WAIT):
            await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(WAIT):
            await cancel_seen.wait()
    # Answers come in order on the one connection: both late ones are in by now.
    assert await client.call("echo", "after") == [["after"], {}]
    assert undone == ["undo me"]


async def test_a_client_that_goes_away_has_its_work_cancelled(
    serve: ServerFactory,
) -> None:
    wait_forever = Blocking()
    started, cancelled = wait_forever.started, wait_forever.cancelled
    server = await serve({"wait": wait_forever})
    client = RpcClient(*server.address)
    call = asyncio.ensure_future(client.call("wait"))
    async with asyncio.timeout(WAIT):
        await started.wait()
        await client.close()
        await cancelled.wait()
        with pytest.raises(errors.StorageUnavailable):
            await call


async def test_refused_connection_is_unavailable_and_the_next_call_reconnects() -> None:
    server = RpcServer({"echo": echo})
    await server.start()
    host, port = server.address
    await server.close()
    client = RpcClient(host, port)
    with pytest.raises(errors.StorageUnavailable, match=f"{port}"):
        await client.call("echo")
    restarted = RpcServer({"echo": echo}, host, port)
    await restarted.start()
    try:
        assert await client.call("echo", 1) == [[1], {}]
    finally:
        await client.close()
        await restarted.close()


async def test_lost_connection_fails_calls_in_flight_then_reconnects() -> None:
    wait_forever = Blocking()
    started = wait_forever.started
    server = RpcServer({"wait": wait_forever, "echo": echo})
    await server.start()
    host, port = server.address
    client = RpcClient(host, port)
    calls = [asyncio.ensure_future(client.call("wait")) for _ in range(5)]
    async with asyncio.timeout(WAIT):
        await started.wait()
        await server.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, errors.StorageUnavailable) for o in outcomes), outcomes
    restarted = RpcServer({"echo": echo}, host, port)
    await restarted.start()
    try:
        assert await client.call("echo", 2) == [[2], {}]
    finally:
        await client.close()
        await restarted.close()


async def test_a_hand_over_answers_the_calls_in_flight_and_refuses_new_ones_unrun(
    serve: ServerFactory, clients: Any
) -> None:
    """``close(grace)``: a write in flight finishes and is answered (cut off, its
    client would see a write that took effect fail); a long poll is cut at once; a
    call arriving meanwhile is refused as NotSent, naming the address, and never
    runs."""
    release = asyncio.Event()
    writing = asyncio.Event()
    ran: list[str] = []

    async def write(body: str) -> str:
        writing.set()
        await release.wait()
        ran.append(body)
        return body

    long_poll = Blocking()

    async def pop(wait_ms: int) -> None:
        await long_poll()

    server = await serve({"write": write, "pop": pop})
    client = clients(server)
    written = asyncio.ensure_future(client.call("write", "first"))
    polled = asyncio.ensure_future(client.call("pop", wait_ms=30_000))
    async with asyncio.timeout(WAIT):
        await writing.wait()
        await long_poll.started.wait()
        # Were the long poll waited for, the close would outlast the timeout.
        closing = asyncio.ensure_future(server.close(grace=3 * WAIT))
        with pytest.raises(errors.NotSent) as refused:
            await client.call("write", "second")
        assert refused.value.target == client.target
        release.set()
        assert await written == "first"
        await closing
        with pytest.raises(errors.StorageUnavailable):
            await polled
    assert ran == ["first"]


async def test_closed_client_refuses_calls(serve: ServerFactory) -> None:
    client = RpcClient(*(await serve({"echo": echo})).address)
    assert await client.call("echo") == [[], {}]
    await client.close()
    with pytest.raises(errors.StorageClosed):
        await client.call("echo")


def raw_frame(value: Any) -> bytes:
    payload: bytes = msgpack.packb(value)
    return struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1",
        struct.pack(">I", 0xFFFFFFFF),
        raw_frame([7, 1]),
        raw_frame([1, 1, "a result from a client"]),
        raw_frame([0, 1, "echo", "not a list", {}]),
    ],
    ids=["not-msgpack", "too-long", "unknown-kind", "result-from-client", "bad-args"],
)
async def test_a_malformed_frame_closes_only_its_connection(
    serve: ServerFactory, clients: Any, garbage: bytes
) -> None:
    server = await serve({"echo": echo})
    good = clients(server)
    assert await good.call("echo", 1) == [[1], {}]
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(garbage)
    async with asyncio.timeout(WAIT):
        assert await reader.read() == b""  # closed by the server
    writer.close()
    assert await good.call("echo", 2) == [[2], {}]
    assert await clients(server).call("echo", 3) == [[3], {}]


async def test_a_duplicate_request_id_closes_the_connection(serve: ServerFactory) -> None:
    server = await serve({"wait": Blocking()})
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(raw_frame([0, 1, "wait", [], {}]) * 2)
    async with asyncio.timeout(WAIT):
        assert await reader.read() == b""
    writer.close()


async def test_a_bad_server_answer_fails_calls_as_unavailable() -> None:
    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(struct.pack(">I", 2) + b"\xc1\xc1")
        await writer.drain()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    client = RpcClient(*listener.sockets[0].getsockname()[:2])
    try:
        async with asyncio.timeout(WAIT):
            with pytest.raises(errors.StorageUnavailable):
                await client.call("echo")
    finally:
        await client.close()
        listener.close()


def test_client_and_server_run_on_uvloop() -> None:
    """polymq runs on uvloop when installed, whose transports are not asyncio's."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        wait_forever = Blocking()
        started, cancelled = wait_forever.started, wait_forever.cancelled
        server = RpcServer({"echo": echo, "wait": wait_forever})
        await server.start()
        client = RpcClient(*server.address)
        try:
            async with asyncio.timeout(WAIT):
                results = await asyncio.gather(*(client.call("echo", n) for n in range(100)))
                assert results == [[[n], {}] for n in range(100)]
                call = asyncio.ensure_future(client.call("wait"))
                await started.wait()
                call.cancel()
                await cancelled.wait()
                lost = asyncio.ensure_future(client.call("wait"))
                await asyncio.sleep(0.01)
                await server.close()
                with pytest.raises(errors.StorageUnavailable):
                    await lost
        finally:
            await client.close()
            await server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_both_ends_probe_idle_connections(serve: ServerFactory, clients: Any) -> None:
    """TCP keepalive: a peer whose machine died is noticed, not waited on forever."""
    server = await serve({"echo": echo})
    client = clients(server)
    await client.call("echo")
    ends = [client._connection, *server._connections]
    for end in ends:
        sock = end.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


async def test_without_eager_start_a_handler_runs_in_a_task_from_the_start() -> None:
    async def bounded() -> str:
        async with asyncio.timeout(WAIT):  # needs a current task
            return "ok"

    server = RpcServer({"bounded": bounded}, eager_start=False)
    await server.start()
    client = RpcClient(*server.address)
    try:
        assert await client.call("bounded") == "ok"
    finally:
        await client.close()
        await server.close()
