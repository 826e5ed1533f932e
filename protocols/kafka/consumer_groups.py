"""KIP-848 consumer groups (``group.protocol=consumer``): the coordinator assigns.

Members heartbeat with their subscription and the partitions they own; the coordinator
keeps a group epoch (bumped when members or subscriptions change), computes a target
assignment for it (range over the members subscribed to each topic, as the broker's
``range`` assignor; ``uniform`` is answered the same way), and hands each member its
target minus any partition another member still owns, so a partition is never owned
twice: it moves once its old owner has reported it revoked. Pure state, no I/O: the
handler brings the partition counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kio.schema.errors import ErrorCode

__all__ = ["ConsumerGroups", "HeartbeatResult", "MemberView", "assign_range"]

SESSION_TIMEOUT_S = 45.0  # Kafka's group.consumer.session.timeout.ms
HEARTBEAT_INTERVAL_MS = 500  # short, so assignments converge quickly
LEAVE_EPOCH = -1
STATIC_LEAVE_EPOCH = -2

Assignment = dict[str, frozenset[int]]


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    error: ErrorCode
    member_id: str = ""
    member_epoch: int = -1
    assignment: Assignment | None = None  # None: unchanged since the last answer


@dataclass(frozen=True, slots=True)
class MemberView:
    member_id: str
    member_epoch: int
    client_id: str
    client_host: str
    subscribed: tuple[str, ...]
    assignment: Assignment  # what it was last given
    target: Assignment


@dataclass(eq=False, slots=True)
class _Member:
    member_id: str
    client_id: str = ""
    client_host: str = ""
    epoch: int = 0
    subscribed: tuple[str, ...] = ()
    owned: Assignment = field(default_factory=dict)
    target: Assignment = field(default_factory=dict)
    sent: Assignment | None = None
    last_seen: float = 0.0


@dataclass(eq=False, slots=True)
class _Group:
    epoch: int = 0
    members: dict[str, _Member] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)  # as of the last heartbeat


def assign_range(
    members: dict[str, tuple[str, ...]], partitions: dict[str, int]
) -> dict[str, Assignment]:
    """Each topic's partitions split into contiguous ranges over the members (sorted
    by id) subscribed to it."""
    out: dict[str, dict[str, frozenset[int]]] = {m: {} for m in members}
    for topic, count in sorted(partitions.items()):
        subscribers = sorted(m for m, topics in members.items() if topic in topics)
        if not subscribers:
            continue
        share, extra = divmod(count, len(subscribers))
        start = 0
        for i, member in enumerate(subscribers):
            size = share + (1 if i < extra else 0)
            if size:
                out[member][topic] = frozenset(range(start, start + size))
            start += size
    return out


class ConsumerGroups:
    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Group] = {}

    def is_consumer_group(self, namespace: str, group_id: str) -> bool:
        group = self._groups.get((namespace, group_id))
        return group is not None and bool(group.members)

    def subscriptions(self, namespace: str, group_id: str, subscribed: tuple[str, ...]) -> set[str]:
        """Every topic the group's members subscribe to, with ``subscribed`` added."""
        group = self._groups.get((namespace, group_id))
        topics = set(subscribed)
        if group is not None:
            for member in group.members.values():
                topics.update(member.subscribed)
        return topics

    def heartbeat(
        self,
        namespace: str,
        group_id: str,
        *,
        member_id: str,
        member_epoch: int,
        subscribed: tuple[str, ...] | None,
        owned: Assignment | None,
        partitions: dict[str, int],
        now: float,
        client_id: str = "",
        client_host: str = "",
    ) -> HeartbeatResult:
        """One heartbeat; ``partitions`` gives each subscribed topic's partition count."""
        self.expire(now)
        group = self._groups.setdefault((namespace, group_id), _Group())
        group.partitions = partitions
        member = group.members.get(member_id)
        if member_epoch in (LEAVE_EPOCH, STATIC_LEAVE_EPOCH):
            if member is not None:
                del group.members[member_id]
                self._rebalance(group, partitions)
            return HeartbeatResult(ErrorCode.none, member_id, member_epoch)
        if member is None:
            if member_epoch != 0:
                return HeartbeatResult(ErrorCode.unknown_member_id, member_id)
            member = group.members[member_id] = _Member(member_id, client_id, client_host)
            changed = True
        else:
            changed = member_epoch == 0  # rejoining from scratch
        member.last_seen = now
        if subscribed is not None and tuple(sorted(subscribed)) != member.subscribed:
            member.subscribed = tuple(sorted(subscribed))
            changed = True
        if owned is not None:
            member.owned = owned
        if changed or self._partitions_changed(group, partitions):
            self._rebalance(group, partitions)
        assignment = self._assignable(group, member)
        member.epoch = group.epoch
        if assignment == member.sent:
            return HeartbeatResult(ErrorCode.none, member_id, group.epoch)
        member.sent = assignment
        return HeartbeatResult(ErrorCode.none, member_id, group.epoch, assignment)

    def check_commit(self, namespace: str, group_id: str, member_id: str) -> ErrorCode:
        group = self._groups.get((namespace, group_id))
        if group is None or member_id not in group.members:
            return ErrorCode.unknown_member_id
        return ErrorCode.none

    def describe(self, namespace: str, group_id: str) -> tuple[int, list[MemberView]] | None:
        """The group epoch and its members, or None for a group never seen."""
        group = self._groups.get((namespace, group_id))
        if group is None:
            return None
        return group.epoch, [
            MemberView(
                m.member_id,
                m.epoch,
                m.client_id,
                m.client_host,
                m.subscribed,
                m.sent or {},
                m.target,
            )
            for m in group.members.values()
        ]

    def groups(self, namespace: str) -> dict[str, int]:
        """Group id to member count, for the groups of ``namespace``."""
        return {g: len(group.members) for (ns, g), group in self._groups.items() if ns == namespace}

    def expire(self, now: float) -> None:
        """Drop members silent longer than the session timeout (checked on every
        heartbeat: a group nobody heartbeats has nobody to tell)."""
        for group in self._groups.values():
            silent = [m for m in group.members.values() if now - m.last_seen > SESSION_TIMEOUT_S]
            for member in silent:
                del group.members[member.member_id]
            if silent:
                self._rebalance(group, group.partitions)

    def _partitions_changed(self, group: _Group, partitions: dict[str, int]) -> bool:
        for member in group.members.values():
            for topic, owned in member.target.items():
                if owned and max(owned) >= partitions.get(topic, 0):
                    return True
        assigned = {
            (topic, p)
            for member in group.members.values()
            for topic, parts in member.target.items()
            for p in parts
        }
        subscribed = {t for m in group.members.values() for t in m.subscribed}
        return any(
            (topic, p) not in assigned
            for topic, count in partitions.items()
            if topic in subscribed
            for p in range(count)
        )

    def _rebalance(self, group: _Group, partitions: dict[str, int]) -> None:
        group.epoch += 1
        targets = assign_range(
            {m.member_id: m.subscribed for m in group.members.values()}, partitions
        )
        for member in group.members.values():
            member.target = targets.get(member.member_id, {})

    def _assignable(self, group: _Group, member: _Member) -> Assignment:
        """The member's target without partitions another member still owns."""
        taken = {
            (topic, p)
            for other in group.members.values()
            if other is not member
            for topic, parts in other.owned.items()
            for p in parts
        }
        out: Assignment = {}
        for topic, parts in member.target.items():
            free = frozenset(p for p in parts if (topic, p) not in taken)
            if free:
                out[topic] = free
        return out
