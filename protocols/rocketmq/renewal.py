"""Invisible-time renewal for push consumers (``auto_renew`` receives).

A push consumer caches what it receives and runs its listener on it, which may take
longer than any fixed invisible time; Apache's proxy keeps such messages invisible by
renewing them for as long as the client holds them (its ``ReceiptHandleProcessor``).
Each renewal gets a new receipt from storage, but the client still acks with the one it
received: :meth:`ReceiptRenewer.current` translates it. Renewal stops when the message
is acked or nacked, when the client's session ends (the message then comes back after
its last invisible time), or after ``max_renew_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from polymq.gateway.processor import Caller, Processor
from polymq.storage.errors import StorageError
from polymq.storage.lifecycle import TaskSet

__all__ = ["ReceiptRenewer"]

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Held:
    caller: Caller
    group: str
    receipt: str  # the latest receipt storage issued
    renew_at_ms: int
    give_up_ms: int


class ReceiptRenewer:
    def __init__(self, processor: Processor, *, invisible_ms: int, max_renew_ms: int) -> None:
        self._processor = processor
        self._invisible_ms = invisible_ms
        self._max_renew_ms = max_renew_ms
        # (client id, group, receipt the client holds) -> renewal state
        self._held: dict[tuple[str, str, str], _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, caller: Caller, group: str, receipt: str) -> None:
        """Keep renewing ``receipt`` (just handed out) until released."""
        if caller.client_id is None:
            return
        now = self._processor.clock.now_ms()
        self._held[(caller.client_id, group, receipt)] = _Held(
            caller=caller,
            group=group,
            receipt=receipt,
            renew_at_ms=now + self._invisible_ms * 2 // 3,
            give_up_ms=now + self._max_renew_ms,
        )

    def current(self, caller: Caller, group: str, receipt: str) -> str:
        """The receipt storage knows now for the one the client holds."""
        if caller.client_id is None:
            return receipt
        held = self._held.get((caller.client_id, group, receipt))
        return held.receipt if held is not None else receipt

    def release(self, caller: Caller, group: str, receipt: str) -> None:
        if caller.client_id is not None:
            self._held.pop((caller.client_id, group, receipt), None)

    def forget_client(self, client_id: str) -> None:
        for key in [k for k in self._held if k[0] == client_id]:
            del self._held[key]

    def start(self, tasks: TaskSet) -> None:
        """Renew as one of the listener's ``tasks``: its stop ends the renewals with
        the rest of its background work."""
        tasks.spawn(self._run(), name="rocketmq-receipt-renewal")

    def clear(self) -> None:
        """Forget every receipt held (the listener stopped: nothing renews them)."""
        self._held.clear()

    async def _run(self) -> None:
        period = max(self._invisible_ms // 6, 50) / 1000
        while True:
            await asyncio.sleep(period)
            try:
                await self.renew_due()
            except Exception:
                log.exception("rocketmq: receipt renewal pass failed")

    async def renew_due(self) -> None:
        now = self._processor.clock.now_ms()
        for key, held in list(self._held.items()):
            if held.renew_at_ms > now:
                continue
            if now >= held.give_up_ms:
                del self._held[key]
                continue
            try:
                stored = await self._processor.change_invisibility(
                    held.caller, held.group, held.receipt, self._invisible_ms
                )
            except StorageError:  # acked elsewhere, expired, or handed out again
                with contextlib.suppress(KeyError):
                    del self._held[key]
                continue
            if stored.receipt is not None and key in self._held:
                held.receipt = stored.receipt
                held.renew_at_ms = now + self._invisible_ms * 2 // 3
