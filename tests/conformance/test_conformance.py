"""The whole conformance suite against polymq, started with credentials checked
(``accounts`` mode) so the refusal cases apply too. Each case is its own test, judged
from one run of the suite per server form; on any failure the full table is printed.

Cases polymq is known to fail are listed in KNOWN_FAILURES with the reason: they must
keep failing (strict), so fixing one makes its entry stale and the test says so."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.conformance import report
from polymq.conformance.cases import PROTOCOLS, cases_for
from polymq.conformance.results import CaseResult
from polymq.conformance.runner import Target, run_cases
from polymq.gateway.config import AccountConfig, AuthConfig
from tests.live_server import live_server, server_config

USER, PASSWORD = "conformance", "conformance-password"
ACCESS_KEY, SECRET_KEY = "conformance-ak", "conformance-sk"
LISTENERS = ("kafka", "amqp", "mqtt", "mqtt_ws", "rocketmq", "http")
PORT_NAMES = {"http": "mns", "mqtt_ws": "mqtt-ws"}  # listener -> the suite's name
AUTH = AuthConfig(
    mode="accounts",
    accounts=(
        AccountConfig(user=USER, password=PASSWORD, access_key=ACCESS_KEY, secret_key=SECRET_KEY),
    ),
)

KNOWN_FAILURES: dict[str, str] = {}

CASES = cases_for(PROTOCOLS)


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[dict[str, CaseResult]]:
    data_dir: Path = tmp_path_factory.mktemp("conformance")
    config = dataclasses.replace(server_config(data_dir, LISTENERS), auth=AUTH)
    with live_server(data_dir, LISTENERS, config=config) as server:
        ports = {PORT_NAMES.get(p, p): server.port(p) for p in LISTENERS}
        target = Target(
            host=server.host,
            ports=ports,
            user=USER,
            password=PASSWORD,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            auth_enforced=True,
        )
        rows = run_cases(CASES, target, jobs=4)
    print(report.text_table(rows))
    yield {f"{r.protocol}.{r.feature}.{r.client}": r for r in rows}


@pytest.mark.parametrize("key", [f"{c.key}.{c.client}" for c in CASES])
def test_case(results: dict[str, CaseResult], key: str) -> None:
    result = results[key]
    known = KNOWN_FAILURES.get(key.rsplit(".", 1)[0])
    table = report.text_table(list(results.values()))
    if known is not None:
        assert not result.ok, f"{key} passes now: remove it from KNOWN_FAILURES ({known})"
        return
    assert result.ok, f"{key}: {result.outcome.value}: {result.detail}\n{table}"
