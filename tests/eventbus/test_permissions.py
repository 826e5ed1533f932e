"""The permission model (docs/permissions.md) bounds what a rule or a bus can reach:
the dispatchers act with an identity of their own, so saving a rule needs write (and
create, for a missing topic) on each target, and a bus's sources need read; a refusal
is 403 AccessDenied. Accounts of tests/permissions (namespace ``shop``), both forms."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.live_server import LiveServer
from tests.mns.harness import endpoint
from tests.mns.signed import request
from tests.permissions.accounts import permission_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("eventbus-perm"), ("http",)) as started:
        yield started


def _as(
    user: str, server: LiveServer, method: str, path: str, document: object
) -> tuple[int, dict[str, Any]]:
    response = request(
        endpoint(server),
        method,
        path,
        json.dumps(document).encode(),
        access_key=f"{user}-ak",
        secret_key=f"{user}-sk",
        content_type="application/json",
    )
    return response.status_code, response.json()


def _rule(topic: str) -> dict[str, object]:
    return {"pattern": {"type": ["t"]}, "targets": [{"id": "t", "type": "topic", "name": topic}]}


def test_rule_targets_need_write_and_create(server: LiveServer) -> None:
    status, _ = _as("writer", server, "PUT", "/buses/default/rules/ok", _rule("data-out"))
    assert status == 201
    status, error = _as("writer", server, "PUT", "/buses/default/rules/no", _rule("secret"))
    assert (status, error["error"]) == (403, "AccessDenied")
    status, error = _as("reader", server, "PUT", "/buses/default/rules/no", _rule("data-out"))
    assert (status, error["error"]) == (403, "AccessDenied")


def test_bus_sources_need_read(server: LiveServer) -> None:
    status, _ = _as("reader", server, "PUT", "/buses/in", {"sources": ["data-in"]})
    assert status == 201
    status, error = _as("reader", server, "PUT", "/buses/in2", {"sources": ["secret"]})
    assert (status, error["error"]) == (403, "AccessDenied")
