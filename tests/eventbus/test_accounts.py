"""In ``accounts`` auth mode the bus API authenticates as the MNS API does (signed
requests; the access key decides the namespace): unsigned requests are refused, and
each tenant sees only its own buses and rules."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.live_server import LiveServer
from tests.mns.harness import OTHER_ACCESS_KEY, OTHER_SECRET_KEY, endpoint, start
from tests.mns.signed import request, sign_headers


@pytest.fixture(scope="module")
def accounts_server(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[LiveServer]:
    with start(tmp_path_factory.mktemp("eventbus-accounts")) as started:
        yield started


def test_unsigned_requests_are_refused(accounts_server: LiveServer) -> None:
    response = httpx.get(f"{endpoint(accounts_server)}/buses", timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "MissingAuthorizationHeader"
    wrong = sign_headers("GET", "/buses", secret_key="not-the-secret")
    response = httpx.get(f"{endpoint(accounts_server)}/buses", headers=wrong, timeout=30)
    assert response.status_code == 403
    assert response.json()["error"] == "SignatureDoesNotMatch"


def test_each_tenant_sees_its_own_buses(accounts_server: LiveServer) -> None:
    base = endpoint(accounts_server)
    body = json.dumps({"retention_ms": 3_600_000}).encode()
    created = request(base, "PUT", "/buses/tenant-a-bus", body, content_type="application/json")
    assert created.status_code == 201, created.text
    event = json.dumps({"specversion": "1.0", "id": "1", "source": "/a", "type": "t"}).encode()
    posted = request(
        base,
        "POST",
        "/buses/tenant-a-bus/events",
        event,
        content_type="application/cloudevents+json",
    )
    assert posted.status_code == 202, posted.text
    mine = request(base, "GET", "/buses").json()["buses"]
    assert {b["name"] for b in mine} == {"default", "tenant-a-bus"}
    theirs = request(
        base, "GET", "/buses", access_key=OTHER_ACCESS_KEY, secret_key=OTHER_SECRET_KEY
    ).json()["buses"]
    assert {b["name"] for b in theirs} == {"default"}
    hidden = request(
        base,
        "GET",
        "/buses/tenant-a-bus",
        access_key=OTHER_ACCESS_KEY,
        secret_key=OTHER_SECRET_KEY,
    )
    assert hidden.status_code == 404
