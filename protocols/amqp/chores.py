"""A vhost's background work: what no client call does but RabbitMQ promises anyway.

Consumed messages are trimmed from storage, what a gone gateway left (its exclusive
and transient queues and exchanges, its consumers) is removed, unused queues expire
(``x-expires``) and expired messages leave queue heads (``x-message-ttl``, a
message's ``expiration``). Each shared chore is done by one gateway per queue (the
owner by :meth:`Membership.is_owner`); every task belongs to one :class:`TaskSet`,
so the vhost's close stops all of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Final, Protocol

from polymq.gateway.processor import Caller
from polymq.protocols.amqp.changes import ChangeLog, Membership
from polymq.protocols.amqp.definitions import Definitions, VhostView
from polymq.protocols.amqp.expiry import sweep_expired
from polymq.protocols.amqp.queues import GROUP, QueueDef
from polymq.storage.errors import StorageError
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import QueueRef

__all__ = ["ChoreHost", "Chores"]

log = logging.getLogger(__name__)

_TRIM_EVERY_S: Final = 30.0
_REAP_EVERY_S: Final = 1.0
# A peer gateway missing from the directory this long is gone: its exclusive and
# transient queues and its consumers are removed (a restart under the same id at once).
_REAP_GRACE_S: Final = 3.0


class ChoreHost(VhostView, Protocol):
    """The vhost as its chores see it: the deletions they make are the vhost's own,
    under its lock and announced on its change log."""

    @property
    def membership(self) -> Membership: ...

    @property
    def definitions(self) -> Definitions: ...

    @property
    def changes(self) -> ChangeLog | None: ...

    @property
    def lock(self) -> asyncio.Lock: ...

    @property
    def last_change(self) -> int: ...

    async def settle(self, before: int) -> None: ...

    async def delete_queue_locked(self, caller: Caller, queue: QueueDef) -> None: ...

    async def delete_exchange_locked(self, caller: Caller, name: str) -> None: ...

    async def unregister(self, caller: Caller, queue: QueueDef, consumer_id: str) -> None: ...


class Chores:
    """The background work of one vhost, started once it is loaded."""

    def __init__(self, host: ChoreHost) -> None:
        self._host = host
        self._tasks = TaskSet(f"amqp vhost {host.namespace}")
        self._sweepers: dict[str, asyncio.Task[None]] = {}
        self._expiry_tasks: dict[str, asyncio.Task[None]] = {}
        self._trimmed: dict[QueueRef, int] = {}  # the prefix each queue was trimmed to
        self._absent_since: dict[str, float] = {}  # gateway id -> first seen missing
        self._tails: dict[str, str | None] = {}  # peer gateway id -> its tailing instance

    def start(self, caller: Caller) -> None:
        self._tasks.spawn(self._trim_periodically(caller), name="amqp-trim")
        self._tasks.spawn(self._reap_periodically(caller), name="amqp-reap")

    async def close(self) -> None:
        await self._tasks.close()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a follow-up of a change (an announcement, an auto-delete) apart from
        the call that caused it."""
        self._tasks.spawn(coro)

    # -- trimming --------------------------------------------------------------------

    async def trim_consumed(self, caller: Caller) -> None:
        """Let storage reclaim consumed messages: each queue's log is trimmed
        (``delete_records``) up to the group's fully acked prefix (``consumed_below``),
        so acked messages do not hold disk even in a queue that never drains. Only
        :data:`GROUP` reads a (non-stream) AMQP queue, so nothing below that prefix can
        be wanted again. A view's topic belongs to others and is never trimmed. Run
        every :data:`_TRIM_EVERY_S` by the queue's owner gateway, not per ack: one
        cheap look per storage queue, a deletion only when the prefix moved."""
        host = self._host
        processor = host.processor
        for queue in list(host.queues.values()):
            if queue.is_stream or queue.view_topic is not None:
                continue
            if not host.membership.is_owner(queue.name):
                continue
            for ref in queue.refs(host.namespace):
                try:
                    below = await processor.consumed_below(caller, GROUP, ref)
                    if below > self._trimmed.get(ref, -1):
                        bounds = await processor.queue_offsets(caller, ref)
                        if below > bounds.earliest:
                            await processor.delete_records(caller, ref, below)
                        self._trimmed[ref] = below
                except StorageError as e:  # deleted meanwhile, or storage trouble
                    log.debug("amqp: trimming %s skipped: %s", ref, e)
                    self._trimmed.pop(ref, None)

    async def _trim_periodically(self, caller: Caller) -> None:
        while True:
            await asyncio.sleep(_TRIM_EVERY_S)
            await self.trim_consumed(caller)

    # -- reaping ---------------------------------------------------------------------

    async def _reap_periodically(self, caller: Caller) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            try:
                await self.reap(caller)
            except StorageError as e:
                log.debug("amqp: reaping skipped: %s", e)

    async def reap(self, caller: Caller) -> None:
        """Remove what belonged to gateways that are gone (RabbitMQ removes a dead
        node's exclusive and transient queues): their exclusive and transient
        queues and exchanges, and their consumers. One gateway per queue does it.
        Gone: out of the directory for a while, or not (or under another instance)
        tailing this vhost's change log, which every gateway with a connection in it
        does (a gateway restarted at once under its id is never out of the directory)."""
        host = self._host
        await self._look_at_tails()
        for queue in list(host.queues.values()):
            if not host.membership.is_owner(queue.name):
                continue
            if queue.home and self.gone(queue.home):
                async with host.lock:
                    await host.delete_queue_locked(caller, queue)
                continue
            for consumer_id, entry in list(queue.registry.items()):
                if self.gone(entry.instance):
                    await host.unregister(caller, queue, consumer_id)
        for name, home in list(host.definitions.exchange_homes.items()):
            if home and self.gone(home) and host.membership.is_owner(name):
                async with host.lock:
                    if name in host.exchanges:
                        await host.delete_exchange_locked(caller, name)

    async def _look_at_tails(self) -> None:
        """Which instance of each peer with consumers or queues here tails the vhost."""
        changes = self._host.changes
        if changes is None:
            return
        queues = self._host.queues.values()
        instances = {q.home for q in queues if q.home}
        instances |= {e.instance for q in queues for e in q.registry.values()}
        peers = {i.partition("#")[0] for i in instances} - {self._host.membership.gateway_id}
        tails: dict[str, str | None] = {}
        for gateway_id in peers:
            tails[gateway_id] = await changes.tailing_instance(gateway_id)
        self._tails = tails

    def gone(self, instance: str) -> bool:
        """Whether the gateway instance has ended: at once for this gateway's earlier
        runs, for a peer after :data:`_REAP_GRACE_S` out of the directory or not
        tailing the vhost as that instance."""
        membership = self._host.membership
        gateway_id = instance.partition("#")[0]
        if gateway_id == membership.gateway_id:
            return instance != membership.instance
        if gateway_id in self._tails:
            if self._tails[gateway_id] != instance:
                return self._absent_for(gateway_id + "\0tail")
            self._absent_since.pop(gateway_id + "\0tail", None)
        if membership.is_live(instance):
            self._absent_since.pop(gateway_id, None)
            return False
        return self._absent_for(gateway_id)

    def _absent_for(self, key: str) -> bool:
        now = asyncio.get_running_loop().time()
        since = self._absent_since.setdefault(key, now)
        return now - since >= _REAP_GRACE_S

    # -- expiry ----------------------------------------------------------------------

    def queue_added(self, caller: Caller, queue: QueueDef) -> None:
        """A queue came into the cache: its ``x-expires`` timer and TTL sweeper."""
        self.schedule_expiry(caller, queue)
        if queue.int_argument("x-message-ttl") is not None:
            self._start_sweeper(caller, queue)

    def queue_forgotten(self, queue: QueueDef) -> None:
        """A queue left the cache: its timers stop, and one declared again under the
        name is trimmed from offset 0."""
        for ref in queue.refs(self._host.namespace):
            self._trimmed.pop(ref, None)
        for tasks in (self._expiry_tasks, self._sweepers):
            task = tasks.pop(queue.name, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def schedule_expiry(self, caller: Caller, queue: QueueDef) -> None:
        """``x-expires``: delete the queue once unused (no consumers on any gateway,
        no get, no re-declare) for that long; the queue's owner gateway does it."""
        expires = queue.int_argument("x-expires")
        if not expires or queue.name in self._expiry_tasks:
            return
        host = self._host

        async def expire() -> None:
            loop = asyncio.get_running_loop()
            try:
                while host.queues.get(queue.name) is queue:
                    idle = loop.time() - queue.last_used
                    if (
                        queue.consumers
                        or queue.registry
                        or not host.membership.is_owner(queue.name)
                    ):
                        await asyncio.sleep(min(1.0, expires / 1000))
                        continue
                    if idle * 1000 >= expires:
                        before = host.last_change
                        async with host.lock:
                            self._expiry_tasks.pop(queue.name, None)
                            await host.delete_queue_locked(caller, queue)
                        await host.settle(before)
                        return
                    await asyncio.sleep(max(0.01, min(1.0, expires / 1000 - idle)))
            finally:
                if self._expiry_tasks.get(queue.name) is asyncio.current_task():
                    del self._expiry_tasks[queue.name]

        self._expiry_tasks[queue.name] = self._tasks.spawn(expire())

    def _start_sweeper(self, caller: Caller, queue: QueueDef, first_look_ms: int = 0) -> None:
        """The expiry sweeper of a queue (protocols.amqp.expiry): for as long as the
        queue lives if it has ``x-message-ttl``, else while its head expires."""
        if queue.is_stream or queue.name in self._sweepers:
            return
        task = self._tasks.spawn(sweep_expired(caller, self._host, queue, first_look_ms))
        self._sweepers[queue.name] = task
        task.add_done_callback(
            lambda t: (
                self._sweepers.pop(queue.name) if self._sweepers.get(queue.name) is t else None
            )
        )

    def watch_expiry(self, caller: Caller, queue: QueueDef, expires_in_ms: int) -> None:
        """A message with its own ``expiration`` is going to ``queue``: make sure a
        sweeper looks at the head about when it expires, as RabbitMQ expires messages
        at the head without consumers."""
        if queue.name in self._host.queues:
            self._start_sweeper(caller, queue, expires_in_ms)
