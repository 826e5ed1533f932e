"""A classic group's current generation, kept in storage so another gateway can take
the group over.

Membership lives in the coordinator's memory (protocols/kafka/coordinator.py), and the
coordinator of a group is whichever gateway the directory's rendezvous hash names, so
it moves when a gateway leaves. Kafka's members do not notice such a move: the new
coordinator loads the group from __consumer_offsets and their heartbeats and commits
go on. Here the new gateway knew nothing of them and answered UNKNOWN_MEMBER_ID, and
a member committing before its next heartbeat had made it rejoin (librdkafka keeps
fetching its assignment meanwhile) lost that commit. So the coordinator stores each
stable generation (kind ``kafka.group``), and a gateway that hears from a member it
does not know reads it once and carries the group on from there.
"""

from __future__ import annotations

import logging

from polymq.protocols.kafka.session import Session
from polymq.storage.errors import StorageError

__all__ = ["adopt_group", "save_group"]

_KIND = "kafka.group"
_log = logging.getLogger(__name__)


async def save_group(session: Session, group_id: str) -> None:
    """Store ``group_id``'s generation if stable (after the leader's SyncGroup). A
    failed write costs only a rebalance if the group moves, so it is not the sync's
    error."""
    stored = session.services.coordinator.snapshot(session.namespace, group_id)
    if stored is None:
        return
    try:
        await session.processor.meta_put(session.caller, _KIND, group_id, stored)
    except StorageError as e:
        _log.warning("group %s: generation not stored (%s)", group_id, e)


async def adopt_group(session: Session, group_id: str, member_id: str) -> None:
    """Before this gateway answers ``member_id`` that it is unknown: take the group's
    stored generation over if this gateway has no members of it."""
    coordinator = session.services.coordinator
    if not member_id or coordinator.knows(session.namespace, group_id, member_id):
        return
    try:
        stored = await session.processor.meta_get(session.caller, _KIND, group_id)
    except StorageError as e:
        _log.warning("group %s: stored generation not read (%s)", group_id, e)
        return
    if stored and any(m["member_id"] == member_id for m in stored["members"]):
        coordinator.restore(session.namespace, group_id, stored)
