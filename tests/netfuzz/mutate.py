"""Mutations of recorded sessions that hit framing, and how to deliver them.

Pure: a ``random.Random`` and the seeds in, a :class:`Plan` out (the bytes to write,
in which writes, after which pauses), so a run is reproduced from its ``--seed`` and
a finding is saved as exactly what was sent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.netfuzz.framing import Frame, frames
from tests.netfuzz.seeds import Session

__all__ = ["MAX_PLAN_BYTES", "Plan", "plan"]

# No mutated stream grows past this: the fuzzer attacks parsers, not bandwidth.
MAX_PLAN_BYTES = 1 << 20
# A slow send drips one byte per this many seconds.
SLOW_GAP_S = 0.3

_INTERESTING_32 = (0xFFFFFFFF, 0xFFFFFFFE, 0x7FFFFFFF, 0x80000000, 0x7FFFFFFE, 0x00FFFFFF, 0)
_INTERESTING_16 = (0xFFFF, 0xFFFE, 0x7FFF, 0x8000, 0)
_INTERESTING_8 = (0xFF, 0x7F, 0x80, 0x00, 0xFE)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send on one connection: ``writes`` (pause before, bytes), in order.
    ``slow``: the peer never finishes its first frame, and the server must close it
    (its handshake deadline) rather than wait forever."""

    protocol: str
    seed: str  # the session it came from
    mutations: tuple[str, ...]
    writes: tuple[tuple[float, bytes], ...]
    slow: bool = False

    @property
    def data(self) -> bytes:
        return b"".join(data for _, data in self.writes)

    @property
    def description(self) -> str:
        how = "slow" if self.slow else f"{len(self.writes)} writes"
        return f"{self.seed}: {', '.join(self.mutations) or 'as recorded'} ({how})"


Mutation = Callable[[random.Random, bytearray, list[Frame], str, Sequence[Session]], str]


def _pick_frame(rng: random.Random, found: list[Frame], with_length: bool = False) -> Frame | None:
    pool = [f for f in found if f.has_length] if with_length else found
    return rng.choice(pool) if pool else None


def _bitflip(rng: random.Random, data: bytearray, *_: object) -> str:
    count = rng.choice((1, 1, 2, 4, 8))
    for _flip in range(count):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    return f"bitflip x{count}"


def _truncate(rng: random.Random, data: bytearray, *_: object) -> str:
    cut = rng.randrange(1, len(data))
    del data[cut:]
    return f"truncate at {cut}"


def _insert(rng: random.Random, data: bytearray, *_: object) -> str:
    at = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        extra = bytes([rng.choice(_INTERESTING_8)]) * rng.randint(1, 64)
    data[at:at] = extra
    return f"insert {len(extra)} at {at}"


def _delete(rng: random.Random, data: bytearray, *_: object) -> str:
    at = rng.randrange(len(data))
    size = rng.randint(1, 32)
    del data[at : at + size]
    return f"delete {size} at {at}"


def _inflate_length(rng: random.Random, data: bytearray, found: list[Frame], *_: object) -> str:
    """A frame's own length field set to an extreme, or off by a little."""
    frame = _pick_frame(rng, found, with_length=True)
    if frame is None:
        return _interesting_int(rng, data, found)
    at, size = frame.length_at, frame.length_size
    old = bytes(data[at : at + size])
    if frame.kind == "varint":
        new = rng.choice(
            (b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff\x7f", b"\x80\x80\x80\x00", b"\xff\xff\x7f")
        )
    elif frame.kind == "ws7":
        new = bytes([(data[at] & 0x80) | rng.choice((126, 127, 125, 0))])
    elif frame.kind == "text":
        new = rng.choice((b"99999999999", b"2147483648", b"-1", b"0", b"1e9", b"4294967295"))
    else:
        value = int.from_bytes(old, "big")
        top = (1 << (8 * size)) - 1
        value = rng.choice((top, top - 1, top >> 1, (top >> 1) + 1, value + 1, max(0, value - 1)))
        new = value.to_bytes(size, "big")
    data[at : at + size] = new
    return f"length@{at} {old.hex()}->{new.hex()}"


def _interesting_int(rng: random.Random, data: bytearray, found: list[Frame], *_: object) -> str:
    """An extreme integer over bytes inside a frame: array counts and string lengths
    (the Kafka key array claiming 2^32-2 entries was one)."""
    frame = _pick_frame(rng, found)
    lo, hi = (frame.start, frame.end) if frame is not None else (0, len(data))
    width = rng.choice((4, 4, 2, 1))
    at = rng.randrange(lo, max(lo + 1, hi - width + 1))
    pool = {4: _INTERESTING_32, 2: _INTERESTING_16, 1: _INTERESTING_8}[width]
    new = rng.choice(pool).to_bytes(width, "big")
    data[at : at + width] = new
    return f"int{8 * width}@{at}={new.hex()}"


def _huge_varint(rng: random.Random, data: bytearray, found: list[Frame], *_: object) -> str:
    """An unsigned varint claiming billions over bytes inside a frame: Kafka's compact
    array and string lengths, protobuf lengths in gRPC, MQTT property lengths."""
    frame = _pick_frame(rng, found)
    lo, hi = (frame.start, frame.end) if frame is not None else (0, len(data))
    at = rng.randrange(lo, max(lo + 1, hi))
    new = rng.choice((b"\xff\xff\xff\xff\x0f", b"\xfe\xff\xff\xff\x0f", b"\xff\xff\xff\x7f"))
    data[at : at + rng.choice((1, 2, len(new)))] = new
    return f"varint@{at}={new.hex()}"


def _repeat_frame(rng: random.Random, data: bytearray, found: list[Frame], *_: object) -> str:
    frame = _pick_frame(rng, found)
    if frame is None:
        return _insert(rng, data)
    chunk = bytes(data[frame.start : frame.end])
    times = rng.choice((2, 3, 10, 100, 1000))
    times = max(1, min(times, MAX_PLAN_BYTES // 2 // max(1, len(chunk))))
    data[frame.end : frame.end] = chunk * times
    return f"repeat frame@{frame.start} x{times}"


def _drop_frame(rng: random.Random, data: bytearray, found: list[Frame], *_: object) -> str:
    frame = _pick_frame(rng, found)
    if frame is None:
        return _delete(rng, data)
    del data[frame.start : frame.end]
    return f"drop frame@{frame.start}"


def _splice(
    rng: random.Random,
    data: bytearray,
    found: list[Frame],
    protocol: str,
    sessions: Sequence[Session],
) -> str:
    """A frame of another session put in place of one of this one (frames out of
    their order: a publish before the login, a second handshake)."""
    other = rng.choice(sessions)
    theirs = frames(protocol, other.data)
    frame, donor = _pick_frame(rng, found), _pick_frame(rng, theirs)
    if frame is None or donor is None:
        return _bitflip(rng, data)
    data[frame.start : frame.end] = other.data[donor.start : donor.end]
    return f"splice {other.name}@{donor.start} over @{frame.start}"


MUTATIONS: tuple[tuple[Mutation, int], ...] = (
    (_inflate_length, 5),
    (_interesting_int, 5),
    (_huge_varint, 3),
    (_bitflip, 3),
    (_repeat_frame, 2),
    (_truncate, 2),
    (_insert, 2),
    (_delete, 1),
    (_drop_frame, 1),
    (_splice, 1),
)


def _writes(rng: random.Random, data: bytes, chunks: Sequence[bytes]) -> tuple[str, list[bytes]]:
    """How the stream is cut into writes: as recorded, all at once, one byte per
    write (the first 4 KiB), or at random points."""
    how = rng.choices(("recorded", "whole", "bytewise", "random"), (4, 2, 1, 2))[0]
    if how == "whole" or not data:
        return how, [data]
    if how == "bytewise":
        head = data[:4096]
        rest = [data[4096:]] if len(data) > 4096 else []
        return how, [head[i : i + 1] for i in range(len(head))] + rest
    if how == "random":
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 16))))
        return how, [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    out, pos = [], 0  # the recorded boundaries, over the mutated length
    for chunk in chunks:
        out.append(data[pos : pos + len(chunk)])
        pos += len(chunk)
    out.append(data[pos:])
    return how, [w for w in out if w]


def plan(rng: random.Random, protocol: str, sessions: Sequence[Session]) -> Plan:
    """One mutated session of ``protocol``: 1-3 stacked mutations of a random seed,
    cut into writes some way; one in twenty is a slow send instead."""
    session = rng.choice(sessions)
    data = bytearray(session.data)
    if rng.random() < 0.05:  # the first frame, dripped, never finished
        found = frames(protocol, bytes(data))
        first = bytes(data[: found[0].end if found else 64])[:-1] or bytes(data[:1])
        writes = tuple((SLOW_GAP_S, first[i : i + 1]) for i in range(len(first)))
        return Plan(protocol, session.name, ("slow first frame",), writes, slow=True)
    mutations: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not data:
            break
        found = frames(protocol, bytes(data))
        mutation = rng.choices([m for m, _ in MUTATIONS], [w for _, w in MUTATIONS])[0]
        mutations.append(mutation(rng, data, found, protocol, sessions))
    del data[MAX_PLAN_BYTES:]
    how, cut = _writes(rng, bytes(data), session.chunks)
    mutations.append(how)
    return Plan(protocol, session.name, tuple(mutations), tuple((0.0, w) for w in cut))


def as_recorded(session: Session) -> Plan:
    """A seed or regression file sent as it is, in its chunks."""
    return Plan(session.protocol, session.name, (), tuple((0.0, c) for c in session.chunks))
