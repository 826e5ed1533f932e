"""AMQP's side of the account quotas (gateway.quotas, docs/quotas.md).

A publisher over its account's produce (or request) rate is handled as RabbitMQ
handles a resource alarm: connection.blocked to clients that announced the capability,
nothing more read from its socket until the account owes nothing, then
connection.unblocked. Other frames over the request rate stop the reads without the
announcement (RabbitMQ blocks only publishers). Consumers are slowed by delaying their
next fetch until the account's consume bucket is out of debt.
"""

from __future__ import annotations

from pamqp import commands
from pamqp.base import Frame as MethodFrame

from polymq.gateway.quotas import AccountQuota
from polymq.protocols.amqp.codec import ContentHeaderFrame

__all__ = ["PROTOCOL", "charge_frame", "is_publishing"]

PROTOCOL = "amqp"


def is_publishing(value: object) -> bool:
    """Frames that make a message: their throttle is announced with connection.blocked."""
    return isinstance(value, bytes | ContentHeaderFrame | commands.Basic.Publish)


def charge_frame(quota: AccountQuota, value: object) -> int:
    """Charge one frame read on a channel; returns the throttle time it leaves owed.
    Methods are requests; body frames are produced bytes."""
    if isinstance(value, bytes):
        return quota.produced(PROTOCOL, len(value))
    if isinstance(value, MethodFrame):
        return quota.requested(PROTOCOL)
    return 0
