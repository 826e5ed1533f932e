"""Permission checks as Kafka's handlers need them: which of a request's names the
session may not touch (each gets its kind's AUTHORIZATION_FAILED code through
:func:`protocols.kafka.errors.error_code`; docs/permissions.md)."""

from __future__ import annotations

from collections.abc import Iterable

from polymq.gateway.permissions import Operation, ResourceKind
from polymq.protocols.kafka.session import Session

__all__ = ["denied", "permitted"]


async def permitted(session: Session, kind: ResourceKind, name: str, operation: Operation) -> bool:
    return await session.processor.permitted(session.caller, kind, name, operation)


async def denied(
    session: Session, kind: ResourceKind, names: Iterable[str], operation: Operation
) -> set[str]:
    """The distinct ``names`` the session may not ``operation``: one check per name,
    however many partitions a request names of it."""
    return {n for n in set(names) if not await permitted(session, kind, n, operation)}
