"""Transactional messages (RocketMQ's half messages): held until committed, then made
visible like a delayed message that fell due, or rolled back.
"""

from __future__ import annotations

from polymq.storage.engine import records as rec
from polymq.storage.engine.appends import Appends, append_result
from polymq.storage.engine.core import EngineCore, EnginePart
from polymq.storage.engine.state import Held
from polymq.storage.errors import InvalidArgument, TransactionNotFound
from polymq.storage.model import AppendRequest, AppendResult, HalfMessage, Message, QueueRef

__all__ = ["Transactions"]


class Transactions(EnginePart):
    """The undecided transactions of one engine."""

    def __init__(self, core: EngineCore, appends: Appends) -> None:
        super().__init__(core)
        self._appends = appends

    def _half(self, held: Held) -> HalfMessage:
        message = rec.decode_entry(held.record.entry)
        assert isinstance(message, Message)
        queues = []
        for d in held.record.dispatches:
            topic = self._state.topics_by_id.get(d.topic_id)
            if topic is not None:
                queues.append(QueueRef(topic.namespace, topic.name, d.queue_id))
        producer_group = held.record.aux.partition("\x00")[2] or None
        return HalfMessage(
            transaction_id=held.record.message_id,
            message_id=held.record.message_id,
            message=message,
            queues=tuple(queues),
            store_timestamp_ms=held.record.store_ms,
            producer_group=producer_group,
        )

    async def append_half(self, request: AppendRequest, producer_group: str | None) -> HalfMessage:
        if not isinstance(request.entry, Message):
            raise InvalidArgument("a transactional half message must be a single Message")
        await self._core.writable()
        targets = self._appends.validate(request)
        namespace = request.queues[0].namespace
        aux = f"{namespace}\x00{producer_group or ''}"
        _, position = self._appends.append_now(
            request.entry, targets, flags=rec.MESSAGE_HALF, aux=aux
        )
        await self._log.wait_durable()
        return self._half(self._state.held[position])

    async def end_transaction(
        self, namespace: str, transaction_id: str, commit: bool
    ) -> AppendResult | None:
        await self._core.writable()
        position = self._state.held_by_id.get((namespace, transaction_id))
        held = self._state.held.get(position) if position is not None else None
        if held is None or not held.is_half:
            raise TransactionNotFound(
                f"no undecided transaction {transaction_id!r} in namespace {namespace!r}"
            )
        if commit:
            record = self._appends.make_visible(held)
            await self._log.wait_durable()
            refs = [self._state.ref((d.topic_id, d.queue_id)) for d in record.dispatches]
            return append_result(record, refs)
        self._state.drop_held(held.position)
        self._core.record(rec.Resolve(held.position, rec.RESOLVE_ROLLBACK))
        await self._log.wait_durable()
        return None

    def list_undecided(self, namespace: str | None, older_than_ms: int) -> list[HalfMessage]:
        self._core.check_open()
        cutoff = self._core.now() - older_than_ms
        return [
            self._half(h)
            for h in self._state.held.values()
            if h.is_half
            and (namespace is None or h.namespace == namespace)
            and h.record.store_ms <= cutoff
        ]
