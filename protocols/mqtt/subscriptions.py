"""The subscriptions of one namespace's sessions: the topic filter index, the
shared-subscription groups and their queues, and which tails the filters need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from polymq.protocols.mqtt.core import BrokerCore
from polymq.protocols.mqtt.model import SHARED_PREFIX, Session, SharedGroup, SubOptions, queue_topic
from polymq.protocols.mqtt.tails import Tails
from polymq.protocols.mqtt.topic_filter_index import filter_matches, split_shared
from polymq.storage.errors import StorageError
from polymq.storage.model import QueueRef

__all__ = ["Subscriptions"]

log = logging.getLogger(__name__)


class Subscriptions:
    """Adds and removes the filters of sessions (this gateway's or, with several
    gateways, the others') in the index, with the groups and tails they need."""

    def __init__(self, core: BrokerCore, tails: Tails) -> None:
        self.core = core
        self.tails = tails
        self._dropping: dict[str, asyncio.Task[None]] = {}  # shared queues being deleted

    async def subscribe(self, session: Session, topic_filter: str, options: SubOptions) -> bool:
        """Add or replace a subscription; True if it is new (retain handling 1). A
        persistent session keeps it once :meth:`save_subscriptions` ran."""
        new = topic_filter not in session.subscriptions
        if not new and split_shared(topic_filter) is not None:
            session.set_subscription(topic_filter, options)  # stays a member: keep the queue
            return False
        if not new:
            self.remove(session, topic_filter)
        await self.add(session, topic_filter, options)
        if self.core.peers is not None and new:
            if session.fresh is None:
                session.fresh = {}
            session.fresh[topic_filter] = None
        return new

    def unsubscribe(self, session: Session, topic_filter: str) -> bool:
        if topic_filter not in session.subscriptions:
            return False
        self.remove(session, topic_filter)
        return True

    async def add(self, session: Session, topic_filter: str, options: SubOptions) -> None:
        session.set_subscription(topic_filter, options)
        shared = split_shared(topic_filter)
        if shared is None:
            self.core.index.add(topic_filter, session.client_id, (session, options))
        else:
            group = self.core.shared.get(shared) or await self._new_group(*shared)
            group.members[session.client_id] = session
        # Only now: the tail routes as soon as it starts, and must find this entry.
        await self.tails.count(shared[1] if shared else topic_filter)

    def put(self, session: Session, topic_filter: str, options: SubOptions) -> tuple[str, bool]:
        """Another gateway's subscription into the index, at once (its shared queue
        exists: that gateway made it). Returns the filter to tail, and whether it is
        new here (its tail is to be counted)."""
        new = topic_filter not in session.subscriptions
        session.set_subscription(topic_filter, options)
        shared = split_shared(topic_filter)
        if shared is None:
            self.core.index.add(topic_filter, session.client_id, (session, options))
            return topic_filter, new
        group = self.core.shared.get(shared) or self._put_group(*shared)
        group.members[session.client_id] = session
        return shared[1], new

    def remove(self, session: Session, topic_filter: str, *, drop_group: bool = True) -> None:
        if session.pop_subscription(topic_filter) is None:
            return
        if session.announced_at is not None:
            session.announced_at.pop(topic_filter, None)
        shared = split_shared(topic_filter)
        self.tails.uncount(shared[1] if shared else topic_filter)
        if shared is None:
            self.core.index.remove(topic_filter, session.client_id)
            return
        group = self.core.shared.get(shared)
        if group is not None:
            group.members.pop(session.client_id, None)
            if not group.members:
                self._drop_group(shared, group, drop_queue=drop_group)

    async def _new_group(self, name: str, inner: str) -> SharedGroup:
        queue = QueueRef(self.core.namespace, queue_topic(SHARED_PREFIX, f"{name}/{inner}"), 0)
        dropping = self._dropping.get(queue.topic)
        if dropping is not None:  # the group's last member just left: a new queue
            await asyncio.shield(dropping)
        await self.core.ensure_topic(queue.topic)
        # another member may have made it meanwhile
        return self.core.shared.get((name, inner)) or self._put_group(name, inner)

    def _put_group(self, name: str, inner: str) -> SharedGroup:
        queue = QueueRef(self.core.namespace, queue_topic(SHARED_PREFIX, f"{name}/{inner}"), 0)
        group = self.core.shared[(name, inner)] = SharedGroup(name=name, filter=inner, queue=queue)
        self.core.index.add(inner, ("$share", name), group)
        return group

    def _drop_group(
        self, key: tuple[str, str], group: SharedGroup, *, drop_queue: bool = True
    ) -> None:
        """The last member left (unsubscribed, or its session ended): the group is
        gone, and its queue with what waited in it (no subscription, no message).
        Members of a persistent session that is only offline stay members."""
        del self.core.shared[key]
        self.core.index.remove(group.filter, ("$share", group.name))
        topic = group.queue.topic
        self.core.topics.discard(topic)
        if not drop_queue:
            return

        async def delete() -> None:
            try:
                await self.core.delete_topic(topic)
            except StorageError as e:
                log.warning("mqtt: deleting shared queue %s: %s", topic, e)
            finally:
                if self._dropping.get(topic) is task:
                    del self._dropping[topic]

        task = self.core.tasks.spawn(delete())
        self._dropping[topic] = task

    async def drop_orphan_groups(self) -> None:
        """Shared queues no restored session is a member of (left behind by a crash
        or an older version) are deleted when the broker loads."""
        core = self.core
        used = {group.queue.topic for group in core.shared.values()}
        try:
            for info in await core.processor.list_topics(core.caller, include_internal=True):
                if info.name.startswith(SHARED_PREFIX) and info.name not in used:
                    await core.delete_topic(info.name)
        except StorageError as e:  # not worth refusing connections for: next load
            log.warning("mqtt: removing unused shared queues of %s: %s", core.namespace, e)

    def shared_queues(self, session: Session) -> list[tuple[QueueRef, SubOptions]]:
        found = []
        for topic_filter, options in session.subscriptions.items():
            shared = split_shared(topic_filter)
            if shared is not None and shared in self.core.shared:
                found.append((self.core.shared[shared].queue, options))
        return found

    def session_grant(self, session: Session, topic: str) -> tuple[int, list[int], bool] | None:
        """For a message from the session's queue: the best QoS, the subscription ids
        and retain-as-published of its plain subscriptions matching ``topic``, or
        ``None`` if none still does."""
        qos = -1
        ids: list[int] = []
        rap = False
        for topic_filter, options in session.subscriptions.items():
            if split_shared(topic_filter) is None and filter_matches(topic_filter, topic):
                qos = max(qos, options.qos)
                rap = rap or options.retain_as_published
                if options.subscription_id:
                    ids.append(options.subscription_id)
        return None if qos < 0 else (qos, ids, rap)

    async def close(self) -> None:
        """Let the deletes of shared queues in progress finish (server stop)."""
        for task in list(self._dropping.values()):
            with contextlib.suppress(BaseException):
                await task
