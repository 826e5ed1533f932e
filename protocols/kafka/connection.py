"""One Kafka client connection: read size-prefixed requests, answer each in order.

Kafka answers a connection's requests in the order they came, so they are handled one
at a time; a client pipelines by sending more before the answers arrive. A request we
cannot decode closes the connection (as Kafka does); an API version we do not serve
gets UNSUPPORTED_VERSION where the response shape is known.

A peer is not trusted with the server's memory or time: a frame, once begun, must
arrive whole within ``limits.frame_timeout_ms``; its declared size is reserved from the
gateway's frame budget before its body is read (and given back once it is handled);
before SASL completes only the 12 bytes of size and request prefix are read before the
state check, frames are capped at ``limits.max_unauthenticated_frame_bytes``, and only
ApiVersions, SaslHandshake and SaslAuthenticate are accepted.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

from kio.schema.errors import ErrorCode
from kio.schema.index import api_key_map, schema_name_map

from polymq.gateway.accounts import ANONYMOUS, AuthError, Principal
from polymq.gateway.connections import AccountConnectionLimit, current_connection_id
from polymq.gateway.lazy_deadline import LazyDeadline
from polymq.protocols.kafka._state import ALLOWED, API_VERSIONS, AuthState
from polymq.protocols.kafka.answers import OrderedAnswers
from polymq.protocols.kafka.codec import (
    BadRequest,
    Request,
    UnsupportedVersion,
    build,
    decode_request,
    encode_body,
    encode_response,
    error_response,
    frame_size,
    response_class,
)
from polymq.protocols.kafka.departure import WAITS, PeerWatch
from polymq.protocols.kafka.handlers import HANDLERS
from polymq.protocols.kafka.handlers.topics import api_versions_body
from polymq.protocols.kafka.quota import charge, mute
from polymq.protocols.kafka.session import KafkaServices, Session, caller_for

__all__ = ["serve_connection"]

log = logging.getLogger(__name__)
# Per connection: each request's api key, version, correlation id, arrival and answer
# time (DEBUG), to diagnose client stalls from the server's side.
trace = logging.getLogger(__name__ + ".trace")

# api key, api version, correlation id: what is read before the auth state is checked.
_PREFIX_SIZE = 8
# Answers waiting for their fsync before the connection stops reading (answers.py):
# bounds what one producer has in flight (librdkafka's default allows a million).
_MAX_QUEUED_ANSWERS = 64

# Before SASL completes, a connection may do nothing in storage.
_NOBODY = Principal(name="", namespaces=frozenset(), default_namespace="default")


class _ReadDeadline(LazyDeadline):
    """When the read under way must be done: one :class:`LazyDeadline` per connection.

    Every request is read under two deadlines: the idle one for its first byte, then
    the frame's for the rest (an ``asyncio.timeout`` per read armed and cancelled a
    loop timer three times a request). ``period`` is the shorter of the two, so the
    frame's deadline after an idle wait does not move the timer. Once the read under
    way is past its deadline, the connection's task is cancelled, as
    ``asyncio.timeout`` does, and :meth:`expired` tells that cancel from any other
    (an admin's kick, the peer leaving) by ``Task.uncancel``."""

    __slots__ = ("_cancelling", "_task")

    def __init__(self, task: asyncio.Task[Any], period: float) -> None:
        super().__init__(task.get_loop(), self._cancel, period)
        self._task = task
        self._cancelling = -1  # the task's cancels before ours; -1: we cancelled none

    def expired(self) -> bool:
        """Whether the ``CancelledError`` being handled is this deadline's alone (then
        the cancel is taken back); call it in an ``except CancelledError`` of a read."""
        cancelling, self._cancelling = self._cancelling, -1
        return cancelling >= 0 and self._task.uncancel() <= cancelling

    def _cancel(self) -> None:
        self._cancelling = self._task.cancelling()
        self._task.cancel()


def _advertised(writer: asyncio.StreamWriter) -> tuple[str, int]:
    sockname = writer.get_extra_info("sockname")
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return "127.0.0.1", 9092


class _Refused(Exception):
    """A frame the connection closes on before reading its body (logged as one line)."""


async def serve_connection(
    services: KafkaServices,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    listener: str = "kafka",
    certificate_name: str | None = None,
) -> None:
    """Serve one connection of ``listener`` (whose endpoints Metadata names). A
    ``certificate_name`` (a verified client certificate's, when ``[tls]
    principal_from`` is set) authenticates it as that account from the first request,
    as Kafka's SSL listener principal; an unknown name is refused, the socket closed."""
    connection_id = current_connection_id()
    principal: Principal | None = ANONYMOUS if services.accounts.open else None
    if certificate_name is not None:
        try:
            principal = services.accounts.by_certificate(certificate_name)
        except AuthError:
            log.info("kafka: closing a connection: certificate %r: no account", certificate_name)
            return
    open_mode = principal is not None  # authenticated from the start: no SASL needed
    session = Session(
        services=services,
        connection_id=connection_id,
        advertised=_advertised(writer),
        state=AuthState.AUTHENTICATED if open_mode else AuthState.START,
        caller=caller_for(principal, connection_id, None)
        if principal is not None
        else caller_for(_NOBODY, connection_id, None),
        listener=listener,
    )
    peer = writer.get_extra_info("peername")
    session.peer = f"/{peer[0]}" if isinstance(peer, tuple) else ""
    identified = not open_mode  # with SASL, the SaslAuthenticate handler identifies
    watch = PeerWatch(reader)
    answers = OrderedAnswers(writer, limit=_MAX_QUEUED_ANSWERS)
    task = asyncio.current_task()
    assert task is not None
    limits = services.limits
    deadline = _ReadDeadline(task, min(services.idle_timeout_s, limits.frame_timeout_ms / 1000))
    try:
        await _serve_requests(
            session, reader, writer, answers, principal, identified, watch, deadline
        )
    finally:
        deadline.close()
        answers.cancel()


async def _serve_requests(
    session: Session,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    answers: OrderedAnswers,
    principal: Principal | None,
    identified: bool,
    watch: PeerWatch,
    deadline: _ReadDeadline,
) -> None:
    """Read, handle and answer requests in order until the peer leaves or is closed."""
    services = session.services
    loop = asyncio.get_running_loop()
    while True:
        try:
            size, prefix, due = await _read_head(session, reader, deadline)
        except asyncio.IncompleteReadError:
            return
        except _Refused as e:
            log.info("kafka: closing %s: %s", session.peer or "a connection", e)
            return
        asked = loop.time()
        async with services.frame_budget.reserve(size):
            # Time spent waiting for the budget is ours, not the peer's.
            deadline.start(due + loop.time() - asked)
            try:
                rest = await reader.readexactly(size - len(prefix))
            except asyncio.IncompleteReadError:
                return
            except asyncio.CancelledError:
                if not deadline.expired():
                    raise
                log.info("kafka: closing %s: %s", session.peer, _slow(services))
                return
            deadline.stop()
            frame = prefix + rest
            del rest
            if not identified:
                # Open mode: a whole first request ends the handshake deadline and
                # counts the connection in the default namespace.
                identified = True
                try:
                    session.authenticated(principal or ANONYMOUS)
                except AccountConnectionLimit as e:  # no SASL to answer with: close
                    log.info("kafka: closing %s: %s", session.peer, e)
                    return
            started = time.monotonic()
            api_key = int.from_bytes(prefix[:2], "big", signed=True)
            if api_key in WAITS:
                left, response = await watch.unless_gone(_answer(session, frame))
                if left:
                    log.debug("kafka: %s left while its API %d waited", session.peer, api_key)
                    return
            else:
                response = await _answer(session, frame)
        if trace.isEnabledFor(logging.DEBUG):
            _trace(session, frame, started, response)
        del frame
        waits = session.answer_after
        if waits or answers.busy():
            # An acks=all produce: answered once fsynced, in order (answers.py).
            answers.add(response, list(waits))
            waits.clear()
            await answers.room()
        elif response is not None:
            writer.write(response)
            await writer.drain()
        if session.closing:
            await answers.drain()
            return
        if answers.failed:
            return
        if session.throttle_ms:
            await mute(session)


def _slow(services: KafkaServices) -> str:
    return f"frame not complete within {services.limits.frame_timeout_ms} ms"


async def _read_head(
    session: Session, reader: asyncio.StreamReader, deadline: _ReadDeadline
) -> tuple[int, bytes, float]:
    """A frame's size and its first 8 bytes (api key, version, correlation id), and the
    deadline for the rest; raises :class:`_Refused` for a frame not to be read further.

    Only these 12 bytes are read before the checks that depend on the connection's
    state, so an unauthenticated peer can make us hold no more than
    ``max_unauthenticated_frame_bytes``, and never makes us decode anything."""
    services = session.services
    limits = services.limits
    loop = deadline.loop
    deadline.start(loop.time() + services.idle_timeout_s)
    try:
        first = await reader.readexactly(1)
    except asyncio.CancelledError:
        if not deadline.expired():
            raise
        raise _Refused(f"no request for {services.idle_timeout_s:.0f} s") from None
    due = loop.time() + limits.frame_timeout_ms / 1000
    deadline.start(due)
    authenticated = session.state is AuthState.AUTHENTICATED
    try:
        size = frame_size(first + await reader.readexactly(3))
        if size < _PREFIX_SIZE or size > limits.max_frame_bytes:
            raise _Refused(f"frame of {size} bytes")
        if not authenticated and size > limits.max_unauthenticated_frame_bytes:
            raise _Refused(f"frame of {size} bytes before authentication")
        prefix = await reader.readexactly(_PREFIX_SIZE)
    except asyncio.CancelledError:
        if not deadline.expired():
            raise
        raise _Refused(_slow(services)) from None
    deadline.stop()
    allowed = ALLOWED[session.state]
    api_key = int.from_bytes(prefix[:2], "big", signed=True)
    if allowed is not None and api_key not in allowed:
        raise _Refused(f"API {api_key} before authentication")
    return size, prefix, due


def _trace(session: Session, frame: bytes, started: float, response: bytes | None) -> None:
    api_key, version, correlation = struct.unpack_from(">hhi", frame)
    answered = None if response is None else struct.unpack_from(">i", response, 4)[0]
    trace.debug(
        "conn=%s api=%d v%d corr=%d at=%.3f took=%.3fs answered_corr=%s",
        session.connection_id,
        api_key,
        version,
        correlation,
        started,
        time.monotonic() - started,
        answered,
    )


async def _answer(session: Session, frame: bytes) -> bytes | None:
    try:
        request = decode_request(frame, session.services.max_request_items)
    except UnsupportedVersion as e:
        return _unsupported(session, e)
    except BadRequest as e:
        log.info("kafka: closing %s after a bad request: %s", session.peer, e)
        session.closing = True
        return None
    if session.client_id is None and request.client_id:
        session.client_id = request.client_id
    body = await HANDLERS[request.api_key](session, request.body, request.api_version)
    if body is None:
        charge(session, request.api_key, len(frame), 0)
        return None
    response = _encode(request, body)
    owed = charge(session, request.api_key, len(frame), len(response))
    if owed and "throttle_time" in body:
        body["throttle_time"] = owed
        response = _encode(request, body)
    return response


def _encode(request: Request, body: dict[str, object]) -> bytes:
    return encode_body(request.api_key, request.api_version, request.correlation_id, body)


def _unsupported(session: Session, e: UnsupportedVersion) -> bytes | None:
    """ApiVersions of a version we lack is answered in v0 with error 35 and our
    versions (KIP-511), so the client retries with one we have; other APIs get the
    error where kio knows the version's shape, else the connection closes."""
    if e.api_key == API_VERSIONS:
        body = build(
            response_class(API_VERSIONS, 0), api_versions_body(ErrorCode.unsupported_version)
        )
        return encode_response(API_VERSIONS, 0, e.correlation_id, body)
    name = api_key_map.get(e.api_key)
    if name is not None and e.api_version in schema_name_map[name]:
        body = error_response(e.api_key, e.api_version, ErrorCode.unsupported_version)
        return encode_response(e.api_key, e.api_version, e.correlation_id, body)
    log.info("kafka: closing after unknown API %d v%d", e.api_key, e.api_version)
    session.closing = True
    return None
