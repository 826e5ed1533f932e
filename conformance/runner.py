"""Runs conformance cases against a target, each bounded in time and isolated.

Many of the clients are blocking (pika, paho, kafka-python, the MNS SDK), so every case
runs in a thread of its own; an async case gets its own event loop there. A case that
outlives its timeout is reported and abandoned (its daemon thread may linger until its
client gives up): one hung client must not stall the table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import inspect
import itertools
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from polymq.conformance.results import CaseResult, Outcome

__all__ = [
    "DEFAULT_PORTS",
    "Case",
    "CaseFn",
    "NotApplicable",
    "NotOffered",
    "Registry",
    "Target",
    "run_cases",
    "wait_until",
]

DEFAULT_PORTS: Mapping[str, int] = {
    "kafka": 9092,
    "amqp": 5672,
    "mqtt": 1883,
    "mqtt-ws": 8083,
    "rocketmq": 8081,
    "mns": 8080,
}

_T = TypeVar("_T")
CaseFn = Callable[["Target"], None] | Callable[["Target"], Coroutine[Any, Any, None]]


class NotApplicable(Exception):
    """The case cannot apply to this target as configured (a credentials check against a
    target that accepts anyone): reported as skip-unsupported with the reason."""


class NotOffered(Exception):
    """The target answered in a way that shows it does not offer the feature (granted
    QoS 1 for a QoS 2 subscription, say). A failure like any other unless the feature is
    expected missing, but its message says what the target lacks."""


@dataclasses.dataclass
class Target:
    """Where the cases go and with what credentials. ``user``/``password`` serve Kafka
    SASL/PLAIN, AMQP PLAIN and MQTT; ``access_key``/``secret_key`` sign RocketMQ and MNS
    requests. ``auth_enforced`` says wrong credentials must be refused (a target in an
    open mode accepts anything, so those cases are not applicable there)."""

    host: str = "127.0.0.1"
    ports: dict[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_PORTS))
    user: str | None = None
    password: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    vhost: str = "/"
    auth_enforced: bool = False
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:8])
    _counter: Iterator[int] = dataclasses.field(default_factory=itertools.count, repr=False)

    def port(self, protocol: str) -> int:
        return self.ports[protocol]

    def name(self, prefix: str) -> str:
        """A name no other case or run uses (queues, topics, groups, client ids)."""
        return f"cf{self.run_id}-{prefix}-{next(self._counter)}"


@dataclasses.dataclass(frozen=True)
class Case:
    """One feature of one protocol, exercised by one client. ``fn`` raises
    AssertionError (or NotOffered) when the target misbehaves; any other exception is an
    error (the case could not judge)."""

    protocol: str
    feature: str
    client: str
    fn: CaseFn
    timeout_s: float = 20.0
    doc: str = ""

    @property
    def key(self) -> str:
        return f"{self.protocol}.{self.feature}"


class Registry:
    """The cases of one protocol module, declared with the ``case`` decorator."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.cases: list[Case] = []

    def case(
        self, feature: str, client: str, timeout_s: float = 20.0
    ) -> Callable[[Callable[[Target], Any]], Callable[[Target], Any]]:
        def register(fn: Callable[[Target], Any]) -> Callable[[Target], Any]:
            doc = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            self.cases.append(Case(self.protocol, feature, client, fn, timeout_s, doc))
            return fn

        return register


def wait_until(
    check: Callable[[], _T | None], timeout: float = 10.0, what: str = "condition"
) -> _T:
    """Poll ``check`` until it returns something truthy; AssertionError naming ``what``
    when the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.02)


def port_open(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _matches_missing(case: Case, expect_missing: frozenset[str]) -> bool:
    """``expect_missing`` holds ``protocol.feature`` or bare feature names, with shell
    wildcards (``mqtt.v5-*``)."""
    return any(
        fnmatch.fnmatchcase(case.key, pattern) or fnmatch.fnmatchcase(case.feature, pattern)
        for pattern in expect_missing
    )


def _invoke(case: Case, target: Target) -> None:
    result = case.fn(target)
    if inspect.iscoroutine(result):
        asyncio.run(asyncio.wait_for(result, case.timeout_s))


def _where(error: BaseException) -> str:
    """The innermost line of a case module the error passed through, to find it fast."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "conformance" in f.filename]
    return f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""


def _judge(case: Case, error: BaseException | None, missing: bool) -> tuple[Outcome, str]:
    if isinstance(error, NotApplicable):
        return Outcome.UNSUPPORTED, f"not applicable: {error}"
    if error is None:
        return Outcome.PASS, "passed although listed as missing" if missing else ""
    if isinstance(error, (AssertionError, NotOffered)):
        outcome, detail = Outcome.FAIL, str(error) or type(error).__name__
    elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        outcome, detail = Outcome.ERROR, f"timed out: {error}".rstrip(": ")
    else:
        outcome, detail = Outcome.ERROR, f"{type(error).__name__}: {error}{_where(error)}"
    if missing:
        return Outcome.UNSUPPORTED, f"known missing on this target ({detail})"
    return outcome, detail


def run_one(case: Case, target: Target, expect_missing: frozenset[str] = frozenset()) -> CaseResult:
    """Run ``case`` in its own thread, at most ``case.timeout_s`` (+ a grace second)."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            _invoke(case, target)
        except BaseException as e:  # the case's failure is the result, whatever it is
            errors.append(e)

    started = time.monotonic()
    thread = threading.Thread(target=body, name=f"case {case.key}", daemon=True)
    thread.start()
    thread.join(case.timeout_s + 1.0)
    seconds = time.monotonic() - started
    missing = _matches_missing(case, expect_missing)
    if thread.is_alive():
        error: BaseException | None = TimeoutError(f"no answer within {case.timeout_s:g}s")
    else:
        error = errors[0] if errors else None
    outcome, detail = _judge(case, error, missing)
    return CaseResult(case.protocol, case.feature, case.client, outcome, seconds, detail)


def run_cases(
    cases: Sequence[Case],
    target: Target,
    *,
    jobs: int = 4,
    expect_missing: Iterable[str] = (),
    on_result: Callable[[CaseResult], None] | None = None,
    on_start: Callable[[Case], None] | None = None,
) -> list[CaseResult]:
    """Run ``cases``, ``jobs`` at a time; results in the order of ``cases``. A protocol
    whose port does not accept connections gets an error row per case at once.
    ``on_start`` and ``on_result`` are called from the worker threads (a progress line)."""
    missing = frozenset(expect_missing)
    closed = {
        protocol
        for protocol in {c.protocol for c in cases}
        if not port_open(target.host, target.port(protocol))
    }
    results: list[CaseResult | None] = [None] * len(cases)
    slots = threading.Semaphore(max(1, jobs))
    lock = threading.Lock()
    workers: list[threading.Thread] = []

    def record(index: int, result: CaseResult) -> None:
        with lock:
            results[index] = result
            if on_result is not None:
                on_result(result)

    def work(index: int, case: Case) -> None:
        try:
            if on_start is not None:
                on_start(case)
            record(index, run_one(case, target, missing))
        finally:
            slots.release()

    for index, case in enumerate(cases):
        if case.protocol in closed:
            outcome, detail = _judge(
                case,
                ConnectionRefusedError(f"{target.host}:{target.port(case.protocol)} is closed"),
                _matches_missing(case, missing),
            )
            record(
                index, CaseResult(case.protocol, case.feature, case.client, outcome, 0.0, detail)
            )
            continue
        slots.acquire()
        worker = threading.Thread(target=work, args=(index, case), daemon=True)
        workers.append(worker)
        worker.start()
    for worker in workers:
        worker.join()
    return [r for r in results if r is not None]
