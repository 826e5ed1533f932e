"""Pop-mode state of one consumer group on one queue.

Everything below ``done_below`` is consumed; offsets at or above ``next_new`` were
never handed out; between them each offset is either in ``inflight`` (handed out,
not acked: visible again once its deadline passes) or in ``acked``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

__all__ = ["Inflight", "PopCursor"]


@dataclass(slots=True)
class Inflight:
    deadline_ms: int
    attempt: int  # deliveries so far
    seq: int  # unique per hand-out; a receipt names it
    first_pop_ms: int


class PopCursor:
    __slots__ = ("_timeouts", "acked", "done_below", "inflight", "next_new", "version")

    def __init__(self, start: int) -> None:
        self.done_below = start
        self.next_new = start
        self.inflight: dict[int, Inflight] = {}
        self.acked: set[int] = set()
        self._timeouts: list[tuple[int, int, int]] = []  # (deadline, offset, seq), lazy
        self.version = 0  # bumped by every change: checkpoints re-serialize changed cursors

    def hand_out(self, offset: int, state: Inflight) -> None:
        self.version += 1
        self.inflight[offset] = state
        if offset >= self.next_new:
            self.next_new = offset + 1
        heapq.heappush(self._timeouts, (state.deadline_ms, offset, state.seq))

    def ack(self, offset: int) -> None:
        self.version += 1
        self.inflight.pop(offset, None)
        if offset < self.done_below or offset in self.acked:
            return
        if offset >= self.next_new:
            self.next_new = offset + 1
        self.acked.add(offset)
        while self.done_below in self.acked:
            self.acked.discard(self.done_below)
            self.done_below += 1

    def skip_to(self, offset: int) -> None:
        """Move past offsets that retention deleted."""
        if offset <= self.done_below:
            return
        self.version += 1
        self.done_below = offset
        self.next_new = max(self.next_new, offset)
        self.acked = {o for o in self.acked if o >= offset}
        self.inflight = {o: s for o, s in self.inflight.items() if o >= offset}
        while self.done_below in self.acked:
            self.acked.discard(self.done_below)
            self.done_below += 1

    def expired(self, now_ms: int) -> list[int]:
        """In-flight offsets whose deadline has passed, oldest deadline first."""
        result: list[int] = []
        timeouts = self._timeouts
        while timeouts and timeouts[0][0] <= now_ms:
            _deadline, offset, seq = timeouts[0]
            state = self.inflight.get(offset)
            if state is None or state.seq != seq:
                heapq.heappop(timeouts)  # acked or handed out again since
                continue
            result.append(offset)
            heapq.heappop(timeouts)
        # Put them back: they stay in-flight until handed out again.
        for offset in result:
            state = self.inflight[offset]
            heapq.heappush(timeouts, (state.deadline_ms, offset, state.seq))
        return sorted(result)

    def next_deadline(self) -> int | None:
        timeouts = self._timeouts
        while timeouts:
            deadline, offset, seq = timeouts[0]
            state = self.inflight.get(offset)
            if state is not None and state.seq == seq:
                return deadline
            heapq.heappop(timeouts)
        return None

    def is_consumed(self, offset: int) -> bool:
        return offset < self.done_below or offset in self.acked

    def to_json(self) -> list[Any]:
        return [
            self.done_below,
            self.next_new,
            [
                [o, s.deadline_ms, s.attempt, s.seq, s.first_pop_ms]
                for o, s in self.inflight.items()
            ],
            sorted(self.acked),
        ]

    @classmethod
    def from_json(cls, data: list[Any]) -> PopCursor:
        cursor = cls(int(data[0]))
        cursor.next_new = int(data[1])
        for offset, deadline, attempt, seq, first in data[2]:
            cursor.hand_out(
                int(offset), Inflight(int(deadline), int(attempt), int(seq), int(first))
            )
        cursor.next_new = int(data[1])
        cursor.acked = {int(o) for o in data[3]}
        return cursor
