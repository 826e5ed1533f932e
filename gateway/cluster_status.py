"""``polymq cluster status``: what a nameserver and the navigation service know, as
tables an operator reads at a glance: storage nodes and their health, gateways and
their endpoints, and which node holds each topic; and, for a ``cluster up`` on this
machine, what its supervisor did (the status file it keeps in its data dir: each
process's pid, state, restarts and last exit)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from polymq.storage.routes import RouteTable

__all__ = ["read_supervisor", "render", "render_processes", "show"]


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


def render(
    routes: RouteTable,
    gateways: Sequence[dict[str, Any]],
    now_ms: int,
    replicas: Mapping[str, str] | None = None,
) -> str:
    """The whole report; pure, so it is tested without a cluster. ``replicas``: the
    replicated pool's shard streams' health (:func:`storage.replicated.health`)."""
    per_node = Counter(routes.topics.values())
    lines = [f"storage nodes (route version {routes.version}):"]
    lines += _table(
        ("node", "address", "health", "topics", "load", "disk free", "last heartbeat"),
        (
            (
                n.node_id,
                f"{n.host}:{n.port}",
                "up" if n.alive else "DOWN",
                per_node.get(n.node_id, 0),
                f"{n.load:.1f}",
                f"{n.disk_free_bytes / 2**30:.1f} GiB",
                f"{max(0, now_ms - n.last_seen_ms) / 1000:.1f} s ago",
            )
            for n in sorted(routes.nodes, key=lambda n: n.node_id)
        ),
    )
    shards = [n for n in routes.nodes if n.owner]
    if shards:
        lines += ["", "shards (replicated pool):"]
        lines += _table(
            ("shard", "owner", "epoch", "health", "stream replicas"),
            (
                (
                    n.node_id,
                    n.owner,
                    n.epoch,
                    "up" if n.alive else "DOWN",
                    (replicas or {}).get(n.node_id, "?"),
                )
                for n in sorted(shards, key=lambda n: n.node_id)
            ),
        )
    lines += ["", "gateways:"]
    lines += _table(
        ("gateway", "zone", "health", "load", "endpoints"),
        (
            (
                g.get("gateway_id", "?"),
                g.get("zone", ""),
                "up" if g.get("healthy", True) else "DOWN",
                g.get("load", ""),
                " ".join(
                    f"{e.get('protocol')}={e.get('host')}:{e.get('port')}"
                    for e in g.get("endpoints", ())
                ),
            )
            for g in gateways
        ),
    )
    lines += ["", "namespace homes:"]
    lines += _table(("namespace", "node"), sorted(routes.homes.items()))
    lines += ["", "topic placement:"]
    lines += _table(
        ("namespace", "topic", "node"),
        ((ns, topic, node) for (ns, topic), node in sorted(routes.topics.items())),
    )
    return "\n".join(lines)


def read_supervisor(path: Path) -> dict[str, Any] | None:
    """The status file of a ``cluster up``, or None when there is none (or it cannot
    be read: the rest of the report does not need it)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, but alive
        return True
    return True


def _for(now_ms: int, since_ms: object) -> str:
    return f"{max(0, now_ms - since_ms) / 1000:.1f} s" if isinstance(since_ms, int) else ""


def _ago(now_ms: int, at_ms: object) -> str:
    return f"{_for(now_ms, at_ms)} ago" if isinstance(at_ms, int) else ""


def render_processes(
    supervisor: dict[str, Any], now_ms: int, alive: Callable[[object], bool] = _pid_alive
) -> list[str]:
    """The supervisor's table; pure but for ``alive`` (is the supervisor running)."""
    pid = supervisor.get("supervisor_pid")
    if not supervisor.get("running"):
        state = "stopped"
    elif alive(pid):
        state = "running"
    else:
        state = "NOT RUNNING, its last report"
    lines = [f"processes (cluster up, supervisor pid {pid}: {state}):"]

    def last_exit(child: dict[str, Any]) -> str:
        exit_ = child.get("last_exit")
        if not isinstance(exit_, dict):
            return "-"
        return f"{exit_.get('reason', '?')}, {_ago(now_ms, exit_.get('at_ms'))}"

    lines += _table(
        ("process", "pid", "state", "up for", "restarts", "last exit"),
        (
            (
                c.get("name", "?"),
                c.get("pid", "?"),
                c.get("state", "?"),
                _for(now_ms, c.get("started_ms")) if c.get("state") == "running" else "-",
                c.get("restarts", 0),
                last_exit(c),
            )
            for c in supervisor.get("children", ())
            if isinstance(c, dict)
        ),
    )
    return lines


async def show(nameserver: str, navigation: str, supervisor: dict[str, Any] | None = None) -> int:
    """Print the report (the supervisor's table first, when there is one); 1 when the
    nameserver cannot be reached (navigation being down is reported, not fatal)."""
    import time

    if supervisor is not None:
        print("\n".join(render_processes(supervisor, int(time.time() * 1000))) + "\n")

    from polymq.nameserver.client import NameserverClient
    from polymq.storage.errors import StorageError

    client = NameserverClient([nameserver])
    try:
        routes = await client.status()
    except StorageError as e:
        print(f"polymq cluster status: nameserver {nameserver}: {e}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    gateways: list[dict[str, Any]] = []
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            reply = await http.get(f"{navigation.rstrip('/')}/v1/gateways")
            reply.raise_for_status()
            body = reply.json()
            gateways = list(body.get("gateways", body) if isinstance(body, dict) else body)
    except (httpx.HTTPError, ValueError) as e:
        print(f"(navigation {navigation} did not answer: {e})", file=sys.stderr)
    replicas = None
    nats_servers = (supervisor or {}).get("nats") or []
    shards = [n.node_id for n in routes.nodes if n.owner]
    if nats_servers and shards:
        from polymq.storage.replicated.health import replica_health

        replicas = await replica_health(nats_servers, shards)
    print(render(routes, gateways, int(time.time() * 1000), replicas))
    return 0
