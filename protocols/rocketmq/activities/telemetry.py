"""Telemetry, the bidirectional stream every client opens first, plus Heartbeat and
NotifyClientTermination.

The client sends its settings (type, published topics or subscriptions); the server
answers with its own (retry policy, body limit, batch size, long-polling timeout,
FIFO flag of the group): clients do not start before that answer. The stream then
carries server commands (transaction check-backs) and the client's replies to them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.connections import TooManyConnections
from polymq.gateway.fairness import cooperatively
from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq.filters import Filter
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.sessions import ClientSession
from polymq.protocols.rocketmq.status import Malformed, RpcFailure, log_refusal, ok, status_for

__all__ = [
    "ask_client",
    "heartbeat",
    "notify_client_termination",
    "print_thread_stack_trace",
    "server_settings",
    "telemetry",
    "verify_message",
]

log = logging.getLogger(__name__)

_INFINITE_ATTEMPTS = 1 << 30


def _set_ms(field: Any, ms: int) -> None:
    field.seconds = ms // 1000
    field.nanos = (ms % 1000) * 1_000_000


async def server_settings(rt: RocketMQServices, caller: Caller, client: Any) -> Any:
    """The settings answering a client's: Apache's proxy defaults, the group's FIFO
    flag and delivery-attempt limit from its :class:`GroupConfig`."""
    settings = definition_pb2.Settings(client_type=client.client_type)
    if client.HasField("access_point"):
        settings.access_point.CopyFrom(client.access_point)
    if client.HasField("request_timeout"):
        settings.request_timeout.CopyFrom(client.request_timeout)
    settings.metric.on = False
    kind = client.WhichOneof("pub_sub")
    if kind == "publishing":
        policy = settings.backoff_policy
        policy.max_attempts = rt.options.producer_max_attempts
        _set_ms(policy.exponential_backoff.initial, 10)
        _set_ms(policy.exponential_backoff.max, 1000)
        policy.exponential_backoff.multiplier = 2.0
        settings.publishing.topics.extend(client.publishing.topics)
        settings.publishing.max_body_size = rt.max_body_bytes
        settings.publishing.validate_message_type = True
    elif kind == "subscription":
        group = client.subscription.group.name
        config = await rt.processor.get_group_config(caller, group) if group else None
        policy = settings.backoff_policy
        attempts = config.max_delivery_attempts if config is not None else None
        policy.max_attempts = attempts if attempts is not None else _INFINITE_ATTEMPTS
        for seconds in rt.options.retry_backoff_s:
            policy.customized_backoff.next.add(seconds=seconds)
        sub = settings.subscription
        sub.group.CopyFrom(client.subscription.group)
        sub.subscriptions.extend(client.subscription.subscriptions)
        sub.fifo = bool(config is not None and config.fifo)
        sub.receive_batch_size = rt.options.max_batch_size
        polling = client.subscription.long_polling_timeout
        if client.subscription.HasField("long_polling_timeout") and (
            polling.seconds or polling.nanos
        ):
            sub.long_polling_timeout.CopyFrom(polling)
        else:
            _set_ms(sub.long_polling_timeout, rt.options.long_polling_ms)
    return settings


async def _on_settings(rt: RocketMQServices, session: ClientSession, client: Any) -> Any:
    """A client's settings; at most ``limits.max_batch_items`` topics or subscriptions
    (PAYLOAD_TOO_LARGE), and the loop is handed back after each SQL92 filter parsed
    (a long one takes milliseconds)."""
    kind = client.WhichOneof("pub_sub")
    limit = rt.config.limits.max_batch_items
    if kind == "publishing" and len(client.publishing.topics) > limit:
        raise RpcFailure(Code.PAYLOAD_TOO_LARGE, f"a producer may declare at most {limit} topics")
    if kind == "subscription" and len(client.subscription.subscriptions) > limit:
        raise RpcFailure(Code.PAYLOAD_TOO_LARGE, f"a consumer may subscribe at most {limit} topics")
    session.client_type = client.client_type
    if kind == "publishing":
        session.topics = {t.name for t in client.publishing.topics}
    elif kind == "subscription":
        session.group = client.subscription.group.name or None
        if session.group is not None:
            await rt.check_group(session.caller, session.group)
        if session.connection_id is not None:  # the admin API's group members
            rt.connections.consumes_for(session.connection_id, session.group)
        subscriptions: dict[str, Filter] = {}
        async for entry in cooperatively(client.subscription.subscriptions, every=1):
            expression = entry.expression
            subscriptions[entry.topic.name] = rt.filter(expression.type, expression.expression)
        session.subscriptions = subscriptions
    settings = await server_settings(rt, session.caller, client)
    return service_pb2.TelemetryCommand(status=ok(), settings=settings)


async def _on_command(rt: RocketMQServices, session: ClientSession, command: Any) -> None:
    if isinstance(command, Malformed):
        refused = command.status()
        log_refusal("Telemetry", session.peer, refused)
        session.send(service_pb2.TelemetryCommand(status=refused))
        return
    kind = command.WhichOneof("command")
    if kind == "settings":
        try:
            answer = await _on_settings(rt, session, command.settings)
        except Exception as e:  # answered on the stream, which stays open
            refused = status_for(e)
            log_refusal("Telemetry", session.peer, refused)
            answer = service_pb2.TelemetryCommand(status=refused)
        session.send(answer)
    elif kind in ("thread_stack_trace", "verify_message_result", "verify_message_command"):
        # replies to our diagnostics; the node client echoes the verify command back
        reply = session.replies.pop(getattr(command, kind).nonce, None)
        if reply is not None and not reply.done():
            reply.set_result(command)
    else:
        log.debug("rocketmq: client %s sent telemetry %s; ignored", session.client_id, kind)


async def telemetry(
    rt: RocketMQServices, request_iterator: AsyncIterator[Any], context: Any
) -> AsyncIterator[Any]:
    caller = rt.caller(context)
    if not caller.client_id:
        raise RpcFailure(Code.CLIENT_ID_REQUIRED, "x-mq-client-id metadata is missing")
    try:
        session = rt.sessions.open(caller.client_id, caller, context.peer())
    except TooManyConnections as e:
        raise RpcFailure(Code.TOO_MANY_REQUESTS, str(e)) from e

    async def read() -> None:
        try:
            async for command in request_iterator:
                await _on_command(rt, session, command)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken stream: the client rebuilds it
            log.debug("rocketmq: telemetry of %s ended: %r", session.client_id, e)
        finally:
            session.end()

    reader = asyncio.create_task(read())
    try:
        while (item := await session.outbox.get()) is not None:
            yield item
    finally:
        reader.cancel()
        if rt.sessions.get(session.client_id) is session:  # not replaced by a new stream
            rt.client_gone(session.client_id)
        rt.sessions.close(session)


async def heartbeat(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.group.resource_namespace)
    if request.HasField("group") and request.group.name:
        await rt.check_group(caller, request.group.name)
    return service_pb2.HeartbeatResponse(status=ok())


async def notify_client_termination(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """The client cancels its Telemetry stream itself right after, which ends its
    session; ending the stream from here first makes the clients log a read error."""
    rt.caller(context, request.group.resource_namespace)
    return service_pb2.NotifyClientTerminationResponse(status=ok())


async def ask_client(session: ClientSession, command: Any, nonce: str, timeout_s: float) -> Any:
    """Send a diagnostic command over the client's stream and wait for the reply
    carrying the same nonce; ``None`` if the client does not answer in time (the
    Python client ignores these commands)."""
    reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    session.replies[nonce] = reply
    session.send(command)
    try:
        async with asyncio.timeout(timeout_s):
            return await reply
    except (TimeoutError, asyncio.CancelledError):
        return None
    finally:
        session.replies.pop(nonce, None)


async def print_thread_stack_trace(session: ClientSession, timeout_s: float = 5.0) -> str | None:
    """The client's thread dump (an admin's diagnostic), or ``None``."""
    nonce = uuid.uuid4().hex
    command = service_pb2.TelemetryCommand(
        print_thread_stack_trace_command=service_pb2.PrintThreadStackTraceCommand(nonce=nonce)
    )
    reply = await ask_client(session, command, nonce, timeout_s)
    if reply is None or not reply.HasField("thread_stack_trace"):
        return None
    return str(reply.thread_stack_trace.thread_stack_trace)


async def verify_message(
    session: ClientSession, message: Any, timeout_s: float = 5.0
) -> Any | None:
    """Ask a consumer to consume ``message`` as a test (VerifyMessageCommand); the
    reply's status says how it went (the node client answers NOT_IMPLEMENTED)."""
    nonce = uuid.uuid4().hex
    command = service_pb2.TelemetryCommand(
        verify_message_command=service_pb2.VerifyMessageCommand(nonce=nonce, message=message)
    )
    reply = await ask_client(session, command, nonce, timeout_s)
    return reply.status if reply is not None else None
