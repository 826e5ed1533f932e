"""How a Kafka connection's queued answers reach the socket (protocols/kafka/answers.py):
the answers one fsync makes due together go out in one write, in order; an answer due
now is not held back for one due later; and once the queue reports idle, whatever the
connection writes itself comes after every queued answer. Over a real loopback TCP
connection, the fsyncs played by futures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from polymq.protocols.kafka.answers import OrderedAnswers

ONE_FORM = True  # starts no server: nothing to run per server form

READ_S = 5.0  # far beyond any write under test: reaching it means the bytes never came


class _Counted:
    """A server-side writer whose ``write`` calls are counted."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writes = 0
        write = writer.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            self.writes += 1
            write(data)

        writer.write = counted  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _connection() -> AsyncIterator[tuple[asyncio.StreamWriter, asyncio.StreamReader]]:
    """The server side's writer and the client side's reader of one TCP connection."""
    accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, client = await asyncio.open_connection("127.0.0.1", port)
    writer = await accepted
    try:
        yield writer, reader
    finally:
        client.close()
        writer.close()
        server.close()
        await server.wait_closed()


async def _received(reader: asyncio.StreamReader, size: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(size), READ_S)


async def test_answers_due_together_go_out_in_one_write_in_order() -> None:
    async with _connection() as (writer, reader):
        counted = _Counted(writer)
        answers = OrderedAnswers(writer, limit=64)
        fsync: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for answer in (b"first", b"second", b"third"):
            answers.add(answer, [lambda: fsync])
        answers.add(None, [lambda: fsync])  # a request with no answer (acks=0)
        await asyncio.sleep(0.05)
        assert counted.writes == 0  # nothing before its fsync
        fsync.set_result(None)
        await answers.drain()
        assert await _received(reader, 16) == b"firstsecondthird"
        assert counted.writes == 1


async def test_an_answer_due_now_is_not_held_for_a_later_one() -> None:
    async with _connection() as (writer, reader):
        answers = OrderedAnswers(writer, limit=64)
        loop = asyncio.get_running_loop()
        early: asyncio.Future[None] = loop.create_future()
        late: asyncio.Future[None] = loop.create_future()
        answers.add(b"early", [lambda: early])
        answers.add(b"late", [lambda: late])
        early.set_result(None)
        assert await _received(reader, 5) == b"early"
        assert answers.busy()  # "late" still waits for its fsync
        late.set_result(None)
        assert await _received(reader, 4) == b"late"


async def test_the_connections_own_write_comes_after_the_queued_answers() -> None:
    """The connection writes a response itself as soon as :meth:`busy` is false,
    which may be in the loop turn the last queued answers fell due in."""
    async with _connection() as (writer, reader):
        answers = OrderedAnswers(writer, limit=64)
        fsync: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers.add(b"queued1", [lambda: fsync])
        answers.add(b"queued2", [lambda: fsync])
        fsync.set_result(None)
        await asyncio.sleep(0)  # the writer's task runs first: it was woken first
        assert not answers.busy()
        writer.write(b"direct")
        assert await _received(reader, 20) == b"queued1queued2direct"
