"""One shard's log as a JetStream stream: fenced appends, replay, and purges.

Every message carries a contiguous run of the engine's framed records and the log
position of its first byte (header ``Polymq-Position``). One group-commit batch is one
message; a batch larger than a message may be is split into chunks, the later ones
marked ``Polymq-Continued`` (they start inside a record). Every publish names the
stream sequence it expects to follow (``Nats-Expected-Last-Sequence``): a writer that
lost its lease, whose successor has appended since, is refused by JetStream itself
and cannot write. A retry of the same chunk (a timeout while the stream leader
changed) carries the same ``Nats-Msg-Id``, so JetStream answers it as the duplicate
it is instead of storing it twice.

Replay hands back the messages in order; a message whose position is behind the bytes
replayed so far cuts them back to it: the chunks of a batch whose writer died before
publishing all of them were never acknowledged, and the next writer starts at the last
whole record, over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from polymq.storage.errors import ShardMoved, StorageFailed
from polymq.storage.replicated.stats import ReplicationStats

__all__ = ["ShardStream", "StreamMessage", "stream_name"]

log = logging.getLogger(__name__)

POSITION = "Polymq-Position"
CONTINUED = "Polymq-Continued"
EPOCH = "Polymq-Epoch"
_WRONG_LAST_SEQUENCE = 10071
DEFAULT_CHUNK_BYTES = 1000 * 1024  # under the server's default max_payload of 1 MiB
_REPLAY_BATCH = 64
_REPLAY_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class StreamMessage:
    seq: int
    position: int
    continued: bool
    data: bytes


def stream_name(shard: str) -> str:
    return "POLYMQ_" + shard.upper().replace("-", "_").replace(".", "_")


class ShardStream:
    """The stream of ``shard``, created if missing with ``replicas`` copies."""

    def __init__(
        self,
        js: JetStreamContext,
        shard: str,
        *,
        replicas: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        publish_timeout_s: float = 30.0,
        stats: ReplicationStats | None = None,
    ) -> None:
        self._js = js
        self._stats = stats  # publish-acknowledgement times, for /metrics
        self.shard = shard
        self.name = stream_name(shard)
        self.subject = f"polymq.log.{shard}"
        self.replicas = replicas
        self.chunk_bytes = chunk_bytes
        self.publish_timeout_s = publish_timeout_s
        self.last_seq = 0  # the sequence the next publish expects to follow
        self.epoch = 0

    async def ensure(self) -> None:
        """Create the stream, or check the existing one has the replicas asked for."""
        try:
            info = await self._js.stream_info(self.name)
        except NotFoundError:
            config = StreamConfig(
                name=self.name,
                subjects=[self.subject],
                num_replicas=self.replicas,
                storage=StorageType.FILE,
                duplicate_window=120.0,
                allow_direct=True,
            )
            try:
                await self._js.add_stream(config)
            except APIError as exc:
                raise StorageFailed(
                    f"JetStream refused the stream {self.name} with {self.replicas} "
                    f"replicas: {exc.description} (replicas 3 needs a NATS cluster of at "
                    "least 3 servers with JetStream)"
                ) from exc
            return
        have = info.config.num_replicas or 1
        if have != self.replicas:
            raise StorageFailed(
                f"stream {self.name} has {have} replicas, the configuration asks for "
                f"{self.replicas}"
            )

    async def last_sequence(self) -> int:
        info = await self._js.stream_info(self.name)
        return info.state.last_seq

    async def replay(self) -> AsyncIterator[StreamMessage]:
        """Every message from the first one kept, up to the last one now, each once
        and in sequence order. Messages are pulled in batches (a push subscription
        drops messages when its reader falls behind), and the sequence is checked:
        only the start is ever purged, so the sequences kept follow each other
        without a gap, and a gap seen is a message this reader missed: it pulls
        again from there."""
        info = await self._js.stream_info(self.name)
        first, last = info.state.first_seq, info.state.last_seq
        self.last_seq = last
        if last == 0 or first > last:
            return
        expected = first
        attempts = 0
        while expected <= last:
            attempts += 1
            if attempts > _REPLAY_ATTEMPTS:
                raise StorageFailed(
                    f"shard {self.shard}: cannot read stream message {expected} of "
                    f"{self.name} after {_REPLAY_ATTEMPTS} attempts"
                )
            sub = await self._js.pull_subscribe(
                self.subject,
                stream=self.name,
                config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=expected,
                    ack_policy=AckPolicy.NONE,
                    inactive_threshold=30.0,
                ),
            )
            try:
                while expected <= last:
                    try:
                        batch = await sub.fetch(min(_REPLAY_BATCH, last - expected + 1), timeout=10)
                    except TimeoutError:
                        break  # pull again, from a new consumer
                    gap = False
                    for msg in batch:
                        seq = msg.metadata.sequence.stream
                        if seq < expected:
                            continue
                        if seq > expected:
                            gap = True
                            break
                        headers = msg.headers or {}
                        yield StreamMessage(
                            seq=seq,
                            position=int(headers.get(POSITION, "0")),
                            continued=CONTINUED in headers,
                            data=msg.data,
                        )
                        expected += 1
                        attempts = 0
                    if gap:
                        log.warning(
                            "shard %s: replay missed message %d; pulling again",
                            self.shard,
                            expected,
                        )
                        break
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def publish(self, position: int, data: bytes) -> list[tuple[int, int, bool]]:
        """Append ``data`` (whole records) at ``position``; returns ``(position, seq,
        continued)`` of each message. Raises ``ShardMoved`` if another writer
        appended since this one's last publish."""
        sent = []
        view = memoryview(data)
        offset = 0
        while True:
            chunk = view[offset : offset + self.chunk_bytes]
            continued = offset > 0
            seq = await self._publish_one(position + offset, bytes(chunk), continued)
            sent.append((position + offset, seq, continued))
            offset += len(chunk)
            if offset >= len(data):
                return sent

    async def _publish_one(self, position: int, data: bytes, continued: bool) -> int:
        headers = {
            "Nats-Expected-Last-Sequence": str(self.last_seq),
            "Nats-Msg-Id": f"{self.shard}:{self.epoch}:{position}:{len(data)}",
            POSITION: str(position),
        }
        if continued:
            headers[CONTINUED] = "1"
        if not data:
            headers[EPOCH] = str(self.epoch)
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        deadline = loop.time() + self.publish_timeout_s
        delay = 0.05
        retry = False
        while True:
            try:
                ack = await self._js.publish(self.subject, data, timeout=2.0, headers=headers)
            except APIError as exc:
                if exc.err_code == _WRONG_LAST_SEQUENCE:
                    # JetStream checks the expected sequence before duplicates: a retry
                    # of a publish that did land finds it as the next message.
                    if retry and await self._landed(self.last_seq + 1, headers["Nats-Msg-Id"]):
                        self.last_seq += 1
                        return self.last_seq
                    raise ShardMoved(
                        f"shard {self.shard}: another writer appended to its log "
                        f"(expected to follow sequence {self.last_seq}): {exc.description}"
                    ) from exc
                error: Exception = exc
            except Exception as exc:  # a timeout, no responders while a leader is elected
                error = exc
            else:
                self.last_seq = ack.seq
                if self._stats is not None:
                    self._stats.publish.observe(self.shard, time.perf_counter() - began)
                return ack.seq
            retry = True
            if loop.time() >= deadline:
                raise StorageFailed(f"shard {self.shard}: JetStream publish failed: {error!r}")
            log.warning("shard %s: publish failed, retrying: %r", self.shard, error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _landed(self, seq: int, msg_id: str) -> bool:
        try:
            msg = await self._js.get_msg(self.name, seq)
        except NotFoundError:
            return False
        return (msg.headers or {}).get("Nats-Msg-Id") == msg_id

    async def seal(self, position: int, epoch: int) -> None:
        """Claim the stream for ``epoch``: an empty message at ``position`` after the
        last sequence replayed. A deposed writer's later appends are refused."""
        self.epoch = epoch
        await self._publish_one(position, b"", False)

    async def purge_below(self, seq: int) -> None:
        """Delete every message before ``seq``."""
        if seq > 1:
            await self._js.purge_stream(self.name, seq=seq)

    async def delete(self) -> None:
        await self._js.delete_stream(self.name)
