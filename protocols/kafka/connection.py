"""One Kafka client connection: read size-prefixed requests, answer each in order.

Kafka answers a connection's requests in the order they came, so they are handled one
at a time; a client pipelines by sending more before the answers arrive. A request we
cannot decode closes the connection (as Kafka does); an API version we do not serve
gets UNSUPPORTED_VERSION where the response shape is known.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from kio.schema.errors import ErrorCode
from kio.schema.index import api_key_map, schema_name_map

from gateway.accounts import ANONYMOUS, Principal
from gateway.connections import current_connection_id
from protocols.kafka._state import ALLOWED, API_VERSIONS, AuthState
from protocols.kafka.codec import (
    BadRequest,
    Request,
    UnsupportedVersion,
    build,
    decode_request,
    encode_response,
    error_response,
    frame_size,
    response_class,
)
from protocols.kafka.handlers import HANDLERS
from protocols.kafka.handlers.topics import api_versions_body
from protocols.kafka.session import Broker, Session, anonymous_caller, caller_for

__all__ = ["serve_connection"]

log = logging.getLogger(__name__)
# Per connection: each request's api key, version, correlation id, arrival and answer
# time (DEBUG), to diagnose client stalls from the server's side.
trace = logging.getLogger(__name__ + ".trace")

# Before SASL completes, a connection may do nothing in storage.
_NOBODY = Principal(name="", namespaces=frozenset(), default_namespace="default")


def _advertised(writer: asyncio.StreamWriter) -> tuple[str, int]:
    sockname = writer.get_extra_info("sockname")
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return "127.0.0.1", 9092


async def serve_connection(
    broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    connection_id = current_connection_id()
    open_mode = broker.accounts.open
    session = Session(
        broker=broker,
        connection_id=connection_id,
        advertised=_advertised(writer),
        state=AuthState.AUTHENTICATED if open_mode else AuthState.START,
        caller=anonymous_caller(connection_id)
        if open_mode
        else caller_for(_NOBODY, connection_id, None),
    )
    if open_mode and connection_id is not None and broker.connections.get(connection_id):
        session.authenticated(ANONYMOUS)  # counted in the default namespace from the start
    peer = writer.get_extra_info("peername")
    session.peer = f"/{peer[0]}" if isinstance(peer, tuple) else ""
    while True:
        try:
            prefix = await reader.readexactly(4)
            size = frame_size(prefix)
            if size < 8 or size > broker.max_frame_bytes:
                log.info("kafka: closing %s: frame of %d bytes", session.peer, size)
                return
            frame = await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return
        started = time.monotonic()
        response = await _answer(session, frame)
        if trace.isEnabledFor(logging.DEBUG):
            _trace(session, frame, started, response)
        if response is not None:
            writer.write(response)
            await writer.drain()
        if session.closing:
            return


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
        request = decode_request(frame)
    except UnsupportedVersion as e:
        return _unsupported(session, e)
    except BadRequest as e:
        log.info("kafka: closing a connection after a bad request: %s", e)
        session.closing = True
        return None
    if session.client_id is None and request.client_id:
        session.client_id = request.client_id
    allowed = ALLOWED[session.state]
    if allowed is not None and request.api_key not in allowed:
        log.info("kafka: API %d before authentication; closing", request.api_key)
        session.closing = True
        return None
    body = await HANDLERS[request.api_key](session, request.body, request.api_version)
    if body is None:
        return None
    return _encode(request, body)


def _encode(request: Request, body: dict[str, object]) -> bytes:
    cls = response_class(request.api_key, request.api_version)
    return encode_response(
        request.api_key, request.api_version, request.correlation_id, build(cls, body)
    )


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
