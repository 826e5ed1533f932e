"""What grpcio's asyncio server does with hostile input that no option of it prevents.

grpcio (1.85) decodes each request's HTTP/2 ``:path`` with a strict ``bytes.decode()``
inside its server's own serving loop (``_server_main_loop`` in ``aio/server.pyx.pxi``),
before any handler or interceptor of ours runs. One ``:path`` that is not UTF-8 makes
that loop raise, and grpcio then shuts the whole server down: the port stops
accepting connections while the process lives on. No channel argument, handler or
interceptor runs before that decode, so the listener supervises the server instead
(:mod:`protocols.rocketmq.listener`): this module finds the task of grpc's serving
loop, so the listener learns at once that it ended, and turns grpcio's own log
records about bad input into one line each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["ServingLoop", "install_log_filters"]

_GRPC_LOGGER = "grpc._cython.cygrpc"
# What grpcio's ``_decode`` (grpc_string.pyx.pxi) logs, with a traceback, through the
# root logger for each metadata value that is not UTF-8 (it then reads it as Latin-1).
_INVALID_ENCODING = "Invalid encoding on %s"
_SHOWN_BYTES = 64
_REPORT_AGAIN_AFTER_S = 1.0
_REPORTED_VALUES = 256

_Coro = Generator[Any, None, Any] | Coroutine[Any, Any, Any]
_TaskFactory = Callable[..., "asyncio.Future[Any]"]


def _capture_next_task(
    loop: asyncio.AbstractEventLoop, captured: Callable[[asyncio.Future[Any]], None]
) -> Callable[[], None]:
    """Hand the next task created on ``loop`` to ``captured``; returns a function that
    stops watching if no task was created meanwhile."""
    previous: _TaskFactory | None = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: _Coro, **kwargs: Any) -> asyncio.Future[Any]:
        loop.set_task_factory(previous)
        if previous is not None:
            task = previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        captured(task)
        return task

    def stop_watching() -> None:
        if loop.get_task_factory() is factory:
            loop.set_task_factory(previous)

    loop.set_task_factory(factory)
    return stop_watching


class ServingLoop:
    """The task of one grpc server's serving loop, watched from its first moment.

    grpcio keeps that task private; ``AioServer.start`` creates it as the first thing it
    does, so the first task created while ``server.start()`` runs is that loop. Watching
    it (rather than polling the server's state) tells the listener the moment grpc's
    server gave up: ``failed`` is called with the loop's exception from the loop's first
    done callback, before grpc's own callback starts shutting the server down and stops
    its listening socket, so a successor can be listening already by then. That
    shutdown task of grpc's fails in turn on the same exception and would be logged with
    a traceback ("Task exception was never retrieved") whenever it is collected: it is
    caught as grpc creates it, and kept for the listener to await.
    """

    def __init__(self, failed: Callable[[BaseException], None]) -> None:
        self._failed = failed
        self.task: asyncio.Future[Any] | None = None
        self.shutdown: asyncio.Future[Any] | None = None

    async def start(self, server: Any) -> None:
        loop = asyncio.get_running_loop()
        stop_watching = _capture_next_task(loop, self._serving)
        try:
            await server.start()
        finally:
            stop_watching()

    def _serving(self, task: asyncio.Future[Any]) -> None:
        self.task = task
        task.add_done_callback(self._ended)  # before grpc adds its own callback

    def _ended(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        self._failed(error)
        loop = task.get_loop()
        # grpc's callback is the next thing the loop runs; stop watching right after it
        loop.call_soon(_capture_next_task(loop, self._shutting_down))

    def _shutting_down(self, task: asyncio.Future[Any]) -> None:
        self.shutdown = task
        task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _InvalidEncodingFilter(logging.Filter):
    """grpcio's "Invalid encoding on b'...'" with a traceback becomes one INFO line: a
    peer's metadata value that is not UTF-8 is bad input, not a server error. grpc
    decodes a request's metadata again each time a handler asks for it, so a value
    already reported in the last second is logged at DEBUG only."""

    def __init__(self) -> None:
        super().__init__()
        self._reported: dict[object, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _INVALID_ENCODING or not record.exc_info:
            return True
        if not isinstance(record.exc_info[1], UnicodeDecodeError):
            return True
        raw = record.args[0] if isinstance(record.args, tuple) and record.args else b""
        sized = isinstance(raw, bytes | str)
        now = time.monotonic()
        again = self._reported.get(raw, 0.0) > now
        if not again:
            if len(self._reported) >= _REPORTED_VALUES:
                self._reported.clear()
            self._reported[raw] = now + _REPORT_AGAIN_AFTER_S
        level = logging.DEBUG if again else logging.INFO
        record.name = _GRPC_LOGGER
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.msg = "rocketmq: a gRPC metadata value is not UTF-8, read as Latin-1: %r%s"
        shown = raw[:_SHOWN_BYTES] if sized else raw  # type: ignore[index]
        record.args = (shown, "..." if sized and len(raw) > _SHOWN_BYTES else "")  # type: ignore[arg-type]
        record.exc_info, record.exc_text = None, None
        logger = logging.getLogger(_GRPC_LOGGER)
        return logger.isEnabledFor(level)


class _ServerCrashFilter(logging.Filter):
    """grpcio logs the exception that ended its serving loop (``_LOGGER.exception(e)``
    outside any ``except``: the message is the exception itself, the traceback reads
    "NoneType: None"). The listener logs one warning for it as it restarts the server,
    so grpc's own record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(record.msg, BaseException)


_INVALID_ENCODING_FILTER = _InvalidEncodingFilter()
_SERVER_CRASH_FILTER = _ServerCrashFilter()


def install_log_filters() -> None:
    """Install the filters once per process (listeners may start many times). grpcio
    1.85 logs "Invalid encoding" through its own logger, older ones through the root."""
    for logger, installed in (
        (logging.getLogger(_GRPC_LOGGER), _INVALID_ENCODING_FILTER),
        (logging.getLogger(), _INVALID_ENCODING_FILTER),
        (logging.getLogger(_GRPC_LOGGER), _SERVER_CRASH_FILTER),
    ):
        if installed not in logger.filters:
            logger.addFilter(installed)
