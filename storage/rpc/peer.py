"""Both ends of the storage RPC over asyncio TCP (frames: :mod:`storage.rpc.codec`).

Why not gRPC: a unary gRPC call costs ~300 us in this Python, and a gateway makes many
small concurrent storage calls. Here one connection carries any number of calls in
flight, each a small frame, and the frames produced within one event-loop tick go out
in one write (and arrive, on the other side, in one read): a burst of calls costs
about one round trip and one system call each way, not one per call.

Errors keep their type across the wire: a :class:`StorageError` raised by a handler is
re-raised by the caller as the same class (its code, message and public attributes,
e.g. ``OffsetOutOfRange.earliest``). A connection that is refused, lost or broken fails
the calls in flight with :class:`StorageUnavailable`; the next call reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from ssl import SSLContext
from typing import Any, cast

from polymq.storage.errors import (
    InvalidArgument,
    NotSent,
    StorageClosed,
    StorageError,
    StorageUnavailable,
    error_from_code,
)
from polymq.storage.rpc import codec

__all__ = ["Handler", "RpcClient", "RpcServer"]

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]

# Cancelled undoable calls remembered per connection, in case the server answers
# anyway; beyond this the oldest are forgotten (a server that cancelled the work
# never answers, so the list would only grow).
_MAX_ORPHANS = 1024


class _FramedProtocol(asyncio.Protocol):
    """What both ends share: frames decoded as they arrive, frames written once per
    loop tick, and the transport's flow control."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.transport: asyncio.Transport | None = None
        self._decoder = codec.FrameDecoder(max_frame_bytes)
        self._outgoing: list[bytes] = []
        self._flush_scheduled = False
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transports have every method but do not subclass Transport
        self.transport = cast(asyncio.Transport, transport)
        _keep_alive(transport.get_extra_info("socket"))

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, frame: bytes) -> None:
        """Queue a frame; everything queued in this tick is written together."""
        self._outgoing.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        frames, self._outgoing = self._outgoing, []
        if self.is_open and frames:
            assert self.transport is not None
            self.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except codec.CodecError as exc:
            self.protocol_error(str(exc))
            return
        for frame in frames:
            if not self.is_open:
                return
            self.frame_received(frame)

    def frame_received(self, frame: codec.Frame) -> None:
        raise NotImplementedError

    def protocol_error(self, reason: str) -> None:
        """The peer broke the protocol: drop this connection (only this one)."""
        log.warning("rpc: closing connection from %s: %s", self.peer, reason)
        if self.transport is not None:
            self.transport.abort()

    @property
    def peer(self) -> str:
        if self.transport is None:
            return "?"
        address = self.transport.get_extra_info("peername")
        return f"{address[0]}:{address[1]}" if address else "?"

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()


def _keep_alive(sock: socket.socket | None) -> None:
    """Probe an idle connection, so a peer whose machine died (no FIN, no RST) is
    noticed within about half a minute: calls in flight then fail as unavailable, and
    a node cancels the long polls of a gateway that is gone."""
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not TCP, or not Linux
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


# -- client ----------------------------------------------------------------------------


class _ClientConnection(_FramedProtocol):
    def __init__(self, max_frame_bytes: int, target: str) -> None:
        super().__init__(max_frame_bytes)
        self.pending: dict[int, asyncio.Future[Any]] = {}
        # Cancelled calls whose result, should the server answer anyway, is undone
        # (:meth:`RpcClient.call_undoable`); oldest first, at most _MAX_ORPHANS.
        self.orphans: dict[int, Callable[[Any], None]] = {}
        self._target = target
        self.closed = asyncio.Event()

    def orphan(self, frame_id: int, undo: Callable[[Any], None]) -> None:
        """A cancelled call the server may still answer: its result goes to ``undo``.
        A server that cancelled the work answers nothing, so the oldest are dropped."""
        self.orphans[frame_id] = undo
        if len(self.orphans) > _MAX_ORPHANS:
            del self.orphans[next(iter(self.orphans))]

    def frame_received(self, frame: codec.Frame) -> None:
        if isinstance(frame, codec.Result):
            future = self.pending.pop(frame.id, None)
            if future is not None and not future.done():
                future.set_result(frame.value)
            elif future is None and (undo := self.orphans.pop(frame.id, None)) is not None:
                try:
                    undo(frame.value)
                except Exception:
                    log.exception("rpc: undoing the late result of a cancelled call failed")
        elif isinstance(frame, codec.Error):
            self.orphans.pop(frame.id, None)
            future = self.pending.pop(frame.id, None)
            if future is not None and not future.done():
                error = _rebuild_error(frame)
                if isinstance(error, NotSent):  # refused unrun by a server handing over
                    error.target = self._target
                future.set_exception(error)
        else:
            self.protocol_error(f"unexpected {type(frame).__name__.lower()} frame from server")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self.can_write.set()
        pending, self.pending = self.pending, {}
        self.orphans.clear()
        for future in pending.values():
            if not future.done():
                reason = f": {exc}" if exc else ""
                future.set_exception(
                    StorageUnavailable(f"lost the connection to {self._target}{reason}")
                )


def _rebuild_error(frame: codec.Error) -> StorageError:
    error = error_from_code(frame.code, frame.message)
    for name, value in frame.extras.items():
        if isinstance(name, str) and name.isidentifier() and not name.startswith("_"):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, name, value)
    return error


class RpcClient:
    """Calls to one server over one connection, opened on the first call and again on
    the first call after it was lost. Any number of calls may be in flight."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        ssl: SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        # TLS to the server (mutual when the context holds a certificate); the
        # server's certificate must name ``host``.
        self._ssl = ssl
        self._connect_timeout = connect_timeout
        self._max_frame_bytes = max_frame_bytes
        self._connection: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None
        self._next_id = 0
        self._closed = False

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        return self._connection is not None and self._connection.is_open

    def call(self, method: str, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """Run ``method`` on the server and return its result, or raise its
        :class:`StorageError`. ``StorageUnavailable`` if the server cannot be reached
        or the connection drops before the answer. Cancelling the call cancels the
        server's work on it. (A plain function returning :meth:`_call`'s coroutine:
        every storage call goes through here, and a second coroutine frame per call
        would be pure cost.)"""
        return self._call(None, method, args, kwargs)

    def call_undoable(
        self, undo: Callable[[Any], None], method: str, *args: Any, **kwargs: Any
    ) -> Coroutine[Any, Any, Any]:
        """:meth:`call`, for work whose result must not be lost (a pop hands messages
        out). The cancel cannot reach a server that already finished, and then its
        answer comes after the caller stopped waiting: ``undo`` gets that result, so
        the messages go back now instead of when their invisibility runs out."""
        return self._call(undo, method, args, kwargs)

    async def _call(
        self,
        undo: Callable[[Any], None] | None,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        frame_id = self._next_id = self._next_id + 1
        try:
            frame = codec.encode_request(frame_id, method, args, kwargs)
        except (TypeError, ValueError, OverflowError) as exc:  # a set, an int over 64 bits
            raise InvalidArgument(f"cannot send the arguments of {method}: {exc}") from exc
        connection = self._connection
        if connection is None or not connection.is_open:
            connection = await self._connect()
        if not connection.can_write.is_set():
            await connection.can_write.wait()
            if not connection.is_open:
                raise NotSent(f"lost the connection to {self.target}", target=self.target)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        connection.pending[frame_id] = future
        connection.send(frame)
        try:
            return await future
        except asyncio.CancelledError:
            if connection.pending.pop(frame_id, None) is not None and connection.is_open:
                connection.send(codec.encode_cancel(frame_id))
                if undo is not None:
                    connection.orphan(frame_id, undo)
            raise

    async def _connect(self) -> _ClientConnection:
        """One connection attempt shared by every call that needs it, so a burst of
        calls made while connecting still goes out together when it is up."""
        if self._closed:
            raise StorageClosed(f"the client of {self.target} is closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, attempt: asyncio.Future[_ClientConnection]) -> None:
        self._connecting = None
        if not attempt.cancelled() and attempt.exception() is None:
            self._connection = attempt.result()

    async def _open(self) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _ClientConnection(self._max_frame_bytes, self.target),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
        except (OSError, TimeoutError) as exc:
            raise NotSent(f"cannot reach {self.target}: {exc}", target=self.target) from exc
        if self._closed:  # closed while connecting
            if connection.transport is not None:
                connection.transport.close()
            raise StorageClosed(f"the client of {self.target} is closed")
        self._connection = connection
        return connection

    async def close(self) -> None:
        """Close the connection; calls in flight fail with ``StorageUnavailable``."""
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None and connection.transport is not None:
            connection.transport.close()
            await connection.closed.wait()


# -- server ----------------------------------------------------------------------------


class _ServerConnection(_FramedProtocol):
    def __init__(self, server: RpcServer) -> None:
        super().__init__(server.max_frame_bytes)
        self._server = server
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._long_polls: set[int] = set()  # ids of running requests with a wait_ms

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server._connections.add(self)

    def frame_received(self, frame: codec.Frame) -> None:
        if isinstance(frame, codec.Request):
            if frame.id in self._tasks:
                self.protocol_error(f"request id {frame.id} is already in use")
                return
            if self._server.handing_over:
                message = f"{frame.method} not run: this server is handing over"
                self.send(codec.encode_error(frame.id, NotSent.code, message))
                return
            handler = self._server.handlers.get(frame.method)
            if handler is None:
                self.send(
                    codec.encode_error(
                        frame.id, InvalidArgument.code, f"unknown method {frame.method!r}"
                    )
                )
                return
            self._server.requests_served += 1
            loop = asyncio.get_running_loop()
            run = self._run(frame, handler)
            if frame.kwargs.get("wait_ms"):
                self._long_polls.add(frame.id)
            if not self._server.eager_start:
                self._tasks[frame.id] = loop.create_task(run)
                return
            # Started here, not in a task: most calls (reads, lookups) finish without
            # waiting, and then cost no task and no extra loop tick. A call that waits
            # (a durable write, a long poll) goes on in a task from where it stopped.
            try:
                awaited = run.send(None)
            except StopIteration:
                return
            self._tasks[frame.id] = loop.create_task(_carry_on(run, awaited))
        elif isinstance(frame, codec.Cancel):
            running = self._tasks.get(frame.id)
            if running is not None:
                running.cancel()
        else:
            self.protocol_error(f"unexpected {type(frame).__name__.lower()} frame from client")

    async def _run(self, request: codec.Request, handler: Handler) -> None:
        try:
            value = await handler(*request.args, **request.kwargs)
            try:
                answer = codec.encode_result(request.id, value)
            except (TypeError, ValueError, OverflowError) as exc:  # our bug: unencodable result
                log.exception("rpc: cannot encode the result of %s", request.method)
                answer = codec.encode_error(request.id, StorageError.code, str(exc))
        except StorageError as exc:
            answer = codec.encode_error(request.id, exc.code, str(exc), _extras(exc))
        except asyncio.CancelledError:
            raise  # cancelled by the client or by the connection's end: nobody to answer
        except TypeError as exc:
            if _binds(handler, request):  # a TypeError of the handler's own: our bug
                log.exception("rpc: %s failed", request.method)
                message = f"{request.method} failed: {exc!r}"
                answer = codec.encode_error(request.id, StorageError.code, message)
            else:  # the peer sent arguments the method does not take: its mistake
                log.warning("rpc: %s from %s: bad arguments: %s", request.method, self.peer, exc)
                message = f"bad arguments for {request.method}: {exc}"
                answer = codec.encode_error(request.id, InvalidArgument.code, message)
        except Exception as exc:
            log.exception("rpc: %s failed", request.method)
            answer = codec.encode_error(
                request.id, StorageError.code, f"{request.method} failed: {exc!r}"
            )
        finally:
            self._tasks.pop(request.id, None)
            self._long_polls.discard(request.id)
        if self.is_open:
            self.send(answer)

    def pause_writing(self) -> None:
        # The client does not read its answers: stop reading its requests.
        super().pause_writing()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        for task in self._tasks.values():
            task.cancel()  # e.g. a waiting pop: its messages go back, not to a dead client

    def finishing(self) -> list[asyncio.Task[None]]:
        """The requests running that a hand-over lets finish: all but long polls."""
        return [task for id_, task in self._tasks.items() if id_ not in self._long_polls]

    def abort(self, *, flush: bool = False) -> list[asyncio.Task[None]]:
        """Cancel the requests running and drop the connection; ``flush``: after
        writing the answers already queued (closed, not reset)."""
        tasks = list(self._tasks.values())
        if self.transport is not None:
            if flush:
                self._flush()
                self.transport.close()
            else:
                self.transport.abort()
        for task in tasks:
            task.cancel()
        return tasks


def _binds(handler: Handler, request: codec.Request) -> bool:
    """Whether the request's arguments fit the handler's signature. Asked only after a
    ``TypeError``, so calls that bind cost nothing."""
    try:
        inspect.signature(handler).bind(*request.args, **request.kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to check against (a builtin): assume it binds
        return True
    return True


async def _carry_on(started: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Run the rest of ``started``, a coroutine stepped once that yielded ``awaited``
    (what it waits on), as if a task had run it from the start."""
    await _Resumed(started, awaited)


class _Resumed:
    def __init__(self, started: Coroutine[Any, Any, None], awaited: Any) -> None:
        self._started = started
        self._awaited = awaited

    def __await__(self) -> Generator[Any, None, None]:
        awaited = self._awaited
        while True:
            try:
                yield awaited  # to the task, which wakes us when it is done
            except BaseException as exc:  # the task was cancelled: pass it on
                try:
                    awaited = self._started.throw(exc)
                except StopIteration:
                    return
                continue
            break
        yield from self._started.__await__()


def _extras(exc: StorageError) -> dict[str, Any]:
    """The error's public attributes that travel (``OffsetOutOfRange``'s bounds)."""
    return {
        name: value
        for name, value in vars(exc).items()
        if not name.startswith("_") and isinstance(value, (int, float, str, bool, type(None)))
    }


class RpcServer:
    """Serves ``handlers`` (method name to coroutine function) on ``host:port`` (port 0:
    any free port; see :attr:`address`). Requests run concurrently, so a long poll
    never holds up the calls behind it on the same connection.

    ``eager_start``: a handler runs at once, as its request is read, up to its first
    wait; only a handler that waits costs a task (Python 3.12's eager tasks, by hand:
    +25% calls/s for calls that do not wait). Until that first wait there is no current
    task, so a handler that opens ``asyncio.timeout()`` or asks ``current_task()``
    before waiting needs ``eager_start=False`` (a task per request from the start)."""

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        eager_start: bool = True,
        ssl: SSLContext | None = None,
    ) -> None:
        self.handlers = dict(handlers)
        # TLS for every connection (a context requiring client certificates makes it
        # mutual): the handshake is the loop's, before a connection is served.
        self._ssl = ssl
        self.eager_start = eager_start
        self.host = host
        self.port = port
        self.max_frame_bytes = max_frame_bytes
        self.requests_served = 0
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self.handing_over = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), self.host, self.port, ssl=self._ssl
        )

    @property
    def address(self) -> tuple[str, int]:
        """The host and port it listens on (the real port when started with 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the RPC server is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self, grace: float = 0.0) -> None:
        """Stop accepting, drop every connection and cancel the requests in flight.

        ``grace`` (seconds) makes it a hand-over, as when a shard passes to another
        process. Requests that arrive meanwhile are answered :class:`NotSent`: they
        were not run, so the client may send them to the new address. Those in
        flight, long polls aside, get up to ``grace`` to finish and be answered. Cut
        off instead, a write that took effect looks failed to its client, whose retry
        then finds it done: a deleted message's second delete is a stale receipt."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        connections = list(self._connections)
        if grace > 0:
            self.handing_over = True
            finishing = [task for connection in connections for task in connection.finishing()]
            if finishing:
                await asyncio.wait(finishing, timeout=grace)
        tasks = [task for c in connections for task in c.abort(flush=grace > 0)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
