"""A message popped soon after its append is handed out from memory (the engine keeps
just-appended plain messages beside its decoded batches, ``EngineCore.decoded``):
no read back from the log, no decoding. A message whose parts are not plain ``bytes``
(a ``memoryview`` over a buffer the protocol reuses) is read back from the log, so
what a consumer gets is what was stored. Real engine on a temporary directory."""

from __future__ import annotations

import pytest

from polymq.storage.engine import Engine
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.model import AppendRequest, Message, QueueRef

NS = "default"


class LogReads:
    """Counts the commit log's reads of message records."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        read, read_many = CommitLog.read, CommitLog.read_many

        def counted_read(log: CommitLog, position: int, size: int) -> bytes:
            self.count += 1
            return read(log, position, size)

        def counted_read_many(
            log: CommitLog, records: list[tuple[int, int]], **kw: int
        ) -> list[memoryview]:
            self.count += len(records)
            return read_many(log, records, **kw)

        monkeypatch.setattr(CommitLog, "read", counted_read)
        monkeypatch.setattr(CommitLog, "read_many", counted_read_many)


async def _append_and_pop(storage: Engine, message: Message) -> Message:
    await storage.create_topic(NS, "t")
    ref = QueueRef(NS, "t", 0)
    await storage.append([AppendRequest(entry=message, queues=(ref,))])
    [popped] = await storage.pop(NS, "g", [ref], wait_ms=0)
    return popped.message


async def test_a_just_appended_message_is_handed_out_without_a_read(
    storage: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = LogReads(monkeypatch)
    sent = Message(body=b"hello", key=b"k", properties=(("a", b"1"),))
    got = await _append_and_pop(storage, sent)
    assert got == sent
    assert reads.count == 0


async def test_a_message_over_a_reused_buffer_is_read_back(
    storage: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = LogReads(monkeypatch)
    buffer = bytearray(b"stored")
    sent = Message(body=memoryview(buffer))  # type: ignore[arg-type]  # what a codec may pass
    await storage.create_topic(NS, "t")
    ref = QueueRef(NS, "t", 0)
    await storage.append([AppendRequest(entry=sent, queues=(ref,))])
    buffer[:] = b"reused"  # the protocol's next frame
    [popped] = await storage.pop(NS, "g", [ref], wait_ms=0)
    assert popped.message.body == b"stored" and type(popped.message.body) is bytes
    assert reads.count == 1
