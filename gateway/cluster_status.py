"""``polymq cluster status``: what a nameserver and the navigation service know, as
tables an operator reads at a glance: storage nodes and their health, gateways and
their endpoints, and which node holds each topic."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from polymq.storage.routes import RouteTable

__all__ = ["render", "show"]


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


def render(routes: RouteTable, gateways: Sequence[dict[str, Any]], now_ms: int) -> str:
    """The whole report; pure, so it is tested without a cluster."""
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


async def show(nameserver: str, navigation: str) -> int:
    """Print the report; 1 when the nameserver cannot be reached (navigation being
    down is reported, not fatal)."""
    import time

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
    print(render(routes, gateways, int(time.time() * 1000)))
    return 0
