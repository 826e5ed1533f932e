"""RocketMQ's side of the account quotas (gateway.quotas, docs/quotas.md).

A gRPC call cannot be slowed, only answered: a send or receive arriving while its
account owes time on its rates is answered ``TOO_MANY_REQUESTS`` (42900), the code
RocketMQ's proxy uses for flow control (its clients' TooManyRequestsException; the
Java producer backs off and retries). One that is let in is charged: a send its
bodies as produced bytes, a receive what it hands out as consumed bytes, each one
request.

A RocketMQ client's connection is its telemetry stream (protocols.rocketmq.sessions),
which the account's connection limit refuses; since the client's sends and receives
are separate calls, those of a client without a session are refused the same way
while the account is at its limit, so a refused client cannot work around it.
"""

from __future__ import annotations

from collections.abc import Iterable

from rocketmq.grpc_protocol import Code

from polymq.gateway.processor import Caller
from polymq.gateway.quotas import Kind, Quotas
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.model import StoredMessage

__all__ = ["admit", "consumed"]

PROTOCOL = "rocketmq"


def admit(rt: RocketMQServices, caller: Caller, kind: Kind, nbytes: int = 0) -> None:
    """Raise 42900 if the caller's account owes time on ``kind`` or requests, or the
    caller has no session while its account is at its connection limit; else charge
    the request (and ``nbytes`` produced, for a send)."""
    quota = rt.quotas.of(caller.principal)
    if caller.connection_id is None and rt.connections.at_account_limit(caller.principal):
        quota.refused(PROTOCOL)
        raise RpcFailure(
            Code.TOO_MANY_REQUESTS,
            f"connection limit reached for user {caller.principal.name!r}",
        )
    owed = quota.wait_ms("requests", kind)
    if owed:
        quota.throttled(PROTOCOL, owed)
        raise RpcFailure(
            Code.TOO_MANY_REQUESTS,
            f"{caller.principal.name!r} is over its quota; retry in {owed} ms",
        )
    if kind == "produce":
        quota.produced(PROTOCOL, nbytes, requests=1)
    else:
        quota.requested(PROTOCOL)


def consumed(quotas: Quotas, caller: Caller, messages: Iterable[StoredMessage]) -> None:
    quotas.of(caller.principal).consumed(PROTOCOL, sum(len(m.message.body) for m in messages))
