"""KIP-932 share groups: queue semantics for Kafka consumers, served by the storage's
pop mode. Every member is assigned every partition of its subscription; a record is
handed to one member at a time (a pop), with a lock (the invisibility timeout) and a
delivery count (the delivery attempt); accept acks it, release gives it back at once,
reject sends it to the group's dead-letter topic (Kafka archives it: never delivered
again).

This module keeps the membership and, per acquired record, the storage receipt its
acknowledgement needs: the gateway's memory, like Kafka's share-partition state in the
leader. A lost receipt only means the lock runs out and the record comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from polymq.storage.model import QueueRef

__all__ = ["AckType", "ShareGroups"]

LOCK_MS = 30_000  # group.share.record.lock.duration.ms
HEARTBEAT_INTERVAL_MS = 500


class AckType(IntEnum):
    GAP = 0
    ACCEPT = 1
    RELEASE = 2
    REJECT = 3


@dataclass(eq=False, slots=True)
class _Group:
    epoch: int = 0
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)  # id -> subscription
    clients: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> client id, host


Acquired = tuple[QueueRef, int]  # queue, offset


class ShareGroups:
    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Group] = {}
        # (namespace, group, member) -> acquired record -> storage receipt
        self._receipts: dict[tuple[str, str, str], dict[Acquired, str]] = {}
        # (namespace, group, member) -> the share session's partitions (topic id, index)
        self._sessions: dict[tuple[str, str, str], set[tuple[Any, int]]] = {}

    def session_partitions(
        self,
        namespace: str,
        group_id: str,
        member_id: str,
        epoch: int,
        added: set[tuple[Any, int]],
        forgotten: set[tuple[Any, int]],
    ) -> set[tuple[Any, int]]:
        """The partitions a ShareFetch covers: epoch 0 opens a session with the
        request's partitions, later epochs add to it and drop the forgotten ones
        (KIP-932 share sessions, like KIP-227 fetch sessions)."""
        key = (namespace, group_id, member_id)
        if epoch == 0 or key not in self._sessions:
            self._sessions[key] = set()
        partitions = self._sessions[key]
        partitions |= added
        partitions -= forgotten
        return set(partitions)

    def close_session(self, namespace: str, group_id: str, member_id: str) -> None:
        self._sessions.pop((namespace, group_id, member_id), None)

    def subscriptions(self, namespace: str, group_id: str, subscribed: tuple[str, ...]) -> set[str]:
        group = self._groups.get((namespace, group_id))
        topics = set(subscribed)
        if group is not None:
            for topics_of in group.members.values():
                topics.update(topics_of)
        return topics

    def join_or_update(
        self,
        namespace: str,
        group_id: str,
        member_id: str,
        subscribed: tuple[str, ...] | None,
        client: tuple[str, str] = ("", ""),
    ) -> tuple[int, tuple[str, ...]]:
        """The group epoch and the member's subscription after this heartbeat
        (``client``: its client id and host, for ShareGroupDescribe)."""
        group = self._groups.setdefault((namespace, group_id), _Group())
        group.clients[member_id] = client
        known = group.members.get(member_id)
        if known is None or (subscribed is not None and tuple(sorted(subscribed)) != known):
            group.members[member_id] = tuple(sorted(subscribed or ()))
            group.epoch += 1
        return group.epoch, group.members[member_id]

    def groups(self, namespace: str) -> dict[str, int]:
        """Group id to member count, for the groups of ``namespace``."""
        return {g: len(group.members) for (ns, g), group in self._groups.items() if ns == namespace}

    def describe(
        self, namespace: str, group_id: str
    ) -> tuple[int, dict[str, tuple[tuple[str, ...], tuple[str, str]]]] | None:
        """The group's epoch and each member's subscription and client (id, host);
        None if unknown."""
        group = self._groups.get((namespace, group_id))
        if group is None:
            return None
        members = {
            m: (topics, group.clients.get(m, ("", ""))) for m, topics in group.members.items()
        }
        return group.epoch, members

    def is_member(self, namespace: str, group_id: str, member_id: str) -> bool:
        group = self._groups.get((namespace, group_id))
        return group is not None and member_id in group.members

    def leave(self, namespace: str, group_id: str, member_id: str) -> list[str]:
        """Forget a member; the receipts of what it still holds, to release."""
        group = self._groups.get((namespace, group_id))
        if group is not None and group.members.pop(member_id, None) is not None:
            group.clients.pop(member_id, None)
            group.epoch += 1
        self.close_session(namespace, group_id, member_id)
        return self.release_all(namespace, group_id, member_id)

    def acquired(
        self, namespace: str, group_id: str, member_id: str, record: Acquired, receipt: str
    ) -> None:
        self._receipts.setdefault((namespace, group_id, member_id), {})[record] = receipt

    def take(self, namespace: str, group_id: str, member_id: str, record: Acquired) -> str | None:
        """The receipt of a record this member holds, forgotten once taken."""
        held = self._receipts.get((namespace, group_id, member_id))
        return None if held is None else held.pop(record, None)

    def release_all(self, namespace: str, group_id: str, member_id: str) -> list[str]:
        held = self._receipts.pop((namespace, group_id, member_id), {})
        return list(held.values())
