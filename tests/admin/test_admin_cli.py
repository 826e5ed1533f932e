"""``polymq admin`` against a live gateway in ``accounts`` mode (both forms), each
command's effect checked through a real protocol client: kafka-python for topics and
groups, the aliyun-mns-sdk for queues, a raw TCP connection for connections."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from mns.account import Account
from mns.mns_exception import MNSServerException
from mns.queue import Message as MnsMessage

from polymq.gateway.admin_cli import run
from polymq.gateway.config import AccountConfig, AuthConfig
from tests.live_server import LiveServer, live_server, server_config

NS = "shop"
PASSWORD = "pw-secret"
ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(
        AccountConfig(
            user="ops", password=PASSWORD, namespaces=(NS,), admin=True, default_namespace=NS
        ),
        AccountConfig(
            user="guest",
            password=PASSWORD,
            access_key="guest-ak",
            secret_key="guest-sk",
            namespaces=(NS,),
        ),
    ),
)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("admin")
    config = dataclasses.replace(server_config(data, ("http", "kafka")), auth=ACCOUNTS)
    with live_server(data, ("http", "kafka"), config=config) as s:
        yield s


def url(server: LiveServer) -> str:
    host, port = server.address("http")
    return f"http://{host}:{port}"


def admin(server: LiveServer, *argv: str, user: str = "ops") -> Any:
    """Run ``polymq admin --json …`` in-process as ``user``; the parsed JSON output."""
    out = io.StringIO()
    env = {"POLYMQ_ADMIN_USER": user, "POLYMQ_ADMIN_PASSWORD": PASSWORD}
    code = run(["--url", url(server), "--json", *argv], env, out)
    assert code == 0, f"polymq admin {' '.join(argv)} exited {code}"
    return json.loads(out.getvalue())


def refused(server: LiveServer, *argv: str, user: str = "ops") -> int:
    env = {"POLYMQ_ADMIN_USER": user, "POLYMQ_ADMIN_PASSWORD": PASSWORD}
    return run(["--url", url(server), *argv], env, io.StringIO())


def kafka(server: LiveServer) -> dict[str, Any]:
    host, port = server.address("kafka")
    return dict(
        bootstrap_servers=f"{host}:{port}",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_plain_username="guest",
        sasl_plain_password=PASSWORD,
    )


def produce(server: LiveServer, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(acks="all", **kafka(server))
    for v in values:
        producer.send(topic, v, partition=0).get(WAIT_S)
    producer.close()


def consume(server: LiveServer, topic: str, group: str, count: int) -> list[bytes]:
    """``count`` records through group ``group``, committed, then the consumer leaves."""
    consumer = KafkaConsumer(
        topic,
        group_id=group,
        auto_offset_reset="latest",  # a reset to earliest must come from the group
        enable_auto_commit=False,
        **kafka(server),
    )
    got: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(r.value for r in records)
    consumer.commit()
    consumer.close()
    return got


def wait_for(condition: Callable[[], object]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_topics_create_peek_publish_describe_delete(server: LiveServer) -> None:
    created = admin(server, "topics", "create", "orders", "-n", NS, "--queues", "2")
    assert created["config"]["queue_count"] == 2
    produce(server, "orders", [b"first", b"second"])
    peeked = admin(server, "topics", "peek", "orders", "-n", NS, "--queue", "0")
    assert [m["body"] for m in peeked["messages"]] == ["first", "second"]
    # Peeking consumed nothing: a consumer from the start still gets both.
    sent = admin(
        server, "topics", "publish", "orders", "-n", NS, "third", "--property", "source=test"
    )
    assert sent["queue_id"] == 0
    consumer = KafkaConsumer(
        "orders", auto_offset_reset="earliest", consumer_timeout_ms=5000, **kafka(server)
    )
    records = [r for r in consumer if r.partition == 0][:3]
    consumer.close()
    assert [r.value for r in records] == [b"first", b"second", b"third"]
    assert ("source", b"test") in records[2].headers
    described = admin(server, "topics", "describe", "orders", "-n", NS)
    assert [q["latest"] for q in described["queues"]] == [3, 0]
    listed = admin(server, "topics", "list", "-n", NS)
    assert "orders" in {t["name"] for t in listed["topics"]}
    admin(server, "topics", "delete", "orders", "-n", NS)
    assert refused(server, "topics", "describe", "orders", "-n", NS) == 1


def test_group_describe_and_reset_offsets_make_a_consumer_read_again(server: LiveServer) -> None:
    admin(server, "topics", "create", "events", "-n", NS)
    produce(server, "events", [b"a", b"b", b"c"])
    # The group starts at the end ("latest"), so it reads nothing until told.
    consume_and_commit_end = KafkaConsumer(
        "events", group_id="billing", auto_offset_reset="earliest", **kafka(server)
    )
    got: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < 3 and time.monotonic() < deadline:
        for records in consume_and_commit_end.poll(timeout_ms=500).values():
            got.extend(r.value for r in records)
    consume_and_commit_end.commit()
    # While it runs, the group's stable generation names it as a member.
    members = admin(server, "groups", "describe", "billing", "-n", NS)["members"]
    assert [m["client_id"][:12] for m in members] == ["kafka-python"]
    consume_and_commit_end.close()
    assert got == [b"a", b"b", b"c"]

    group = admin(server, "groups", "describe", "billing", "-n", NS)
    assert [(q["topic"], q["committed"], q["lag"]) for q in group["queues"]] == [("events", 3, 0)]
    dry = admin(
        server, "groups", "reset-offsets", "billing", "-n", NS, "--topic", "events",
        "--to", "offset", "--offset", "1", "--dry-run",
    )  # fmt: skip
    assert dry["offsets"][0] == {"topic": "events", "queue_id": 0, "previous": 3, "offset": 1}
    assert admin(server, "groups", "describe", "billing", "-n", NS)["lag"] == 0
    admin(
        server, "groups", "reset-offsets", "billing", "-n", NS, "--topic", "events",
        "--to", "earliest",
    )  # fmt: skip
    assert admin(server, "groups", "describe", "billing", "-n", NS)["lag"] == 3
    assert consume(server, "events", "billing", 3) == [b"a", b"b", b"c"]
    listed = admin(server, "groups", "list", "-n", NS)
    assert "billing" in {g["name"] for g in listed["groups"]}


def test_queues_create_peek_purge(server: LiveServer) -> None:
    admin(server, "queues", "create", "jobs", "-n", NS)
    account = Account(url(server), "guest-ak", "guest-sk")
    queue = account.get_queue("jobs")
    for i in range(3):
        queue.send_message(MnsMessage(f"job {i}"))
    listed = admin(server, "queues", "list", "-n", NS)
    [jobs] = [q for q in listed["queues"] if q["name"] == "jobs"]
    assert (jobs["active"], jobs["inactive"]) == (3, 0)
    peeked = admin(server, "queues", "peek", "jobs", "-n", NS)
    # The SDK sends bodies base64-encoded: that text is what is stored.
    bodies = [base64.b64decode(m["body"]).decode() for m in peeked["messages"]]
    assert bodies == ["job 0", "job 1", "job 2"]
    # The peek took nothing: the SDK still receives the first.
    assert queue.receive_message(0).message_body == b"job 0"
    purged = admin(server, "queues", "purge", "jobs", "-n", NS)
    assert purged == {"purged": 2}  # the received one stays with its receiver
    with pytest.raises(MNSServerException) as e:
        queue.receive_message(0)
    assert e.value.type == "MessageNotExist"
    admin(server, "queues", "delete", "jobs", "-n", NS)
    with pytest.raises(MNSServerException):
        queue.get_attributes()


def test_connections_list_and_close(server: LiveServer) -> None:
    with socket.create_connection(server.address("kafka"), timeout=WAIT_S) as sock:
        peer = "{}:{}".format(*sock.getsockname())
        found: list[dict[str, Any]] = []

        def listed() -> bool:
            found[:] = [
                c for c in admin(server, "connections", "list")["connections"] if c["peer"] == peer
            ]
            return bool(found)

        wait_for(listed)
        assert found[0]["protocol"] == "kafka"
        admin(server, "connections", "close", str(found[0]["id"]))
        assert sock.recv(1) == b""  # closed by the server
    assert refused(server, "connections", "close", str(found[0]["id"])) == 1


def test_only_admins_act_and_secrets_stay_out(server: LiveServer) -> None:
    assert refused(server, "topics", "create", "nope", "-n", NS, user="guest") == 1
    assert refused(server, "queues", "purge", "x", "-n", NS, user="guest") == 1
    # The body is read after the check: a guest's bad body is refused, not parsed.
    path = url(server) + f"/admin/topics/{NS}"
    assert httpx.post(path, content=b"{", auth=("guest", PASSWORD)).status_code == 403
    assert httpx.post(path, content=b"{", auth=("ops", PASSWORD)).status_code == 422
    schema = httpx.get(url(server) + "/openapi.json").json()["paths"]["/admin/topics/{namespace}"]
    assert "queue_count" in json.dumps(schema["post"]["requestBody"])
    accounts = admin(server, "accounts")["accounts"]
    assert {a["user"] for a in accounts} == {"ops", "guest"}
    assert PASSWORD not in json.dumps(accounts) and "guest-sk" not in json.dumps(accounts)
    gateways = admin(server, "gateways")
    assert any("kafka" in g["endpoints"] for g in gateways["gateways"])


def test_namespaces_create_admins_only(server: LiveServer) -> None:
    """``POST /admin/namespaces`` (the console's namespaces page): admins only, the
    body read after the check; 409 for one that exists, 400 for a bad name; the new
    one listed for the admin with no topics or queues, and not for the guest."""
    path = url(server) + "/admin/namespaces"
    assert httpx.post(path, content=b"{", auth=("guest", PASSWORD)).status_code == 403
    assert httpx.post(path, json={"name": "made"}, auth=("guest", PASSWORD)).status_code == 403
    created = httpx.post(path, json={"name": "made"}, auth=("ops", PASSWORD))
    assert created.status_code == 201, created.text
    assert httpx.post(path, json={"name": "made"}, auth=("ops", PASSWORD)).status_code == 409
    assert httpx.post(path, json={"name": ""}, auth=("ops", PASSWORD)).status_code == 400
    listed = httpx.get(path, auth=("ops", PASSWORD)).json()["namespaces"]
    assert {"name": "made", "topics": 0, "queues": 0} in listed
    assert "made" not in [
        n["name"] for n in httpx.get(path, auth=("guest", PASSWORD)).json()["namespaces"]
    ]
    schema = httpx.get(url(server) + "/openapi.json").json()["paths"]["/admin/namespaces"]
    assert "name" in json.dumps(schema["post"]["requestBody"])


def test_nodes_and_shards(server: LiveServer, server_form: str) -> None:
    nodes = admin(server, "nodes")
    if server_form == "merged":
        assert nodes == {"form": "merged", "route_version": None, "nodes": [], "shards": []}
    else:  # tests/live_server.py: two storage nodes behind one nameserver
        assert nodes["form"] == "separated" and len(nodes["nodes"]) == 2
        assert all(n["alive"] for n in nodes["nodes"])
        assert admin(server, "shards")["shards"] == []  # not the replicated pool
    out = io.StringIO()
    env = {"POLYMQ_ADMIN_USER": "ops", "POLYMQ_ADMIN_PASSWORD": PASSWORD}
    assert run(["--url", url(server), "nodes"], env, out) == 0
    assert ("merged form" in out.getvalue()) == (server_form == "merged")


def test_the_polymq_command_takes_credentials_from_a_config_file(
    server: LiveServer, tmp_path: Path
) -> None:
    config = tmp_path / "admin.toml"
    config.write_text(f'url = "{url(server)}"\nuser = "ops"\npassword = "{PASSWORD}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYMQ_ADMIN")}
    polymq = Path(sys.executable).parent / "polymq"
    done = subprocess.run(
        [str(polymq), "admin", "--admin-config", str(config), "accounts"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split()[:2] == ["USER", "ADMIN"]
    assert "ops" in done.stdout
    done = subprocess.run(
        [str(polymq), "admin", "--url", url(server), "accounts"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "401" in done.stderr


def _queried(expressions: list[str]) -> set[str]:
    return {m for e in expressions for m in re.findall(r"\bpolymq_[a-z0-9_]+", e)}


def test_every_metric_the_dashboard_and_alerts_query_exists(
    server: LiveServer, server_form: str
) -> None:
    """After some traffic (Kafka produce and a group's commit, an MNS message, a failed
    login), every polymq metric the Grafana dashboard and the alert rules query has a
    sample on /metrics, and the latency histograms have counted Kafka's appends. The
    engine's (``polymq_storage_*``) are on the gateway's /metrics in the merged form
    only (storage processes serve their own: tests/admin/test_metrics_storage.py); the
    replicated pool's (``polymq_replication_*``) are checked on live storage processes
    by tests/replicated/test_replicated_metrics.py."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    dashboard = json.loads((docs / "grafana" / "polymq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((docs / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    wanted = _queried(exprs)
    assert {"polymq_group_lag", "polymq_append_latency_seconds_bucket"} <= wanted
    assert "polymq_storage_fsync_seconds_bucket" in wanted
    elsewhere = (
        ("polymq_replication_",)
        if server_form == "merged"
        else ("polymq_replication_", "polymq_storage_")
    )
    wanted = {name for name in wanted if not name.startswith(elsewhere)}

    admin(server, "topics", "create", "metered", "-n", NS)
    produce(server, "metered", [b"x", b"y"])
    consumer = KafkaConsumer(
        "metered", group_id="watchers", auto_offset_reset="earliest", **kafka(server)
    )
    got = 0
    deadline = time.monotonic() + WAIT_S
    while got < 2 and time.monotonic() < deadline:
        got += sum(len(r) for r in consumer.poll(timeout_ms=500).values())
    consumer.commit()
    consumer.close()
    produce(server, "metered", [b"z"])  # the group is one behind
    admin(server, "queues", "create", "metered-q", "-n", NS)
    Account(url(server), "guest-ak", "guest-sk").get_queue("metered-q").send_message(
        MnsMessage("m")
    )
    assert httpx.get(url(server) + "/admin/topics", auth=("guest", "wrong")).status_code == 401

    text = httpx.get(url(server) + "/metrics").text
    sampled = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert wanted - sampled == set()
    lag = [line for line in text.splitlines() if line.startswith("polymq_group_lag{")]
    assert any('group="watchers"' in line and line.endswith(" 1.0") for line in lag), lag
    count = [
        line
        for line in text.splitlines()
        if line.startswith('polymq_append_latency_seconds_count{protocol="kafka"}')
    ]
    assert count and float(count[0].split()[-1]) >= 3
    assert 'polymq_delivery_age_seconds_count{protocol="kafka"}' in text
    appended = [
        line for line in text.splitlines() if line.startswith("polymq_topic_appended_total")
    ]
    assert any('topic="metered"' in line and line.endswith(" 3.0") for line in appended)
    if server_form == "merged":  # the engine's group commits counted Kafka's appends
        commits = [
            line
            for line in text.splitlines()
            if line.startswith('polymq_storage_commit_seconds_count{shard="merged"}')
        ]
        assert commits and float(commits[0].split()[-1]) >= 3


def test_permissions_add_list_delete_and_tables(server: LiveServer) -> None:
    """Last in the module: for a while, the guest may not write to topic ``secret``."""
    admin(server, "topics", "create", "secret", "-n", NS)
    added = admin(
        server, "permissions", "add", "guest", "-n", NS, "--resource", "topic",
        "--pattern", "secret", "--operations", "write", "--effect", "deny",
    )  # fmt: skip
    listed = admin(server, "permissions", "list", "-n", NS)["rules"]
    assert added["key"] in {r["key"] for r in listed}
    producer = KafkaProducer(acks="all", max_block_ms=10_000, **kafka(server))
    with pytest.raises(KafkaError):
        producer.send("secret", b"no", partition=0).get(WAIT_S)
    producer.close()
    admin(server, "permissions", "delete", added["key"], "-n", NS)
    assert added["key"] not in {
        r["key"] for r in admin(server, "permissions", "list", "-n", NS)["rules"]
    }
    # The tables people read: a header row, then one row per item.
    out = io.StringIO()
    env = {"POLYMQ_ADMIN_USER": "ops", "POLYMQ_ADMIN_PASSWORD": PASSWORD}
    assert run(["--url", url(server), "topics", "list", "-n", NS], env, out) == 0
    header, *rows = out.getvalue().splitlines()
    assert header.split() == ["NAMESPACE", "TOPIC", "QUEUES", "TYPE", "RETENTION_MS", "MESSAGES"]
    assert any(row.split()[:2] == [NS, "secret"] for row in rows)
