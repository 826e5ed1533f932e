"""The classic consumer-group protocol (JoinGroup/SyncGroup/Heartbeat/LeaveGroup), kept
in this gateway's memory; committed offsets live in storage, so a new coordinator
resumes them.

A group moves through Kafka's states (GroupMetadata.scala)::

    Empty --join--> PreparingRebalance --all joined / timeout--> CompletingRebalance
    CompletingRebalance --leader's sync--> Stable
    Stable / CompletingRebalance --join, leave, expiry--> PreparingRebalance
    PreparingRebalance --nobody left--> Empty

Assignment is the client's (the leader runs range, roundrobin or cooperative-sticky);
the coordinator only relays it, fencing stale generations.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kio.schema.errors import ErrorCode

__all__ = ["GroupCoordinator", "GroupState", "JoinResult", "MemberView", "SyncResult"]

_SWEEP_INTERVAL_S = 0.2


class GroupState(Enum):
    EMPTY = "Empty"
    PREPARING = "PreparingRebalance"
    COMPLETING = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


# What a heartbeat hears in each state (Kafka's GroupCoordinator.handleHeartbeat).
HEARTBEAT_ANSWER: dict[GroupState, ErrorCode] = {
    GroupState.EMPTY: ErrorCode.unknown_member_id,
    GroupState.PREPARING: ErrorCode.rebalance_in_progress,
    GroupState.COMPLETING: ErrorCode.none,
    GroupState.STABLE: ErrorCode.none,
    GroupState.DEAD: ErrorCode.coordinator_not_available,
}


@dataclass(frozen=True, slots=True)
class MemberView:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    metadata: bytes
    assignment: bytes


@dataclass(frozen=True, slots=True)
class JoinResult:
    error: ErrorCode
    generation: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    member_id: str = ""
    members: tuple[MemberView, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncResult:
    error: ErrorCode
    assignment: bytes = b""
    protocol_type: str | None = None
    protocol_name: str | None = None


@dataclass(eq=False, slots=True)
class _Member:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    session_timeout_s: float
    rebalance_timeout_s: float
    protocols: list[tuple[str, bytes]]
    last_seen: float
    assignment: bytes = b""
    join: asyncio.Future[JoinResult] | None = None
    sync: asyncio.Future[SyncResult] | None = None

    def metadata(self, protocol: str | None) -> bytes:
        return next((m for name, m in self.protocols if name == protocol), b"")


@dataclass(eq=False, slots=True)
class _Group:
    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    members: dict[str, _Member] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    # Kafka's InitialDelayedJoin: a first rebalance completes no sooner than this.
    join_not_before: float = 0.0
    delay_timer: asyncio.TimerHandle | None = None

    def joined(self, member_id: str, members: tuple[MemberView, ...] = ()) -> JoinResult:
        """A successful JoinGroup answer in the current generation (``members``: for
        the leader)."""
        return JoinResult(
            ErrorCode.none,
            generation=self.generation,
            protocol_type=self.protocol_type,
            protocol_name=self.protocol_name,
            leader=self.leader,
            member_id=member_id,
            members=members,
        )


class GroupCoordinator:
    """``initial_rebalance_delay_ms`` is Kafka's ``group.initial.rebalance.delay.ms``
    (3000 there): an empty group's first rebalance waits that long, and as long again
    for each member that joins meanwhile (up to the rebalance timeout), so members
    starting together form one generation instead of one per joiner. 0 (the default
    here) completes as soon as everyone known has joined."""

    def __init__(self, *, initial_rebalance_delay_ms: int = 0) -> None:
        self._groups: dict[tuple[str, str], _Group] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._initial_delay_s = initial_rebalance_delay_ms / 1000

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for group in self._groups.values():
            for timer in (group.timer, group.delay_timer):
                if timer is not None:
                    timer.cancel()
            for member in group.members.values():
                _cancel(member)

    # -- membership ----------------------------------------------------------------

    async def join(
        self,
        namespace: str,
        group_id: str,
        *,
        member_id: str,
        group_instance_id: str | None,
        client_id: str,
        client_host: str,
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
    ) -> JoinResult:
        self._start_sweeper()
        group = self._groups.setdefault((namespace, group_id), _Group(group_id))
        if not protocols:
            return JoinResult(ErrorCode.inconsistent_group_protocol)
        if group.members and (
            protocol_type != group.protocol_type
            or not self._common_protocols(group, protocols, exclude=member_id)
        ):
            return JoinResult(ErrorCode.inconsistent_group_protocol)
        now = _now()
        member = group.members.get(member_id) if member_id else None
        if member_id and member is None:
            return JoinResult(ErrorCode.unknown_member_id, member_id=member_id)
        if member is None and group_instance_id:
            returning = self._static_rejoin(group, group_instance_id, client_id, protocols, now)
            if returning is not None:
                return returning
        if member is None:
            member = _Member(
                member_id=f"{client_id or 'member'}-{uuid.uuid4()}",
                group_instance_id=group_instance_id,
                client_id=client_id,
                client_host=client_host,
                session_timeout_s=session_timeout_ms / 1000,
                rebalance_timeout_s=max(rebalance_timeout_ms, session_timeout_ms) / 1000,
                protocols=protocols,
                last_seen=now,
            )
            group.members[member.member_id] = member
        else:
            current = self._unchanged_rejoin(group, member, protocols, now)
            if current is not None:
                return current
            member.protocols = protocols
            member.last_seen = now
            if member.join is not None and not member.join.done():
                member.join.cancel()
        group.protocol_type = protocol_type
        future: asyncio.Future[JoinResult] = asyncio.get_running_loop().create_future()
        member.join = future
        self._prepare_rebalance(group)
        self._extend_initial_delay(group, member)
        self._maybe_complete_join(group)
        try:
            return await asyncio.wait_for(asyncio.shield(future), member.rebalance_timeout_s + 5)
        except TimeoutError:
            return JoinResult(ErrorCode.rebalance_in_progress)
        except asyncio.CancelledError:
            if future.cancelled() and not _current_task_cancelling():
                return JoinResult(ErrorCode.rebalance_in_progress)
            raise

    async def sync(
        self,
        namespace: str,
        group_id: str,
        *,
        member_id: str,
        generation: int,
        assignments: dict[str, bytes],
    ) -> SyncResult:
        group = self._groups.get((namespace, group_id))
        member = group.members.get(member_id) if group else None
        if group is None or member is None:
            return SyncResult(ErrorCode.unknown_member_id)
        if generation != group.generation:
            return SyncResult(ErrorCode.illegal_generation)
        member.last_seen = _now()
        if group.state is GroupState.PREPARING:
            return SyncResult(ErrorCode.rebalance_in_progress)
        if group.state is GroupState.STABLE:
            return self._sync_result(group, member)
        if member_id == group.leader:
            for each in group.members.values():
                each.assignment = assignments.get(each.member_id, b"")
            group.state = GroupState.STABLE
            for each in group.members.values():
                if each.sync is not None and not each.sync.done():
                    each.sync.set_result(self._sync_result(group, each))
                each.sync = None
            return self._sync_result(group, member)
        future: asyncio.Future[SyncResult] = asyncio.get_running_loop().create_future()
        member.sync = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), member.rebalance_timeout_s)
        except TimeoutError:
            return SyncResult(ErrorCode.rebalance_in_progress)

    def heartbeat(
        self, namespace: str, group_id: str, member_id: str, generation: int
    ) -> ErrorCode:
        group = self._groups.get((namespace, group_id))
        member = group.members.get(member_id) if group else None
        if group is None or member is None:
            return ErrorCode.unknown_member_id
        member.last_seen = _now()
        if generation != group.generation:
            return ErrorCode.illegal_generation
        return HEARTBEAT_ANSWER[group.state]

    def leave(self, namespace: str, group_id: str, member_id: str) -> ErrorCode:
        group = self._groups.get((namespace, group_id))
        member = group.members.get(member_id) if group else None
        if group is None or member is None:
            return ErrorCode.unknown_member_id
        self._remove(group, member)
        return ErrorCode.none

    def check_commit(
        self, namespace: str, group_id: str, member_id: str, generation: int
    ) -> ErrorCode:
        """Fence commits from an old generation; a group used only for offsets
        (generation -1, no members) always may commit. While a rebalance is being
        prepared the current generation still may (members commit before rejoining);
        between join and sync the assignment is unknown, so not then (as Kafka)."""
        group = self._groups.get((namespace, group_id))
        if generation < 0 and not member_id:
            return ErrorCode.none
        if group is None or not group.members:
            return ErrorCode.none if generation < 0 else ErrorCode.unknown_member_id
        member = group.members.get(member_id)
        if member is None:
            return ErrorCode.unknown_member_id
        member.last_seen = _now()
        if generation != group.generation:
            return ErrorCode.illegal_generation
        if group.state is GroupState.COMPLETING:
            return ErrorCode.rebalance_in_progress
        return ErrorCode.none

    # -- hand-over between gateways ---------------------------------------------------

    def knows(self, namespace: str, group_id: str, member_id: str) -> bool:
        group = self._groups.get((namespace, group_id))
        return group is not None and member_id in group.members

    def snapshot(self, namespace: str, group_id: str) -> dict[str, Any] | None:
        """A stable generation as JSON, for the gateway that takes the group over
        (Kafka writes the same to __consumer_offsets); None in any other state."""
        group = self._groups.get((namespace, group_id))
        if group is None or group.state is not GroupState.STABLE:
            return None
        return {
            "generation": group.generation,
            "protocol_type": group.protocol_type,
            "protocol_name": group.protocol_name,
            "leader": group.leader,
            "members": [
                {
                    "member_id": m.member_id,
                    "group_instance_id": m.group_instance_id,
                    "client_id": m.client_id,
                    "client_host": m.client_host,
                    "session_timeout_s": m.session_timeout_s,
                    "rebalance_timeout_s": m.rebalance_timeout_s,
                    "protocols": [[name, _b64(meta)] for name, meta in m.protocols],
                    "assignment": _b64(m.assignment),
                }
                for m in group.members.values()
            ],
        }

    def restore(self, namespace: str, group_id: str, stored: dict[str, Any]) -> bool:
        """Carry on the generation another gateway coordinated (:meth:`snapshot`), so
        its members heartbeat and commit here as they did there. Never over a group
        with members of its own, nor over a generation this gateway has moved past
        (a member that expired here is not brought back by what this gateway stored
        itself). Members that do not come expire as usual."""
        group = self._groups.get((namespace, group_id))
        generation = int(stored["generation"])
        if group is not None and (group.members or group.generation >= generation):
            return False
        self._start_sweeper()
        now = _now()
        group = _Group(
            group_id,
            state=GroupState.STABLE,
            generation=generation,
            protocol_type=stored["protocol_type"],
            protocol_name=stored["protocol_name"],
            leader=stored["leader"],
        )
        for m in stored["members"]:
            group.members[m["member_id"]] = _Member(
                member_id=m["member_id"],
                group_instance_id=m["group_instance_id"],
                client_id=m["client_id"],
                client_host=m["client_host"],
                session_timeout_s=float(m["session_timeout_s"]),
                rebalance_timeout_s=float(m["rebalance_timeout_s"]),
                protocols=[(name, _unb64(meta)) for name, meta in m["protocols"]],
                last_seen=now,
                assignment=_unb64(m["assignment"]),
            )
        self._groups[(namespace, group_id)] = group
        return True

    # -- inspection ----------------------------------------------------------------

    def describe(self, namespace: str, group_id: str) -> tuple[GroupState, _Group] | None:
        group = self._groups.get((namespace, group_id))
        return None if group is None else (group.state, group)

    def members(self, namespace: str, group_id: str) -> tuple[MemberView, ...]:
        group = self._groups.get((namespace, group_id))
        if group is None:
            return ()
        return tuple(_view(m, group.protocol_name) for m in group.members.values())

    def groups(self, namespace: str) -> dict[str, tuple[GroupState, str | None]]:
        return {
            g.group_id: (g.state, g.protocol_type)
            for (ns, _), g in self._groups.items()
            if ns == namespace
        }

    def forget(self, namespace: str, group_id: str) -> ErrorCode:
        """Delete a group's in-memory state: only an empty group may go."""
        group = self._groups.get((namespace, group_id))
        if group is None:
            return ErrorCode.none
        if group.members:
            return ErrorCode.non_empty_group
        del self._groups[(namespace, group_id)]
        return ErrorCode.none

    # -- the state machine -----------------------------------------------------------

    def _common_protocols(
        self, group: _Group, protocols: list[tuple[str, bytes]], *, exclude: str = ""
    ) -> set[str]:
        names = {name for name, _ in protocols}
        for member in group.members.values():
            if member.member_id != exclude:
                names &= {name for name, _ in member.protocols}
        return names

    def _static_rejoin(
        self,
        group: _Group,
        instance_id: str,
        client_id: str,
        protocols: list[tuple[str, bytes]],
        now: float,
    ) -> JoinResult | None:
        """A static member (KIP-345) back under a new member id: it takes over its old
        place, assignment included, without a rebalance, when the group is stable, it
        was not the leader and its protocols did not change. None: join normally (the
        old incarnation, if any, is dropped)."""
        old = next((m for m in group.members.values() if m.group_instance_id == instance_id), None)
        if old is None:
            return None
        del group.members[old.member_id]
        _cancel(old)
        keeps_place = (
            group.state is GroupState.STABLE
            and old.member_id != group.leader
            and _same_subscription(old.protocols, protocols)
        )
        if not keeps_place:
            return None
        old.member_id = f"{client_id or 'member'}-{uuid.uuid4()}"
        old.last_seen = now
        group.members[old.member_id] = old
        return group.joined(old.member_id)

    def _unchanged_rejoin(
        self, group: _Group, member: _Member, protocols: list[tuple[str, bytes]], now: float
    ) -> JoinResult | None:
        """A known member joining again with the very protocols it has, while the
        generation it can sync is current: Kafka (GroupCoordinator.doCurrentMemberJoinGroup)
        answers with that generation instead of rebalancing, for a follower of a stable
        group and for anyone between join and sync (the leader gets the members again).
        kafka-python 3.0 sends such a JoinGroup whenever a poll() timed out while its
        join/sync was in flight; rebalancing on it made the group rebalance forever."""
        if member.protocols != protocols or (member.join is not None and not member.join.done()):
            return None
        is_leader = member.member_id == group.leader
        if group.state is GroupState.STABLE and is_leader:
            return None
        if group.state not in (GroupState.STABLE, GroupState.COMPLETING):
            return None
        member.last_seen = now
        members: tuple[MemberView, ...] = ()
        if is_leader:
            members = tuple(_view(m, group.protocol_name) for m in group.members.values())
        return group.joined(member.member_id, members)

    def _prepare_rebalance(self, group: _Group) -> None:
        if group.state is GroupState.PREPARING:
            return
        if group.state is GroupState.EMPTY and self._initial_delay_s > 0:
            group.join_not_before = _now() + self._initial_delay_s
            self._arm_delay(group)
        group.state = GroupState.PREPARING
        for member in group.members.values():
            if member.sync is not None and not member.sync.done():
                member.sync.set_result(SyncResult(ErrorCode.rebalance_in_progress))
            member.sync = None
        timeout = max((m.rebalance_timeout_s for m in group.members.values()), default=1.0)
        loop = asyncio.get_running_loop()
        group.timer = loop.call_later(timeout, self._complete_join, group)

    def _extend_initial_delay(self, group: _Group, member: _Member) -> None:
        """A member joining during the initial delay extends it by the delay, never
        past the rebalance timeout from when the group started forming."""
        now = _now()
        if group.join_not_before <= now or group.timer is None:
            return
        deadline = group.timer.when()
        later = min(now + self._initial_delay_s, deadline)
        if later > group.join_not_before and member.join is not None:
            group.join_not_before = later
            self._arm_delay(group)

    def _arm_delay(self, group: _Group) -> None:
        if group.delay_timer is not None:
            group.delay_timer.cancel()
        delay = max(0.0, group.join_not_before - _now())
        group.delay_timer = asyncio.get_running_loop().call_later(
            delay, self._maybe_complete_join, group
        )

    def _maybe_complete_join(self, group: _Group) -> None:
        if _now() < group.join_not_before:
            return  # the initial delay's timer calls again
        if group.state is GroupState.PREPARING and all(
            m.join is not None and not m.join.done() for m in group.members.values()
        ):
            self._complete_join(group)

    def _complete_join(self, group: _Group) -> None:
        if group.state is not GroupState.PREPARING:
            return
        for timer in (group.timer, group.delay_timer):
            if timer is not None:
                timer.cancel()
        group.timer = group.delay_timer = None
        group.join_not_before = 0.0
        for member in list(group.members.values()):
            if member.join is None or member.join.done():
                del group.members[member.member_id]  # did not rejoin in time
        group.generation += 1
        if not group.members:
            group.state = GroupState.EMPTY
            group.leader = ""
            group.protocol_name = None
            return
        members = list(group.members.values())
        if group.leader not in group.members:
            group.leader = members[0].member_id
        common = self._common_protocols(group, members[0].protocols)
        leader = group.members[group.leader]
        group.protocol_name = next((n for n, _ in leader.protocols if n in common), None)
        group.state = GroupState.COMPLETING
        now = _now()
        everyone = tuple(_view(m, group.protocol_name) for m in members)
        for member in members:
            member.last_seen = now
            member.assignment = b""
            assert member.join is not None
            member.join.set_result(
                group.joined(member.member_id, everyone if member.member_id == group.leader else ())
            )
            member.join = None

    def _remove(self, group: _Group, member: _Member) -> None:
        _cancel(member)
        del group.members[member.member_id]
        if group.state is GroupState.PREPARING:
            self._maybe_complete_join(group)
            if not group.members:
                self._complete_join(group)
        elif group.members:
            self._prepare_rebalance(group)
        else:
            group.state = GroupState.EMPTY
            group.generation += 1
            group.leader = ""

    def _sync_result(self, group: _Group, member: _Member) -> SyncResult:
        return SyncResult(
            ErrorCode.none,
            assignment=member.assignment,
            protocol_type=group.protocol_type,
            protocol_name=group.protocol_name,
        )

    # -- session expiry --------------------------------------------------------------

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            self.expire(_now())

    def expire(self, now: float) -> None:
        """Remove members silent for longer than their session timeout (members
        waiting in a join or sync are not silent)."""
        for group in list(self._groups.values()):
            for member in list(group.members.values()):
                waiting = (member.join is not None and not member.join.done()) or (
                    member.sync is not None and not member.sync.done()
                )
                if not waiting and now - member.last_seen > member.session_timeout_s:
                    self._remove(group, member)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _view(member: _Member, protocol: str | None) -> MemberView:
    return MemberView(
        member_id=member.member_id,
        group_instance_id=member.group_instance_id,
        client_id=member.client_id,
        client_host=member.client_host,
        metadata=member.metadata(protocol),
        assignment=member.assignment,
    )


def _cancel(member: _Member) -> None:
    if member.join is not None and not member.join.done():
        member.join.cancel()
    if member.sync is not None and not member.sync.done():
        member.sync.set_result(SyncResult(ErrorCode.rebalance_in_progress))
    member.join = member.sync = None


def _subscribed_topics(metadata: bytes) -> frozenset[str] | None:
    """The topics of a consumer protocol subscription (version int16, then an array of
    strings: the same in every version), or None if it is not one."""
    try:
        (count,) = struct.unpack_from(">i", metadata, 2)
        position, topics = 6, set()
        for _ in range(count):
            (size,) = struct.unpack_from(">h", metadata, position)
            topics.add(metadata[position + 2 : position + 2 + size].decode())
            position += 2 + size
    except (struct.error, UnicodeDecodeError):
        return None
    return frozenset(topics)


def _same_subscription(old: list[tuple[str, bytes]], new: list[tuple[str, bytes]]) -> bool:
    """Whether a returning static member asks for what it had: the same protocols and
    topics (its metadata also lists the partitions it owned, which a restart forgets)."""
    if [name for name, _ in old] != [name for name, _ in new]:
        return False
    for (_, before), (_, after) in zip(old, new, strict=True):
        topics = _subscribed_topics(before)
        if topics is None or topics != _subscribed_topics(after):
            return before == after
    return True


def _now() -> float:
    return asyncio.get_running_loop().time()


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
