"""The runner judges cases by how they end, bounds them in time and keeps going; the
CLI turns a run into tables and files. Fake cases against a real listening socket (the
runner only checks the port accepts), so these tests need no server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.conformance import cli
from polymq.conformance.results import CaseResult, Outcome
from polymq.conformance.runner import Case, NotApplicable, NotOffered, Target, run_cases, run_one


@pytest.fixture
def listening() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def _target(port: int) -> Target:
    return Target(ports={p: port for p in ("kafka", "amqp", "mqtt", "rocketmq", "mns")})


def _passes(t: Target) -> None:
    pass


def _asserts(t: Target) -> None:
    raise AssertionError("wrong answer")


def _raises(t: Target) -> None:
    raise ConnectionResetError("peer went away")


def _not_offered(t: Target) -> None:
    raise NotOffered("granted QoS 1")


def _not_applicable(t: Target) -> None:
    raise NotApplicable("open mode")


async def _async_passes(t: Target) -> None:
    import asyncio

    await asyncio.sleep(0)


hang = threading.Event()


def _hangs(t: Target) -> None:
    hang.wait(30)


async def _async_hangs(t: Target) -> None:
    import asyncio

    await asyncio.sleep(30)


def _case(fn: object, feature: str = "f", timeout_s: float = 5.0) -> Case:
    return Case("amqp", feature, "fake", fn, timeout_s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fn", "outcome", "detail"),
    [
        (_passes, Outcome.PASS, ""),
        (_async_passes, Outcome.PASS, ""),
        (_asserts, Outcome.FAIL, "wrong answer"),
        (_not_offered, Outcome.FAIL, "granted QoS 1"),
        (_raises, Outcome.ERROR, "ConnectionResetError: peer went away"),
        (_not_applicable, Outcome.UNSUPPORTED, "not applicable: open mode"),
    ],
)
def test_outcome_follows_how_the_case_ended(
    listening: int, fn: object, outcome: Outcome, detail: str
) -> None:
    result = run_one(_case(fn), _target(listening))
    assert result.outcome is outcome
    assert result.detail.startswith(detail)
    assert (result.protocol, result.feature, result.client) == ("amqp", "f", "fake")


def test_expected_missing_turns_failures_into_unsupported(listening: int) -> None:
    missing = frozenset({"amqp.f"})
    failed = run_one(_case(_not_offered), _target(listening), missing)
    assert failed.outcome is Outcome.UNSUPPORTED and "granted QoS 1" in failed.detail
    assert run_one(_case(_raises, "f"), _target(listening), frozenset({"f"})).ok
    passed = run_one(_case(_passes), _target(listening), missing)
    assert passed.outcome is Outcome.PASS and "although listed as missing" in passed.detail


@pytest.mark.parametrize("fn", [_hangs, _async_hangs])
def test_a_hung_case_is_abandoned_at_its_timeout(listening: int, fn: object) -> None:
    started = time.monotonic()
    result = run_one(_case(fn, timeout_s=0.3), _target(listening))
    assert result.outcome is Outcome.ERROR and "timed out" in result.detail
    assert time.monotonic() - started < 10


def test_run_cases_keeps_order_and_reports_progress(listening: int) -> None:
    cases = [_case(fn, f"f{i}") for i, fn in enumerate([_passes, _asserts, _async_passes] * 3)]
    seen: list[CaseResult] = []
    results = run_cases(cases, _target(listening), jobs=3, on_result=seen.append)
    assert [r.feature for r in results] == [c.feature for c in cases]
    assert sorted(r.feature for r in seen) == sorted(c.feature for c in cases)
    assert [r.outcome for r in results[:3]] == [Outcome.PASS, Outcome.FAIL, Outcome.PASS]


def test_a_closed_port_errors_every_case_of_that_protocol_at_once() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
    probe.close()
    results = run_cases([_case(_passes, "a"), _case(_passes, "b")], _target(closed))
    assert [r.outcome for r in results] == [Outcome.ERROR, Outcome.ERROR]
    assert "is closed" in results[0].detail


def test_names_are_unique_per_run_and_per_target() -> None:
    t, other = Target(), Target()
    names = {t.name("q") for _ in range(100)}
    assert len(names) == 100
    assert t.name("q").split("-")[0] != other.name("q").split("-")[0]


def test_cli_lists_cases(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list", "--protocols", "amqp,mqtt"]) == 0
    out = capsys.readouterr().out
    assert "amqp.dead-letter" in out and "mqtt.qos2" in out and "kafka." not in out


def test_cli_rejects_an_unknown_protocol() -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--protocols", "smtp"])
    assert exit_.value.code == 2


def test_cli_against_a_closed_target_writes_reports_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]
    probe.close()
    argv = ["--protocols", "mqtt", "--mqtt-port", str(closed), "-k", "qos"]
    argv += ["--report", str(tmp_path / "r.md"), "--json", str(tmp_path / "r.json")]
    assert cli.main([*argv, "--profile", "rabbitmq"]) == 1
    out = capsys.readouterr().out
    assert "mqtt      qos2" in out and "skip-unsupported" in out and "error" in out
    assert (tmp_path / "r.md").read_text().startswith("# Conformance of 127.0.0.1 (rabbitmq)")
    assert "<table>" in (tmp_path / "r.html").read_text()
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["feature"] for r in rows} == {
        "qos0",
        "qos1",
        "qos2",
        "qos-downgrade",
        "qos1-redelivery",
    }
    assert all(r["outcome"] in ("error", "skip-unsupported") for r in rows)
