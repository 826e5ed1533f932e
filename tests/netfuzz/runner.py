"""One fuzz run against one form of the server: regressions first, then mutated
sessions on every listener for a time budget (or a count), while a probe of each
protocol keeps doing round trips and the processes' memory is sampled.

A crash (a child exited) pauses the fuzzing: the exited child is started again on its
ports and every input that was in flight is replayed alone to find the one that kills
it, so a finding names its protocol and its exact bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import re
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.netfuzz import mutate
from tests.netfuzz.probes import Probe
from tests.netfuzz.replay import Outcome, replay
from tests.netfuzz.seeds import PROTOCOLS, Session, dump
from tests.netfuzz.servers import Exit, FuzzServer

__all__ = ["FormReport", "Settings", "fuzz_form"]

MIB = 1 << 20
WARM_UP_TIMEOUT_S = 90.0
RECOVER_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 20.0
# Findings that mean the server failed its promise (the report lists the rest too).
FATAL = ("crash", "hang", "probe-failure", "leak", "kept-open", "lingering")
# The fuzzer's connections come from this loopback address, the probes' from the
# default one: the connections the server still lists after the fuzzing are then told
# apart by their peer address, not by a count the probes' own reconnections change.
FUZZ_SOURCE = "127.0.0.2"
# The gateway's log lines shown with a finding (the last ones, or those naming it).
LOG_LINES = 12


@dataclass(frozen=True, slots=True)
class Settings:
    seconds: float = 60.0
    count: int | None = None  # mutated connections in all, then stop
    seed: int = 1
    protocols: tuple[str, ...] = PROTOCOLS
    concurrency: int = 2  # connections in flight per fuzzed protocol
    stall_s: float = 3.0
    max_rss_growth_bytes: int = 128 * MIB
    regressions: Mapping[str, Sequence[Session]] = field(default_factory=dict)
    findings_dir: Path | None = None
    handshake_timeout_s: float = 3.0  # what the server was given (servers.DEFAULT_SETTINGS)


@dataclass(slots=True)
class Finding:
    kind: str
    protocol: str
    detail: str
    inputs: list[mutate.Plan] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)


@dataclass(slots=True)
class ProtocolStats:
    replayed: int = 0
    mutations: int = 0
    closed_by_server: int = 0
    refused: int = 0
    slow: int = 0
    bytes_sent: int = 0
    seeds: set[str] = field(default_factory=set)


@dataclass(slots=True)
class ProbeSummary:
    round_trips: int
    worst_s: float
    failures: int
    excused_failures: int


@dataclass(slots=True)
class RegressionResult:
    protocol: str
    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class FormReport:
    form: str
    seconds: float = 0.0
    stats: dict[str, ProtocolStats] = field(default_factory=dict)
    probes: dict[str, ProbeSummary] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    regressions: list[RegressionResult] = field(default_factory=list)
    rss_baseline: dict[str, int] = field(default_factory=dict)
    rss_peak: dict[str, int] = field(default_factory=dict)
    rss_end: dict[str, int] = field(default_factory=dict)
    tracebacks: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    restarts: int = 0

    def fatal(self, protocol: str | None = None) -> list[Finding]:
        return [
            f
            for f in self.findings
            if f.kind in FATAL and (protocol is None or f.protocol == protocol)
        ]

    def growth(self) -> dict[str, int]:
        return {
            name: self.rss_end[name] - self.rss_baseline[name]
            for name in self.rss_end
            if name in self.rss_baseline
        }


class _Run:
    def __init__(
        self,
        server: FuzzServer,
        seeds: Mapping[str, Sequence[Session]],
        settings: Settings,
        report: FormReport,
    ) -> None:
        self.server = server
        self.seeds = seeds
        self.settings = settings
        self.report = report
        self.probes = {
            p: Probe(p, (lambda p=p: server.address(p)))  # type: ignore[misc]
            for p in PROTOCOLS
        }
        self.up = asyncio.Event()
        self.inflight: dict[int, mutate.Plan] = {}
        self._ids = 0
        self.sent = 0
        self.deadline = 0.0
        self._flagged_stalls: set[tuple[str, float]] = set()
        self._seen_failures = dict.fromkeys(PROTOCOLS, 0)
        self._saved = 0
        # (from, to) of each crash and its recovery: probe failures in them are the
        # crash's consequence, reported with it, not findings of their own.
        self._down: list[tuple[float, float | None]] = []
        self._failure_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.source: str | None = None  # where the fuzzer's connections come from
        # Our end of every connection the fuzzer opened ("host:port") -> what it sent.
        self.peers: dict[str, mutate.Plan] = {}

    # -- the phases ----------------------------------------------------------------

    async def run(self) -> None:
        for probe in self.probes.values():
            probe.start()
        try:
            await self._warm_up()
            self.source = _fuzz_source(self.server.address(PROTOCOLS[0])[0])
            self.report.rss_baseline = self.server.rss()
            self.report.rss_peak = dict(self.report.rss_baseline)
            baseline_connections = await self._connections()
            await self._regressions()
            self.up.set()
            monitor = asyncio.create_task(self._monitor())
            try:
                started = time.monotonic()
                self.deadline = started + self.settings.seconds
                lanes = [
                    self._lane(protocol, i)
                    for protocol in self.settings.protocols
                    if self.seeds.get(protocol)
                    for i in range(self.settings.concurrency)
                ]
                await asyncio.gather(*lanes)
                self.report.seconds = time.monotonic() - started
                await self._settle(baseline_connections)
                self.report.rss_end = self.server.rss()
                await self._final_round_trips()
            finally:
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor
            self._check_memory()
        finally:
            for probe in self.probes.values():
                await asyncio.to_thread(probe.stop)
            for protocol, probe in self.probes.items():
                self.report.probes[protocol] = ProbeSummary(
                    probe.round_trips,
                    probe.worst_s,
                    sum(not (f.excused or self._was_down(f.at)) for f in probe.failures),
                    sum(f.excused or self._was_down(f.at) for f in probe.failures),
                )

    async def _warm_up(self) -> None:
        for protocol, probe in self.probes.items():
            if not await asyncio.to_thread(probe.wait_round_trips, 1, WARM_UP_TIMEOUT_S):
                errors = [f.error for f in probe.failures[-3:]]
                raise RuntimeError(f"the {protocol} probe never completed a round trip: {errors}")
        for protocol, probe in self.probes.items():
            probe.reset_worst()
            self._seen_failures[protocol] = len(probe.failures)

    async def _regressions(self) -> None:
        """Every saved input, alone, as recorded: the process must live on and every
        protocol must still answer after it."""
        for protocol in self.settings.protocols:
            for session in self.settings.regressions.get(protocol, ()):
                plan = mutate.as_recorded(session)
                await self._replay(plan, max_s=5.0)
                if await self.server.wait_exit(1.0):
                    exits = self.server.new_exits()
                    await self._restart(exits)
                    result = RegressionResult(protocol, session.name, False, _exits(exits))
                elif silent := [p for p, ok in (await self._answers()).items() if not ok]:
                    result = RegressionResult(
                        protocol, session.name, False, f"no round trip of {silent}"
                    )
                    await self._bounce()  # the next input gets a server that serves
                else:
                    result = RegressionResult(protocol, session.name, True, "served on")
                self.report.regressions.append(result)

    def _done(self) -> bool:
        count = self.settings.count
        return time.monotonic() >= self.deadline or (count is not None and self.sent >= count)

    async def _lane(self, protocol: str, index: int) -> None:
        rng = random.Random(f"{self.settings.seed}-{protocol}-{index}")
        stats = self.report.stats.setdefault(protocol, ProtocolStats())
        sessions = self.seeds[protocol]
        while not self._done():
            await self.up.wait()
            plan = mutate.plan(rng, protocol, sessions)
            self.sent += 1
            outcome = await self._send(protocol, plan)
            stats.replayed += 1
            stats.mutations += max(1, len(plan.mutations) - 1)
            stats.seeds.add(plan.seed)
            stats.bytes_sent += outcome.sent
            stats.closed_by_server += outcome.closed_by_server
            stats.refused += not outcome.connected
            stats.slow += plan.slow
            if outcome.slow_kept_open and self.up.is_set():
                self._find(
                    "kept-open",
                    protocol,
                    f"a connection that never finished its first frame was still open "
                    f"after {self.settings.handshake_timeout_s + 3:.0f} s",
                    [plan],
                )

    async def _send(self, protocol: str, plan: mutate.Plan) -> Outcome:
        self._ids += 1
        key = self._ids
        self.inflight[key] = plan
        try:
            return await self._replay(
                plan, slow_close_within_s=self.settings.handshake_timeout_s + 3
            )
        finally:
            del self.inflight[key]

    async def _replay(self, plan: mutate.Plan, **limits: float) -> Outcome:
        host, port = self.server.address(plan.protocol)

        def connected(local: str) -> None:
            self.peers[local] = plan

        return await replay(host, port, plan, source=self.source, on_connect=connected, **limits)

    # -- watching ------------------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            exits = self.server.new_exits()
            if exits:
                await self._crashed(exits)
            for name, rss in self.server.rss().items():
                self.report.rss_peak[name] = max(rss, self.report.rss_peak.get(name, 0))
            now = time.monotonic()
            for protocol, probe in self.probes.items():
                busy = probe.busy_since
                key = (protocol, busy or 0.0)
                if (
                    busy is not None
                    and not probe.excused
                    and now - busy > self.settings.stall_s
                    and key not in self._flagged_stalls
                ):
                    self._flagged_stalls.add(key)
                    self._find(
                        "hang",
                        protocol,
                        f"a {protocol} round trip was still running after "
                        f"{self.settings.stall_s:.0f} s",
                        list(self.inflight.values()),
                    )
                failures = probe.failures[self._seen_failures[protocol] :]
                self._seen_failures[protocol] += len(failures)
                for failure in failures:
                    text = re.sub(r"[0-9a-f]{10}|\d+", "#", failure.error)[:80]
                    failure_key = (protocol, text)
                    if failure.excused or self._was_down(failure.at):
                        continue
                    self._failure_counts[failure_key] += 1
                    if self._failure_counts[failure_key] == 1:  # the same failure again: counted
                        self._find(
                            "probe-failure",
                            protocol,
                            f"a {protocol} round trip failed: {failure.error}",
                            list(self.inflight.values()),
                        )
            await asyncio.sleep(0.2)

    async def _crashed(self, exits: list[Exit]) -> None:
        self.up.clear()
        candidates = list(self.inflight.values())
        log = [line for e in exits for line in e.log_tail]
        await self._restart(exits)
        culprits: list[mutate.Plan] = []
        for plan in candidates:  # each alone, on the restarted server
            await self._replay(plan, max_s=5.0)
            if await self.server.wait_exit(1.0):
                again = self.server.new_exits()
                culprits.append(plan)
                self._find("crash", plan.protocol, _exits(again), [plan], list(again[0].log_tail))
                await self._restart(again)
        if not culprits:
            protocols = sorted({p.protocol for p in candidates}) or ["?"]
            for protocol in protocols:
                self._find(
                    "crash",
                    protocol,
                    f"{_exits(exits)}; no input in flight kills it alone",
                    [p for p in candidates if p.protocol == protocol],
                    log,
                )
        await self._all_answer(RECOVER_TIMEOUT_S)
        self.up.set()

    async def _restart(self, exits: list[Exit]) -> None:
        # The exit came a moment before we saw it: so may the probes' failures.
        self._down.append((time.monotonic() - 1.0, None))
        for probe in self.probes.values():
            probe.excused = True
        for e in exits:
            self.report.restarts += 1
            await self.server.restart(e.name)
        await self._all_answer(RECOVER_TIMEOUT_S)
        for probe in self.probes.values():
            probe.excused = False
        self._down[-1] = (self._down[-1][0], time.monotonic())

    async def _bounce(self) -> None:
        self._down.append((time.monotonic() - 1.0, None))
        for probe in self.probes.values():
            probe.excused = True
        self.report.restarts += 1
        await self.server.bounce()
        await self._all_answer(RECOVER_TIMEOUT_S)
        for probe in self.probes.values():
            probe.excused = False
        self._down[-1] = (self._down[-1][0], time.monotonic())

    def _was_down(self, at: float) -> bool:
        return any(start <= at and (end is None or at <= end) for start, end in self._down)

    async def _answers(self, timeout: float = 30.0) -> dict[str, bool]:
        """Whether each probe completes a round trip begun after now."""
        targets = {p: probe.round_trips + 2 for p, probe in self.probes.items()}
        results = await asyncio.gather(
            *(
                asyncio.to_thread(probe.wait_round_trips, targets[p], timeout)
                for p, probe in self.probes.items()
            )
        )
        return dict(zip(self.probes, results, strict=True))

    async def _all_answer(self, timeout: float = 30.0) -> bool:
        return all((await self._answers(timeout)).values())

    async def _final_round_trips(self) -> None:
        for protocol, ok in (await self._answers()).items():
            if not ok:
                self._find("hang", protocol, f"no {protocol} round trip after the fuzzing", [])

    async def _listed(self) -> list[dict[str, Any]] | None:
        """The connections the server lists (its admin API), None if it did not say."""
        host, port = self.server.address("http")
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                answer = await client.get(f"http://{host}:{port}/admin/connections")
                listed = answer.json()["connections"]
                return [c for c in listed if isinstance(c, dict)]
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None

    async def _connections(self) -> collections.Counter[str] | None:
        """Connections the server lists, per protocol."""
        listed = await self._listed()
        if listed is None:
            return None
        return collections.Counter(str(c.get("protocol")) for c in listed)

    def _left_over(
        self, listed: list[dict[str, Any]], baseline: collections.Counter[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """Per protocol, the listed connections the fuzzing left: those from the
        fuzzer's own address; without one, any beyond the count before the fuzzing."""
        left: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        if self.source is not None:
            for c in listed:
                if _peer_host(str(c.get("peer"))) == self.source:
                    left[str(c.get("protocol"))].append(c)
            return dict(left)
        by_protocol: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for c in sorted(listed, key=lambda c: int(c.get("id") or 0)):
            by_protocol[str(c.get("protocol"))].append(c)
        for protocol, conns in by_protocol.items():
            extra = len(conns) - baseline.get(protocol, 0)
            if extra > 0:
                left[protocol] = conns[-extra:]  # the newest: opened during the fuzzing
        return dict(left)

    async def _settle(self, baseline: collections.Counter[str] | None) -> None:
        """Until the server lists none of the fuzzer's connections (all are closed on
        our side): memory is measured after that."""
        if baseline is None:
            return
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (listed := await self._listed()) is not None:
            left = self._left_over(listed, baseline)
            if not left:
                return
            if time.monotonic() > deadline:
                for protocol, conns in sorted(left.items()):
                    self._lingering(protocol, conns)
                return
            await asyncio.sleep(0.25)

    def _lingering(self, protocol: str, conns: list[dict[str, Any]]) -> None:
        peers = [str(c.get("peer")) for c in conns]
        now_ms = time.time() * 1000
        shown = ", ".join(
            f"{c.get('peer')} (open {(now_ms - float(c.get('opened_ms') or now_ms)) / 1000:.0f} s"
            f"{', client ' + str(c['client_id']) if c.get('client_id') else ''}"
            f"{', user ' + str(c['user']) if c.get('user') else ''})"
            for c in conns[:6]
        )
        whose = "the fuzzer's" if self.source is not None else "unattributed"
        self._find(
            "lingering",
            protocol,
            f"{len(conns)} {protocol} connection(s), {whose}, still listed "
            f"{SETTLE_TIMEOUT_S:.0f} s after the fuzzer closed all of its own: {shown}",
            [self.peers[peer] for peer in peers if peer in self.peers],
            self._log_naming(peers),
        )

    def _log_naming(self, needles: Sequence[str]) -> list[str]:
        """The gateway's log lines that name one of ``needles``, else its last ones."""
        lines = self.server.log_lines()
        named = [line for line in lines if any(n in line for n in needles)]
        return (named or lines)[-LOG_LINES:]

    def _check_memory(self) -> None:
        for name, grew in self.report.growth().items():
            if grew > self.settings.max_rss_growth_bytes:
                self._find(
                    "leak",
                    "?",
                    f"{name}: RSS grew {grew / MIB:.0f} MiB over the run "
                    f"(bound {self.settings.max_rss_growth_bytes / MIB:.0f} MiB)",
                    [],
                )

    def _find(
        self,
        kind: str,
        protocol: str,
        detail: str,
        inputs: list[mutate.Plan],
        log: list[str] | None = None,
    ) -> None:
        if log is None:  # what the server said last, so a CI log alone explains it
            log = self.server.log_lines()[-LOG_LINES:]
        finding = Finding(kind, protocol, detail, inputs, log)
        folder = self.settings.findings_dir
        if folder is not None:
            for plan in inputs:
                self._saved += 1
                path = folder / plan.protocol / f"{kind}-{self.report.form}-{self._saved}.hex"
                comment = f"{kind} ({self.report.form}): {detail}\ninput: {plan.description}"
                chunks = tuple(data for _, data in plan.writes)
                dump(Session(plan.protocol, path.stem, chunks, comment), path)
                finding.saved.append(path)
        self.report.findings.append(finding)


def _exits(exits: Sequence[Exit]) -> str:
    return ", ".join(f"{e.name} exited with code {e.code}" for e in exits)


def _fuzz_source(server_host: str) -> str | None:
    """:data:`FUZZ_SOURCE` when the server is on loopback and the address can be
    bound here (any 127/8 address on Linux); None otherwise."""
    if not server_host.startswith("127.") or server_host == FUZZ_SOURCE:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((FUZZ_SOURCE, 0))
    except OSError:
        return None
    return FUZZ_SOURCE


def _peer_host(peer: str) -> str:
    return peer.rpartition(":")[0].strip("[]")


_LOG_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")
_FILE_LINE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+)')


def tracebacks(lines: Sequence[str]) -> collections.Counter[tuple[str, str]]:
    """(protocol, "ExceptionType at file:line") of every traceback in a log, the
    protocol taken from the line that logged it."""
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    protocol, where, in_traceback, where_own = "?", "", False, False

    def close(last: str) -> None:
        exception = last.split(":", 1)[0].strip() or "?"
        found[(protocol, f"{exception} at {where}")] += 1

    last = ""
    for line in lines:
        match = _LOG_LINE.match(line)
        if match:
            if in_traceback:
                close(last)
                in_traceback = False
            protocol = _protocol_of(match["logger"], match["message"])
            continue
        if line.startswith("Traceback (most recent call last)"):
            in_traceback, where, where_own = True, "", False
            continue
        if in_traceback:
            file_match = _FILE_LINE.match(line)
            if file_match:
                path = file_match["file"]
                own = path.split("/")[-3:]
                here = f"{'/'.join(own)}:{file_match['line']}"
                if not where_own and _is_own(path):
                    where, where_own = here, True
                elif not where_own:
                    where = here
            elif line and not line[0].isspace():
                last = line
    if in_traceback:
        close(last)
    return found


# The project's own packages: a traceback is told by its first frame in them.
_OWN = ("protocols", "gateway", "storage", "nameserver", "navigation")


def _is_own(path: str) -> bool:
    """Not a library's file: uvicorn's own ``uvicorn/protocols/http/...`` once passed
    for the project's ``protocols/http`` and named the wrong file in the report."""
    if "/site-packages/" in path or "/dist-packages/" in path:
        return False
    return any(f"/{top}/" in path for top in _OWN)


# Libraries that log for a listener under their own names.
_LIBRARY_LOGGERS = {"uvicorn": "http", "websockets": "mqtt_ws", "grpc": "rocketmq"}


def _protocol_of(logger: str, message: str) -> str:
    parts = logger.removeprefix("polymq.").split(".")
    if parts[0] in _LIBRARY_LOGGERS:
        return _LIBRARY_LOGGERS[parts[0]]
    if len(parts) > 1 and parts[0] == "protocols":
        return {"mns": "http"}.get(parts[1], parts[1])
    head = message.split(":", 1)[0]
    return head if head in PROTOCOLS else logger


async def fuzz_form(
    form: str,
    seeds: Mapping[str, Sequence[Session]],
    settings: Settings,
    *,
    data_dir: Path | None = None,
    server_settings: Mapping[str, str] | None = None,
) -> FormReport:
    """Start ``form``, fuzz it as ``settings`` say, stop it; the report."""
    report = FormReport(form)
    with tempfile.TemporaryDirectory(prefix="netfuzz-") as scratch:
        server = FuzzServer(form, data_dir or Path(scratch), settings=server_settings)
        await server.start()
        try:
            await _Run(server, seeds, settings, report).run()
        finally:
            await server.stop()
            for name, lines in server.all_log_lines().items():
                report.tracebacks.update(tracebacks(lines))
                if settings.findings_dir is not None:  # the whole log, beside the inputs
                    settings.findings_dir.mkdir(parents=True, exist_ok=True)
                    (settings.findings_dir / f"{form}-{name}.log").write_text("\n".join(lines))
    return report
