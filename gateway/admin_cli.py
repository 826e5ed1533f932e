"""``polymq admin``: the admin API (docs/admin.md) from a terminal, in the manner of
``rabbitmqctl``, ``kafka-topics``, ``kafka-consumer-groups`` and ``mqadmin``.

A thin httpx client: every command is one or a few requests to ``/admin/*`` of a
gateway's HTTP port, so it does what the API allows and nothing else (credentials are
checked by the server). Output is a table for people, or the API's JSON with
``--json`` for scripts. Where the server is and who asks come from flags, else the
environment (``POLYMQ_ADMIN_URL``, ``POLYMQ_ADMIN_USER``, ``POLYMQ_ADMIN_PASSWORD``),
else a TOML file (``--admin-config``, ``POLYMQ_ADMIN_CONFIG`` or
``~/.config/polymq/admin.toml``, with ``url``, ``user``, ``password``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

__all__ = ["AdminTarget", "build_parser", "main", "target_of"]

DEFAULT_URL = "http://127.0.0.1:8080"
_ENV_URL = "POLYMQ_ADMIN_URL"
_ENV_USER = "POLYMQ_ADMIN_USER"
_ENV_PASSWORD = "POLYMQ_ADMIN_PASSWORD"
_ENV_CONFIG = "POLYMQ_ADMIN_CONFIG"
_DEFAULT_CONFIG = Path("~/.config/polymq/admin.toml")
_TIMEOUT_S = 30.0


class AdminError(Exception):
    """The server refused (its status and message) or could not be reached."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminTarget:
    url: str
    user: str | None = None
    password: str | None = None


def target_of(args: argparse.Namespace, env: Mapping[str, str]) -> AdminTarget:
    """Flags, then the environment, then the config file: the first that names a
    value wins, per value (a URL from the file and a password from the environment)."""
    path = args.admin_config or env.get(_ENV_CONFIG)
    file: dict[str, Any] = {}
    config = Path(path) if path else _DEFAULT_CONFIG.expanduser()
    if config.is_file():
        with config.open("rb") as f:
            file = tomllib.load(f)
    elif path:
        raise AdminError(f"no admin config file {config}")

    def pick(flag: str | None, name: str, key: str) -> str | None:
        value = flag or env.get(name) or file.get(key)
        return str(value) if value is not None else None

    return AdminTarget(
        url=(pick(args.url, _ENV_URL, "url") or DEFAULT_URL).rstrip("/"),
        user=pick(args.user, _ENV_USER, "user"),
        password=pick(args.password, _ENV_PASSWORD, "password"),
    )


class AdminClient:
    """The admin API's requests; errors become :class:`AdminError` with the server's
    own explanation (FastAPI's ``detail``)."""

    def __init__(self, target: AdminTarget, transport: httpx.BaseTransport | None = None) -> None:
        auth = (target.user, target.password or "") if target.user else None
        self._http = httpx.Client(
            base_url=target.url, auth=auth, timeout=_TIMEOUT_S, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, params=query, json=body)
        except httpx.HTTPError as e:
            raise AdminError(f"{self._http.base_url}: {e}") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise AdminError(f"{method} {path}: {response.status_code} {detail}")
        if response.status_code == 204 or not response.content:
            return {"status": response.status_code}
        return response.json()


# -- output ------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell, as ``rabbitmqctl list_queues`` prints."""
    cells = [list(headers), *([("" if c is None else str(c)) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


Render = Callable[[Any], str]


def _topics(data: Any) -> str:
    return table(
        ("NAMESPACE", "TOPIC", "QUEUES", "TYPE", "RETENTION_MS", "MESSAGES"),
        (
            (
                t["namespace"],
                t["name"],
                t["config"]["queue_count"],
                t["config"]["message_type"],
                t["config"]["retention_ms"],
                sum(q["latest"] - q["earliest"] for q in t["queues"]),
            )
            for t in data["topics"]
        ),
    )


def _topic(data: Any) -> str:
    lines = [
        f"topic {data['namespace']}/{data['name']}: {data['config']['queue_count']} queues, "
        f"{data['config']['message_type']}, retention_ms {data['config']['retention_ms']}",
        table(
            ("QUEUE", "EARLIEST", "LATEST"),
            ((q["queue_id"], q["earliest"], q["latest"]) for q in data["queues"]),
        ),
    ]
    if data.get("groups"):
        lines += [
            "",
            table(
                ("GROUP", "LAG", "COMMITTED"),
                ((g["name"], g["lag"], g["committed"]) for g in data["groups"]),
            ),
        ]
    return "\n".join(lines)


def _flags(q: Any) -> str:
    """An AMQP queue's flags as ``rabbitmqctl list_queues`` shows them (D, Excl, AD)."""
    if q["kind"] != "amqp":
        return ""
    named = (("durable", "D"), ("exclusive", "Excl"), ("auto_delete", "AD"))
    return " ".join(short for key, short in named if q[key]) or "-"


def _queues(data: Any) -> str:
    """Ready and unacked as RabbitMQ counts them; for MNS queues, active and inactive."""
    return table(
        ("KIND", "NAMESPACE", "QUEUE", "READY", "UNACKED", "DELAYED", "CONSUMERS", "FLAGS"),
        (
            (
                q["kind"],
                q["namespace"],
                q["name"],
                q["messages_ready"],
                q["messages_unacked"],
                q.get("delayed", ""),
                q.get("consumer_count", ""),
                _flags(q),
            )
            for q in data["queues"]
        ),
    )


def _messages(data: Any) -> str:
    return table(
        ("QUEUE", "OFFSET", "SIZE", "TAG", "KEY", "BODY", "PROPERTIES"),
        (
            (
                m["queue_id"],
                m["offset"],
                m["size"],
                m["tag"],
                m["key"],
                (m["body"] if m["body_encoding"] == "utf-8" else "base64:" + m["body"])
                + ("…" if m["truncated"] else ""),
                ",".join(f"{k}={v}" for k, v in m["properties"].items()),
            )
            for m in data["messages"]
        ),
    )


def _groups(data: Any) -> str:
    return table(
        ("NAMESPACE", "GROUP", "LAG", "QUEUES"),
        ((g["namespace"], g["name"], g["lag"], len(g["queues"])) for g in data["groups"]),
    )


def _group(data: Any) -> str:
    """Offsets (offset groups), then queues popped by the group (AMQP, MQTT shared),
    then the members of every protocol."""
    lines = []
    if data["queues"] or not data.get("pop_queues"):
        lines.append(
            table(
                ("TOPIC", "QUEUE", "COMMITTED", "LATEST", "LAG"),
                (
                    (q["topic"], q["queue_id"], q["committed"], q["latest"], q["lag"])
                    for q in data["queues"]
                ),
            )
        )
    if data.get("pop_queues"):
        lines += [
            table(
                ("KIND", "QUEUE", "READY", "UNACKED", "LAG", "CONSUMERS"),
                (
                    (q["kind"], q["queue"], q["ready"], q["unacked"], q["lag"], q["consumers"])
                    for q in data["pop_queues"]
                ),
            )
        ]
    if data["members"]:
        lines += [
            "",
            table(
                ("PROTOCOL", "MEMBER", "CLIENT_ID", "HOST", "QUEUE"),
                (
                    (
                        m.get("protocol", "kafka"),
                        m["member_id"],
                        m["client_id"],
                        m["client_host"],
                        m.get("queue") or m.get("filter") or "",
                    )
                    for m in data["members"]
                ),
            ),
        ]
    return "\n".join(lines)


def _reset(data: Any) -> str:
    note = " (dry run: nothing committed)" if data["dry_run"] else ""
    return (
        table(
            ("TOPIC", "QUEUE", "PREVIOUS", "NEW"),
            ((o["topic"], o["queue_id"], o["previous"], o["offset"]) for o in data["offsets"]),
        )
        + note
    )


def _connections(data: Any) -> str:
    return table(
        ("ID", "PROTOCOL", "PEER", "USER", "NAMESPACE", "CLIENT_ID"),
        (
            (c["id"], c["protocol"], c["peer"], c["user"], c["namespace"], c["client_id"])
            for c in data["connections"]
        ),
    )


def _accounts(data: Any) -> str:
    return table(
        ("USER", "ADMIN", "NAMESPACES", "ACCESS_KEY", "PASSWORD", "SCRAM"),
        (
            (
                a["user"],
                "yes" if a["admin"] else "",
                ",".join(a["namespaces"]) or "*",
                a["access_key"],
                "yes" if a["has_password"] else "",
                ",".join(a["scram"]),
            )
            for a in data["accounts"]
        ),
    )


def _permissions(data: Any) -> str:
    return table(
        (
            "KEY",
            "PRINCIPAL",
            "NAMESPACE",
            "RESOURCE",
            "PATTERN",
            "MATCH",
            "OPERATIONS",
            "EFFECT",
            "SOURCE",
        ),
        (
            (
                r.get("key"),
                r.get("principal"),
                r.get("namespace"),
                r.get("resource"),
                r.get("pattern"),
                r.get("match"),
                ",".join(r.get("operations", [])),
                r.get("effect"),
                r.get("source"),
            )
            for r in data["rules"]
        ),
    )


def _gateways(data: Any) -> str:
    return table(
        ("GATEWAY", "ZONE", "LOAD", "ENDPOINTS"),
        (
            (
                g["gateway_id"] + (" *" if g["gateway_id"] == data["self"] else ""),
                g["zone"],
                g["load"],
                " ".join(f"{p}={a}" for p, a in sorted(g["endpoints"].items())),
            )
            for g in data["gateways"]
        ),
    )


def _nodes(data: Any) -> str:
    if data["form"] == "merged":
        return "merged form: one embedded storage engine, no storage nodes"
    return table(
        ("NODE", "ADDRESS", "HEALTH", "TOPICS", "LOAD", "DISK FREE", "LAST SEEN", "SHARD OWNER"),
        (
            (
                n["node_id"],
                n["address"],
                "up" if n["alive"] else "DOWN",
                n["topics"],
                f"{n['load']:.1f}",
                f"{n['disk_free_bytes'] / 2**30:.1f} GiB",
                f"{n['last_seen_ms_ago'] / 1000:.1f} s ago",
                f"{n['owner']} (epoch {n['epoch']})" if n["owner"] else "",
            )
            for n in data["nodes"]
        ),
    )


def _shards(data: Any) -> str:
    if not data["shards"]:
        return "no shards: the pool is not replicated"
    return table(
        ("SHARD", "OWNER", "EPOCH", "HEALTH"),
        (
            (s["node_id"], s["owner"], s["epoch"], "up" if s["alive"] else "DOWN")
            for s in data["shards"]
        ),
    )


def _done(data: Any) -> str:
    return "done" if set(data) == {"status"} else json.dumps(data)


# -- commands ----------------------------------------------------------------------

Command = Callable[[AdminClient, argparse.Namespace], tuple[Any, Render]]


def _ns(args: argparse.Namespace) -> str:
    return str(args.namespace)


def _topics_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    if a.action == "list":
        return c.call("GET", "/admin/topics", params={"namespace": a.namespace}), _topics
    if a.action == "describe":
        return c.call("GET", f"/admin/topics/{_ns(a)}/{a.name}"), _topic
    if a.action == "create":
        body = {"name": a.name, "queue_count": a.queues, "message_type": a.type}
        if a.retention_ms is not None:
            body["retention_ms"] = a.retention_ms
        return c.call("POST", f"/admin/topics/{_ns(a)}", body=body), _topic
    if a.action == "delete":
        return c.call("DELETE", f"/admin/topics/{_ns(a)}/{a.name}"), _done
    if a.action == "peek":
        data = c.call(
            "GET",
            f"/admin/topics/{_ns(a)}/{a.name}/messages",
            params={"queue_id": a.queue, "offset": a.offset, "limit": a.limit},
        )
        return data, _messages
    body = {"body": a.body, "key": a.key, "tag": a.tag, "queue_id": a.queue or 0}
    body["properties"] = dict(p.split("=", 1) for p in a.property)
    return c.call("POST", f"/admin/topics/{_ns(a)}/{a.name}/messages", body=body), json.dumps


def _queues_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    if a.action == "list":
        params = {"namespace": a.namespace, "kind": a.kind}
        return c.call("GET", "/admin/queues", params=params), _queues
    path = f"/admin/queues/{_ns(a)}/{a.name}"
    if a.action == "create":
        return c.call("PUT", path), _done
    if a.action == "delete":
        return c.call("DELETE", path), _done
    if a.action == "purge":
        return c.call("POST", path + "/purge"), lambda d: f"purged {d['purged']} messages"
    return c.call("GET", path + "/messages", params={"limit": a.limit}), _messages


def _groups_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    if a.action == "list":
        return c.call("GET", "/admin/groups", params={"namespace": a.namespace}), _groups
    path = f"/admin/groups/{_ns(a)}/{a.name}"
    if a.action == "describe":
        return c.call("GET", path), _group
    body = {
        "topic": a.topic,
        "to": a.to,
        "offset": a.offset,
        "timestamp_ms": a.timestamp_ms,
        "queue_id": a.queue,
        "dry_run": a.dry_run,
    }
    return c.call("POST", path + "/reset-offsets", body=body), _reset


def _connections_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    if a.action == "list":
        return c.call("GET", "/admin/connections"), _connections
    return c.call("DELETE", f"/admin/connections/{a.id}"), _done


def _accounts_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    return c.call("GET", "/admin/accounts"), _accounts


def _permissions_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    if a.action == "list":
        return c.call("GET", "/admin/permissions", params={"namespace": a.namespace}), _permissions
    if a.action == "delete":
        return c.call("DELETE", f"/admin/permissions/{_ns(a)}/{a.key}"), _done
    rule = {
        "principal": a.principal,
        "namespace": a.namespace,
        "resource": a.resource,
        "pattern": a.pattern,
        "match": a.match,
        "operations": a.operations.split(","),
        "effect": a.effect,
    }
    return c.call("POST", "/admin/permissions", body=rule), lambda d: f"added {d['key']}"


def _gateways_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    return c.call("GET", "/admin/gateways"), _gateways


def _nodes_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    return c.call("GET", "/admin/nodes"), _nodes


def _shards_cmd(c: AdminClient, a: argparse.Namespace) -> tuple[Any, Render]:
    data = c.call("GET", "/admin/nodes")
    return ({"form": data["form"], "shards": data["shards"]}, _shards)


_COMMANDS: Mapping[str, Command] = {
    "topics": _topics_cmd,
    "queues": _queues_cmd,
    "groups": _groups_cmd,
    "connections": _connections_cmd,
    "accounts": _accounts_cmd,
    "permissions": _permissions_cmd,
    "gateways": _gateways_cmd,
    "nodes": _nodes_cmd,
    "shards": _shards_cmd,
}


def _namespace_flag(p: argparse.ArgumentParser, default: str | None = "default") -> None:
    p.add_argument("-n", "--namespace", default=default, help=f"[{default or 'all visible'}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polymq admin",
        description="Manage a running polymq through its admin API (docs/admin.md), in the "
        "manner of rabbitmqctl, kafka-topics, kafka-consumer-groups and mqadmin.",
        epilog=f"Where and who: --url/--user/--password, else {_ENV_URL}, {_ENV_USER}, "
        f"{_ENV_PASSWORD}, else a TOML file (url, user, password): --admin-config, "
        f"{_ENV_CONFIG} or {_DEFAULT_CONFIG}. Default URL {DEFAULT_URL}.",
    )
    parser.add_argument("--url", help="a gateway's HTTP port, e.g. http://127.0.0.1:8080")
    parser.add_argument("--user", help="an admin account (accounts mode)")
    parser.add_argument("--password")
    parser.add_argument("--admin-config", metavar="FILE")
    parser.add_argument("--json", action="store_true", help="the API's JSON, for scripts")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    topics = commands.add_parser("topics", help="list, describe, create, delete, peek, publish")
    t = topics.add_subparsers(dest="action", required=True)
    _namespace_flag(t.add_parser("list"), None)
    for action in ("describe", "delete", "create", "peek", "publish"):
        p = t.add_parser(action)
        p.add_argument("name")
        _namespace_flag(p)
        if action == "create":
            p.add_argument("--queues", type=int, default=1, help="queue (partition) count [1]")
            p.add_argument(
                "--type", default="NORMAL", choices=("NORMAL", "FIFO", "DELAY", "TRANSACTION")
            )
            p.add_argument("--retention-ms", type=int, help="-1: until consumed")
        if action == "peek":
            p.add_argument("--queue", type=int, help="[every queue in turn]")
            p.add_argument("--offset", type=int, help="[the earliest kept]")
            p.add_argument("--limit", type=int, default=10)
        if action == "publish":
            p.add_argument("body")
            p.add_argument("--key")
            p.add_argument("--tag")
            p.add_argument("--queue", type=int)
            p.add_argument("--property", action="append", default=[], metavar="NAME=VALUE")

    queues = commands.add_parser(
        "queues", help="list (MNS and AMQP); MNS queues: create, delete, purge, peek"
    )
    q = queues.add_subparsers(dest="action", required=True)
    p = q.add_parser("list")
    _namespace_flag(p, None)
    p.add_argument("--kind", choices=("mns", "amqp"), help="[both]")
    for action in ("create", "delete", "purge", "peek"):
        p = q.add_parser(action)
        p.add_argument("name")
        _namespace_flag(p)
        if action == "peek":
            p.add_argument("--limit", type=int, default=10)

    groups = commands.add_parser("groups", help="list, describe, reset-offsets")
    g = groups.add_subparsers(dest="action", required=True)
    _namespace_flag(g.add_parser("list"), None)
    p = g.add_parser("describe")
    p.add_argument("name")
    _namespace_flag(p)
    p = g.add_parser("reset-offsets", help="stop the group's consumers first")
    p.add_argument("name")
    _namespace_flag(p)
    p.add_argument("--topic", required=True)
    p.add_argument("--to", required=True, choices=("earliest", "latest", "offset", "timestamp"))
    p.add_argument("--offset", type=int)
    p.add_argument("--timestamp-ms", type=int)
    p.add_argument("--queue", type=int, help="[every queue of the topic]")
    p.add_argument("--dry-run", action="store_true", help="show, commit nothing")

    connections = commands.add_parser("connections", help="list, close (this gateway's)")
    c = connections.add_subparsers(dest="action", required=True)
    c.add_parser("list")
    c.add_parser("close").add_argument("id", type=int)

    commands.add_parser("accounts", help="configured accounts, never their secrets")

    permissions = commands.add_parser("permissions", help="list, add, delete rules")
    r = permissions.add_subparsers(dest="action", required=True)
    _namespace_flag(r.add_parser("list"), None)
    p = r.add_parser("add")
    p.add_argument("principal")
    _namespace_flag(p)
    p.add_argument("--resource", required=True, choices=("topic", "group", "transactional_id"))
    p.add_argument("--pattern", required=True)
    p.add_argument("--match", default="literal", choices=("literal", "prefix", "glob"))
    p.add_argument("--operations", required=True, help="comma-separated, e.g. read,write")
    p.add_argument("--effect", default="allow", choices=("allow", "deny"))
    p = r.add_parser("delete")
    p.add_argument("key")
    _namespace_flag(p)

    commands.add_parser("gateways", help="the live gateways and their endpoints")
    commands.add_parser("nodes", help="storage nodes, as the nameservers know them")
    commands.add_parser("shards", help="the replicated pool's shards and their owners")
    return parser


def run(
    argv: Sequence[str],
    env: Mapping[str, str],
    out: TextIO,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Parse, call, print; 0 on success, 1 when the server refused, 2 on bad usage."""
    args = build_parser().parse_args(list(argv))
    try:
        client = AdminClient(target_of(args, env), transport)
    except AdminError as e:
        print(f"polymq admin: {e}", file=sys.stderr)
        return 2
    try:
        data, render = _COMMANDS[args.command](client, args)
    except AdminError as e:
        print(f"polymq admin: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(data, indent=2) if args.json else render(data), file=out)
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return run(
        sys.argv[2:] if argv is None else argv, os.environ if env is None else env, sys.stdout
    )
