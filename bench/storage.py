#!/usr/bin/env python3
"""Benchmark of the embedded storage engine, beside the disk's own limit.

Run ``python bench/storage.py`` (about 3 minutes on 2 cores), ``--quick`` for a smoke
run of a few seconds, ``--only SECTION`` for one section, ``--json`` for machine
output. Every measurement stops at a message count or a time limit, whichever comes
first, and reports what it did. See bench/README.md for what the columns mean.

Sections: ``disk`` (plain write+fdatasync loop), ``append``, ``read``, ``pop`` and
``memory`` (each measurement in a fresh subprocess of this file, so RSS only holds
what it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# This file is named like the ``storage`` package: drop its own directory from the
# import path so ``import storage`` finds the package, not this script.
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._stats import percentile  # noqa: E402
from polymq.gateway.progress import Progress  # noqa: E402
from polymq.storage.engine import Durability, Engine, EngineConfig  # noqa: E402
from polymq.storage.model import (  # noqa: E402
    DEFAULT_NAMESPACE,
    AppendRequest,
    BatchEntry,
    Message,
    QueueRef,
    TopicConfig,
)

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the test extra
    psutil = None

try:
    from uvloop import EventLoopPolicy as UvloopPolicy
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    UvloopPolicy = None

T = TypeVar("T")
Call = Callable[[], Awaitable[int]]  # one timed call; returns messages it handled

NS = DEFAULT_NAMESPACE
SIZES = (100, 4096)
BATCH = 100  # requests per append call / messages per BatchEntry in "batch" rows
PRODUCERS = 64  # concurrent producers for the one-request-per-call rows
BATCH_PRODUCERS = 8  # concurrent producers for the concurrent batch rows
CONSUMERS = 8  # concurrent consumers (one queue each) for the concurrent pop rows
POP_MAX = 32
READ_MAX = 100
SECTIONS = ("disk", "append", "read", "pop", "memory")
MIB = 1 << 20


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Bounds of one run. Every loop stops at its count or its time limit."""

    seconds: float  # per engine measurement
    disk_seconds: float  # per disk-baseline measurement
    max_msgs: int  # messages per measurement
    max_bytes: int  # body bytes per measurement (caps the 4 KiB rows)
    read_prefill: int  # messages per queue read from (capped by max_bytes)
    pop_prefill: int  # messages in the first pop queue (the others get 1/4 of it)
    memory_messages: int  # messages stored for the RSS measurement
    memory_queues: int  # empty queues for the RSS measurement
    setup_seconds: float  # time limit of each memory subprocess's fill
    child_timeout: float  # hard limit of each memory subprocess


FULL = Limits(
    seconds=2.0,
    disk_seconds=1.0,
    max_msgs=300_000,
    max_bytes=256 * MIB,
    read_prefill=100_000,
    pop_prefill=60_000,
    memory_messages=1_000_000,
    memory_queues=100_000,
    setup_seconds=60.0,
    child_timeout=150.0,
)
QUICK = Limits(
    seconds=0.15,
    disk_seconds=0.05,
    max_msgs=3_000,
    max_bytes=8 * MIB,
    read_prefill=1_000,
    pop_prefill=800,
    memory_messages=5_000,
    memory_queues=1_000,
    setup_seconds=10.0,
    child_timeout=60.0,
)


# ---------------------------------------------------------------------------- results


@dataclass(slots=True, kw_only=True)
class Row:
    """One throughput measurement: ``calls`` timed calls that handled ``msgs``
    messages of ``body`` bytes in ``seconds`` using ``cpu_seconds`` of process CPU."""

    section: str
    case: str
    body: int
    durability: str
    concurrency: int
    calls: int
    msgs: int
    seconds: float
    cpu_seconds: float
    p50_ms: float
    p99_ms: float
    stop: str  # what ended it: "count", "time" or "data" (nothing left to read)
    log_bytes: int | None = None  # commit-log bytes written (append rows)

    @property
    def key(self) -> str:
        return f"{self.section}/{self.case}/{self.body}/{self.durability}/c{self.concurrency}"

    @property
    def msgs_per_s(self) -> float:
        return self.msgs / self.seconds if self.seconds > 0 else 0.0

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.msgs_per_s * self.body / 1e6

    @property
    def per_call(self) -> float:
        return self.msgs / self.calls if self.calls else 0.0

    @property
    def cpu_us_per_msg(self) -> float:
        return self.cpu_seconds / self.msgs * 1e6 if self.msgs else 0.0

    @property
    def cpu_percent(self) -> float:
        return self.cpu_seconds / self.seconds * 100 if self.seconds > 0 else 0.0

    @property
    def log_bytes_per_msg(self) -> float | None:
        return None if self.log_bytes is None or not self.msgs else self.log_bytes / self.msgs

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "section": self.section,
            "case": self.case,
            "body_bytes": self.body,
            "durability": self.durability,
            "concurrency": self.concurrency,
            "calls": self.calls,
            "msgs": self.msgs,
            "seconds": round(self.seconds, 6),
            "msgs_per_s": round(self.msgs_per_s, 1),
            "calls_per_s": round(self.calls_per_s, 1),
            "mb_per_s": round(self.mb_per_s, 3),
            "msgs_per_call": round(self.per_call, 2),
            "p50_ms": round(self.p50_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "cpu_seconds": round(self.cpu_seconds, 4),
            "cpu_us_per_msg": round(self.cpu_us_per_msg, 2),
            "cpu_percent": round(self.cpu_percent, 1),
            "log_bytes_per_msg": (
                None if self.log_bytes_per_msg is None else round(self.log_bytes_per_msg, 1)
            ),
            "stop": self.stop,
        }


@dataclass(slots=True, kw_only=True)
class MemoryRow:
    """RSS of a fresh process before and after one phase (a fill or a reopen)."""

    case: str
    phase: str
    items: int
    seconds: float
    rss_before: int
    rss_after: int
    note: str = ""
    error: str | None = None  # the phase failed; the figures are zeros

    @property
    def key(self) -> str:
        return f"memory/{self.case}/{self.phase}"

    @property
    def delta(self) -> int:
        return self.rss_after - self.rss_before

    @property
    def bytes_per_item(self) -> float:
        return self.delta / self.items if self.items else 0.0

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "case": self.case,
            "phase": self.phase,
            "items": self.items,
            "seconds": round(self.seconds, 4),
            "items_per_s": round(self.items_per_s, 1),
            "rss_before_mb": round(self.rss_before / MIB, 2),
            "rss_after_mb": round(self.rss_after / MIB, 2),
            "rss_delta_mb": round(self.delta / MIB, 2),
            "bytes_per_item": round(self.bytes_per_item, 1),
            "note": self.note,
            "error": self.error,
        }


@dataclass(slots=True)
class Report:
    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": [r.to_json() for r in self.rows],
            "memory": [m.to_json() for m in self.memory],
        }


# ---------------------------------------------------------------------------- helpers


def cpu_time() -> float:
    """User + system CPU seconds of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_bytes() -> int:
    gc.collect()
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    with open("/proc/self/statm", encoding="ascii") as handle:  # pragma: no cover
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# The run's status line (polymq.gateway.progress: steps done, the one running, elapsed)
# on a terminal, nothing otherwise; set by main, so child processes draw none.
_bar: list[Progress] = []


def progress(text: str) -> None:
    if _bar:
        _bar[0].step(text)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def body_of(size: int) -> bytes:
    return os.urandom(size)


def engine_config(data_dir: Path, durability: Durability, **extra: Any) -> EngineConfig:
    return EngineConfig(data_dir=data_dir, durability=durability, **extra)


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is importable."""
    if UvloopPolicy is not None:
        asyncio.set_event_loop_policy(UvloopPolicy())
    return asyncio.run(coro)


def loop_name() -> str:
    return "uvloop" if UvloopPolicy is not None else "asyncio"


def choose_tmp_root(requested: str | None) -> tuple[Path, str]:
    """A directory on the repository's file system: /tmp if it is one, else the repo."""
    if requested:
        return Path(requested), "given with --tmp-dir"
    system_tmp = Path(tempfile.gettempdir())
    try:
        same = system_tmp.stat().st_dev == ROOT.stat().st_dev
    except OSError:
        same = False
    if same:
        return system_tmp, f"{system_tmp} (same file system as the repository)"
    return ROOT, f"{ROOT} ({system_tmp} is on another file system than the repository)"


@dataclass(slots=True)
class Measured:
    calls: int
    msgs: int
    seconds: float
    cpu_seconds: float
    latencies: list[float]
    stop: str


async def measure(workers: Sequence[Call], *, max_msgs: int, seconds: float) -> Measured:
    """Run each worker's call in a loop, concurrently, until ``max_msgs`` messages are
    handled in all, ``seconds`` pass, or a call handles none (no data left)."""
    latencies: list[float] = []
    done = 0
    calls = 0
    ran_dry = False
    clock = time.perf_counter
    deadline = clock() + seconds

    async def work(call: Call) -> None:
        nonlocal done, calls, ran_dry
        while done < max_msgs and clock() < deadline and not ran_dry:
            began = clock()
            count = await call()
            if count == 0:
                ran_dry = True
                return
            latencies.append(clock() - began)
            calls += 1
            done += count

    cpu_before = cpu_time()
    start = clock()
    deadline = start + seconds
    await asyncio.gather(*(work(call) for call in workers))
    elapsed = clock() - start
    cpu_used = cpu_time() - cpu_before
    stop = "data" if ran_dry else "count" if done >= max_msgs else "time"
    latencies.sort()
    return Measured(calls, done, elapsed, cpu_used, latencies, stop)


def make_row(
    section: str,
    case: str,
    body: int,
    durability: str,
    concurrency: int,
    measured: Measured,
    log_bytes: int | None = None,
) -> Row:
    row = Row(
        section=section,
        case=case,
        body=body,
        durability=durability,
        concurrency=concurrency,
        calls=measured.calls,
        msgs=measured.msgs,
        seconds=measured.seconds,
        cpu_seconds=measured.cpu_seconds,
        p50_ms=percentile(measured.latencies, 0.50) * 1000,
        p99_ms=percentile(measured.latencies, 0.99) * 1000,
        stop=measured.stop,
        log_bytes=log_bytes,
    )
    progress(
        f"  {row.key:<44} {row.msgs_per_s:>12,.0f} msg/s {row.mb_per_s:>8.1f} MB/s "
        f"p50 {row.p50_ms:.3f} ms p99 {row.p99_ms:.3f} ms"
    )
    return row


def msg_cap(limits: Limits, body: int) -> int:
    return max(1, min(limits.max_msgs, limits.max_bytes // body))


def settle() -> None:
    """Flush dirty pages (and the discards of deleted files) so that one measurement's
    writeback does not slow the next one down."""
    os.sync()


@contextlib.contextmanager
def scratch(parent: Path, name: str) -> Iterator[Path]:
    """A fresh directory, removed afterwards; the disk settled before and after."""
    path = parent / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    settle()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        settle()


# ---------------------------------------------------------------------------- disk


def disk_loop(
    path: Path, data: bytes, *, sync: bool, max_writes: int, seconds: float
) -> tuple[int, float, float, list[float], str]:
    """Sequential ``os.write`` (+ ``os.fdatasync``) of ``data`` into a new file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    latencies: list[float] = []
    clock = time.perf_counter
    writes = 0
    try:
        cpu_before = cpu_time()
        start = clock()
        deadline = start + seconds
        while writes < max_writes and clock() < deadline:
            began = clock()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fdatasync(fd)
            latencies.append(clock() - began)
            writes += 1
        elapsed = clock() - start
        cpu_used = cpu_time() - cpu_before
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    latencies.sort()
    return writes, elapsed, cpu_used, latencies, "count" if writes >= max_writes else "time"


def run_disk(report: Report, limits: Limits, tmp: Path) -> None:
    progress("disk: plain write (+fdatasync) loop on the same file system")
    for sync in (True, False):
        case = "write+fdatasync" if sync else "write only"
        for per_write in (1, BATCH):
            for body in SIZES:
                data = body_of(body * per_write)
                cap = max(1, msg_cap(limits, body) // per_write)
                settle()
                writes, elapsed, cpu_used, latencies, stop = disk_loop(
                    tmp / "disk-bench.dat",
                    data,
                    sync=sync,
                    max_writes=cap,
                    seconds=limits.disk_seconds,
                )
                measured = Measured(writes, writes * per_write, elapsed, cpu_used, latencies, stop)
                name = f"{case} {per_write}x"
                report.rows.append(make_row("disk", name, body, "-", 1, measured))


# ---------------------------------------------------------------------------- append


@dataclass(frozen=True, slots=True)
class AppendCase:
    name: str
    per_call: int  # messages per append call
    entry: bool  # one BatchEntry of per_call messages instead of per_call requests
    concurrency: int


APPEND_CASES = (
    AppendCase("1 req", 1, False, 1),  # sequential: shows the fsync latency
    AppendCase("1 req", 1, False, PRODUCERS),  # group commit across producers
    AppendCase(f"{BATCH} req", BATCH, False, 1),
    AppendCase(f"{BATCH} req", BATCH, False, BATCH_PRODUCERS),
    AppendCase(f"entry x{BATCH}", BATCH, True, 1),
    AppendCase(f"entry x{BATCH}", BATCH, True, BATCH_PRODUCERS),
)


def append_requests(body: bytes, queue: QueueRef, case: AppendCase) -> list[AppendRequest]:
    message = Message(body=body)
    if case.entry:
        entry = BatchEntry(
            format="bench", raw=body * case.per_call, messages=(message,) * case.per_call
        )
        return [AppendRequest(entry=entry, queues=(queue,))]
    return [AppendRequest(entry=message, queues=(queue,))] * case.per_call


async def append_row(
    data_dir: Path, body: int, durability: Durability, case: AppendCase, limits: Limits
) -> Row:
    queue = QueueRef(NS, "bench", 0)
    requests = append_requests(body_of(body), queue, case)
    async with Engine(engine_config(data_dir, durability)) as engine:
        await engine.create_topic(NS, "bench")
        log_before = dir_bytes(data_dir / "commitlog")

        async def call() -> int:
            await engine.append(requests)
            return case.per_call

        measured = await measure(
            [call] * case.concurrency, max_msgs=msg_cap(limits, body), seconds=limits.seconds
        )
        log_bytes = dir_bytes(data_dir / "commitlog") - log_before
    return make_row(
        "append", case.name, body, durability.value, case.concurrency, measured, log_bytes
    )


async def run_append(report: Report, limits: Limits, tmp: Path) -> None:
    progress("append: a fresh engine per row, one queue")
    for body in SIZES:
        for case in APPEND_CASES:
            for durability in (Durability.SYNC, Durability.ASYNC):
                with scratch(tmp, "append") as data_dir:
                    report.rows.append(await append_row(data_dir, body, durability, case, limits))


# ---------------------------------------------------------------------------- prefill


async def prefill(engine: Engine, queue: QueueRef, body: bytes, count: int, entries: bool) -> None:
    """Append ``count`` messages: in calls of ``BATCH`` requests, or as BatchEntries
    of ``BATCH`` messages (the last one shorter)."""
    message = Message(body=body)
    written = 0
    while written < count:
        n = min(BATCH, count - written)
        if entries:
            entry = BatchEntry(format="bench", raw=body * n, messages=(message,) * n)
            await engine.append([AppendRequest(entry=entry, queues=(queue,))])
        else:
            await engine.append([AppendRequest(entry=message, queues=(queue,))] * n)
        written += n


# ---------------------------------------------------------------------------- read


def reader(engine: Engine, queue: QueueRef, end: int, batches: bool) -> Call:
    """Reads from offset 0 on, starting over at the end (so reads never run dry)."""
    offset = 0

    async def read_call() -> int:
        nonlocal offset
        result = await engine.read(queue, offset, max_messages=READ_MAX)
        count = len(result.messages)
        offset = result.next_offset if result.next_offset < end else 0
        return count

    async def read_batches_call() -> int:
        nonlocal offset
        found = await engine.read_batches(queue, offset)
        if not found:
            return 0
        last = found[-1]
        following = last.base_offset + last.count
        count = following - offset
        offset = following if following < end else 0
        return count

    return read_batches_call if batches else read_call


async def run_read(report: Report, limits: Limits, tmp: Path) -> None:
    progress(
        f"read: one reader, read(max_messages={READ_MAX}) and read_batches(max_bytes=1 MiB), "
        f"over single messages and over BatchEntry({BATCH}) entries (page cache warm)"
    )
    for body in SIZES:
        count = max(BATCH, min(limits.read_prefill, limits.max_bytes // body))
        data = body_of(body)
        with scratch(tmp, "read") as data_dir:
            async with Engine(engine_config(data_dir, Durability.ASYNC)) as engine:
                await engine.create_topic(NS, "msgs")
                await engine.create_topic(NS, "entries")
                singles = QueueRef(NS, "msgs", 0)
                entries = QueueRef(NS, "entries", 0)
                await prefill(engine, singles, data, count, entries=False)
                await prefill(engine, entries, data, count, entries=True)
                for batches in (False, True):
                    for queue, shape in ((singles, "msgs"), (entries, "entries")):
                        measured = await measure(
                            [reader(engine, queue, count, batches)],
                            max_msgs=msg_cap(limits, body),
                            seconds=limits.seconds,
                        )
                        name = f"{'read_batches' if batches else 'read'} {shape}"
                        report.rows.append(make_row("read", name, body, "-", 1, measured))


# ---------------------------------------------------------------------------- pop


def consumer(engine: Engine, group: str, queue: QueueRef, *, ack_many: bool) -> Call:
    """Pop then ack: each message on its own, or all of a pop with one ``ack_many``."""

    async def call() -> int:
        popped = await engine.pop(NS, group, [queue], max_messages=POP_MAX, invisible_ms=600_000)
        receipts = [message.receipt for message in popped if message.receipt is not None]
        if ack_many:
            await engine.ack_many(NS, group, receipts)
        else:
            for receipt in receipts:
                await engine.ack(NS, group, receipt)
        return len(popped)

    return call


def woken_consumer(engine: Engine, group: str, queue: QueueRef, body: bytes) -> Call:
    """One message at a time, as at everyday rates: a pop waits at the empty end, an
    append wakes it, then the ack. What a long poll's wake-up costs shows here."""
    request = [AppendRequest(entry=Message(body=body), queues=(queue,), durable=False)]

    async def call() -> int:
        popping = asyncio.ensure_future(
            engine.pop(NS, group, [queue], max_messages=1, wait_ms=60_000, durable=False)
        )
        await asyncio.sleep(0)  # the pop is waiting before the append comes
        await engine.append(request)
        [message] = await popping
        assert message.receipt is not None
        await engine.ack(NS, group, message.receipt, durable=False)
        return 1

    return call


async def run_pop(report: Report, limits: Limits, tmp: Path) -> None:
    progress(
        f"pop: pop(max_messages={POP_MAX}) then ack each awaited one by one, or ack_many; "
        f"1 consumer, and {CONSUMERS} consumers on {CONSUMERS} queues"
    )
    for body in SIZES:
        first = max(POP_MAX, min(limits.pop_prefill, limits.max_bytes // body))
        others = max(POP_MAX, first // 4)
        data = body_of(body)
        with scratch(tmp, "pop") as data_dir:
            queues = [QueueRef(NS, "work", i) for i in range(CONSUMERS)]
            async with Engine(engine_config(data_dir, Durability.ASYNC)) as engine:
                await engine.create_topic(NS, "work", TopicConfig(queue_count=CONSUMERS))
                for queue in queues:
                    n = first if queue.queue_id == 0 else others
                    await prefill(engine, queue, data, n, entries=False)
            for durability in (Durability.SYNC, Durability.ASYNC):
                async with Engine(engine_config(data_dir, durability)) as engine:
                    for concurrency, ack_many in itertools.product((1, CONSUMERS), (False, True)):
                        how = "ack_many" if ack_many else "ack"
                        group = f"g{concurrency}-{durability.value}-{how}"
                        workers = [
                            consumer(engine, group, q, ack_many=ack_many)
                            for q in queues[:concurrency]
                        ]
                        measured = await measure(
                            workers, max_msgs=msg_cap(limits, body), seconds=limits.seconds
                        )
                        row = make_row(
                            "pop",
                            f"pop{POP_MAX}+{how}",
                            body,
                            durability.value,
                            concurrency,
                            measured,
                        )
                        report.rows.append(row)
        with scratch(tmp, "wake") as data_dir:
            async with Engine(engine_config(data_dir, Durability.ASYNC)) as engine:
                await engine.create_topic(NS, "wake")
                queue = QueueRef(NS, "wake", 0)
                measured = await measure(
                    [woken_consumer(engine, "woken", queue, data)],
                    max_msgs=msg_cap(limits, body),
                    seconds=limits.seconds,
                )
                report.rows.append(make_row("pop", "woken pop1+ack", body, "-", 1, measured))


# ---------------------------------------------------------------------------- memory


def child(kind: str, data_dir: Path, limits_name: str, **options: Any) -> dict[str, Any]:
    """Run one memory measurement in a fresh interpreter; returns its JSON result."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--child-dir",
        str(data_dir),
        "--child-options",
        json.dumps({"limits": limits_name, **options}),
    ]
    limits = QUICK if limits_name == "quick" else FULL
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=limits.child_timeout,
            check=False,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} subprocess killed after {limits.child_timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])
        return {"error": f"{kind} subprocess failed ({done.returncode}): {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def child_fill(data_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Store ``count`` 100 B messages in one queue; copy the directory before closing
    (no checkpoint taken: the copy reopens by replaying the whole log)."""
    limits = QUICK if options["limits"] == "quick" else FULL
    count = int(options["count"])
    body = body_of(100)
    config = engine_config(
        data_dir,
        Durability.ASYNC,
        checkpoint_interval_ms=10**9,
        checkpoint_log_bytes=1 << 50,
    )
    queue = QueueRef(NS, "mem", 0)
    requests = [AppendRequest(entry=Message(body=body), queues=(queue,))] * BATCH
    async with Engine(config) as engine:
        await engine.create_topic(NS, "mem")
        before = rss_bytes()
        written = 0
        start = time.perf_counter()
        deadline = start + limits.setup_seconds
        while written < count and time.perf_counter() < deadline:
            n = min(BATCH, count - written)
            await engine.append(requests[:n])
            written += n
        elapsed = time.perf_counter() - start
        after = rss_bytes()
        shutil.copytree(data_dir, Path(options["replay_copy"]))
    return {"items": written, "seconds": elapsed, "rss_before": before, "rss_after": after}


async def child_queues(data_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Create ``topics`` topics of ``queues`` queues each, 64 creations at a time."""
    limits = QUICK if options["limits"] == "quick" else FULL
    topics, queues = int(options["topics"]), int(options["queues"])
    config = engine_config(data_dir, Durability.ASYNC)
    async with Engine(config) as engine:
        before = rss_bytes()
        created = 0
        start = time.perf_counter()
        deadline = start + limits.setup_seconds
        topic_config = TopicConfig(queue_count=queues)

        async def creator() -> None:
            nonlocal created
            while created < topics and time.perf_counter() < deadline:
                name = f"t{created}"
                created += 1
                await engine.create_topic(NS, name, topic_config)

        await asyncio.gather(*(creator() for _ in range(PRODUCERS)))
        elapsed = time.perf_counter() - start
        after = rss_bytes()
    return {
        "items": created * queues,
        "seconds": elapsed,
        "rss_before": before,
        "rss_after": after,
    }


async def child_reopen(data_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Open an engine over an existing directory: time, RSS, and what it holds."""
    before = rss_bytes()
    engine = Engine(engine_config(data_dir, Durability.ASYNC))
    start = time.perf_counter()
    try:
        await engine.start()
    except Exception as exc:  # reported in the table, not raised: other rows still run
        return {"error": f"Engine.start() raised {type(exc).__name__}: {exc}"}
    elapsed = time.perf_counter() - start
    try:
        after = rss_bytes()
        topics = await engine.list_topics(NS)
        messages = sum(q.latest - q.earliest for t in topics for q in t.queues)
        queues = sum(len(t.queues) for t in topics)
    finally:
        await engine.close()
    items = messages if options.get("what") == "messages" else queues
    return {"items": items, "seconds": elapsed, "rss_before": before, "rss_after": after}


CHILDREN: dict[str, Callable[[Path, dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]] = {
    "fill": child_fill,
    "queues": child_queues,
    "reopen": child_reopen,
}


def memory_row(case: str, phase: str, result: dict[str, Any], note: str = "") -> MemoryRow:
    error = result.get("error")
    row = MemoryRow(
        case=case,
        phase=phase,
        items=int(result.get("items", 0)),
        seconds=float(result.get("seconds", 0.0)),
        rss_before=int(result.get("rss_before", 0)),
        rss_after=int(result.get("rss_after", 0)),
        note=note,
        error=None if error is None else str(error),
    )
    if row.error is not None:
        progress(f"  {row.key:<44} FAILED: {row.error}")
        return row
    progress(
        f"  {row.key:<44} {row.items:>10,} items {row.seconds:8.2f} s "
        f"RSS {row.rss_before / MIB:.1f} -> {row.rss_after / MIB:.1f} MiB"
    )
    return row


def count_label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def run_memory(report: Report, limits: Limits, tmp: Path, limits_name: str) -> None:
    progress("memory: each phase in a fresh subprocess")
    count = limits.memory_messages
    case = f"{count_label(count)} msgs 100 B"
    with scratch(tmp, "memory") as base:
        data_dir, replay_dir = base / "msgs", base / "msgs-replay"
        result = child("fill", data_dir, limits_name, count=count, replay_copy=str(replay_dir))
        report.memory.append(
            memory_row(case, "write", result, "async durability, 100 requests per append")
        )
        result = child("reopen", data_dir, limits_name, what="messages")
        report.memory.append(memory_row(case, "reopen (checkpoint)", result, "index files"))
        result = child("reopen", replay_dir, limits_name, what="messages")
        report.memory.append(memory_row(case, "reopen (log replay)", result, "no checkpoint"))
    queues = limits.memory_queues
    per_topic = 100
    for topics, each in ((queues, 1), (queues // per_topic, per_topic)):
        case = f"{count_label(queues)} queues: {count_label(topics)} topics x {each}"
        with scratch(tmp, "memory") as base:
            data_dir = base / "queues"
            result = child("queues", data_dir, limits_name, topics=topics, queues=each)
            report.memory.append(memory_row(case, "create", result, "empty queues"))
            result = child("reopen", data_dir, limits_name, what="queues")
            report.memory.append(memory_row(case, "reopen (checkpoint)", result))


# ---------------------------------------------------------------------------- output


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def fmt_small(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int]) -> str:
    """Aligned plain text; columns numbered in ``left`` left-aligned, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def throughput_table(rows: Sequence[Row]) -> str:
    headers = (
        "section",
        "case",
        "body",
        "dur",
        "conc",
        "msg/call",
        "msgs",
        "secs",
        "msgs/s",
        "calls/s",
        "MB/s",
        "p50 ms",
        "p99 ms",
        "CPU us/msg",
        "CPU %",
        "log B/msg",
        "stop",
    )
    cells = [
        (
            r.section,
            r.case,
            f"{r.body} B" if r.body < 1024 else f"{r.body // 1024} KiB",
            r.durability,
            str(r.concurrency),
            fmt_small(r.per_call),
            f"{r.msgs:,}",
            f"{r.seconds:.2f}",
            fmt_rate(r.msgs_per_s),
            fmt_rate(r.calls_per_s),
            fmt_small(r.mb_per_s),
            fmt_small(r.p50_ms),
            fmt_small(r.p99_ms),
            fmt_small(r.cpu_us_per_msg),
            f"{r.cpu_percent:.0f}",
            "-" if r.log_bytes_per_msg is None else f"{r.log_bytes_per_msg:.0f}",
            r.stop,
        )
        for r in rows
    ]
    return table(headers, cells, left=(0, 1, 3, 16))


def memory_table(rows: Sequence[MemoryRow]) -> str:
    headers = (
        "memory",
        "phase",
        "items",
        "secs",
        "items/s",
        "RSS before MiB",
        "RSS after MiB",
        "delta MiB",
        "B/item",
        "note",
    )
    failed = ("-",) * 7
    cells = [
        (m.case, m.phase, *failed, f"FAILED: {m.error}")
        if m.error is not None
        else (
            m.case,
            m.phase,
            f"{m.items:,}",
            f"{m.seconds:.2f}",
            fmt_rate(m.items_per_s),
            f"{m.rss_before / MIB:.1f}",
            f"{m.rss_after / MIB:.1f}",
            f"{m.delta / MIB:.1f}",
            f"{m.bytes_per_item:.0f}",
            m.note,
        )
        for m in rows
    ]
    return table(headers, cells, left=(0, 1, 9))


def render(report: Report) -> str:
    meta = report.meta
    lines = [
        f"polymq storage benchmark ({meta['mode']}): python {meta['python']}, "
        f"{meta['loop']}, {meta['cpus']} CPUs",
        f"temp dir: {meta['tmp_dir']}",
        f"limits: {meta['seconds_per_measurement']} s or {meta['max_msgs_per_measurement']:,} "
        f"msgs ({meta['max_mib_per_measurement']} MiB of bodies) per measurement",
        "",
    ]
    if report.rows:
        lines += [throughput_table(report.rows), ""]
    if report.memory:
        lines += [memory_table(report.memory), ""]
    lines.append(f"run time: {meta['run_seconds']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    parser.add_argument(
        "--only",
        metavar="NAME",
        help=f"run one section (or a comma-separated list) of: {', '.join(SECTIONS)}",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--seconds", type=float, help="time limit per engine measurement (default 2, quick 0.15)"
    )
    parser.add_argument(
        "--tmp-dir", help="where to make the temporary directory (default: /tmp if same disk)"
    )
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    parser.add_argument("--child-options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in SECTIONS]
        if unknown or not wanted:
            parser.error(f"--only takes {', '.join(SECTIONS)}; got {args.only!r}")
        args.sections = wanted
    else:
        args.sections = list(SECTIONS)
    return args


async def run_async_sections(
    report: Report, sections: Sequence[str], limits: Limits, tmp: Path
) -> None:
    if "append" in sections:
        await run_append(report, limits, tmp)
    if "read" in sections:
        await run_read(report, limits, tmp)
    if "pop" in sections:
        await run_pop(report, limits, tmp)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_loop(
            CHILDREN[args.child](Path(args.child_dir), json.loads(args.child_options))
        )
        print(json.dumps(result))
        return 0
    started = time.perf_counter()
    limits_name = "quick" if args.quick else "full"
    limits = QUICK if args.quick else FULL
    if args.seconds is not None:
        limits = Limits(
            **{
                **{name: getattr(limits, name) for name in Limits.__dataclass_fields__},
                "seconds": args.seconds,
            }
        )
    tmp_root, where = choose_tmp_root(args.tmp_dir)
    tmp = Path(tempfile.mkdtemp(prefix="polymq-bench-", dir=tmp_root))
    with Progress(None, "bench storage") as bar:
        _bar[:] = [bar]
        try:
            return _run(args, limits, limits_name, tmp, where, started)
        finally:
            _bar.clear()


def _run(
    args: argparse.Namespace,
    limits: Limits,
    limits_name: str,
    tmp: Path,
    where: str,
    started: float,
) -> int:
    progress(f"temp dir: {tmp} in {where}")
    report = Report(
        meta={
            "mode": limits_name,
            "python": sys.version.split()[0],
            "loop": loop_name(),
            "cpus": os.cpu_count(),
            "tmp_dir": f"{tmp} in {where}",
            "tmp_path": str(tmp),
            "sections": list(args.sections),
            "seconds_per_measurement": limits.seconds,
            "disk_seconds_per_measurement": limits.disk_seconds,
            "max_msgs_per_measurement": limits.max_msgs,
            "max_mib_per_measurement": limits.max_bytes // MIB,
        }
    )
    try:
        if "disk" in args.sections:
            run_disk(report, limits, tmp)
        run_loop(run_async_sections(report, args.sections, limits, tmp))
        if "memory" in args.sections:
            run_memory(report, limits, tmp, limits_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        progress(f"removed {tmp}")
    report.meta["run_seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
