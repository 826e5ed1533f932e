"""The admin API's view of the storage pool (docs/admin.md): ``GET /admin/nodes``
lists the storage nodes the nameservers know, with their health, load and topic
counts, and the shards of the replicated pool with their owners and lease epochs,
as ``polymq cluster status`` shows them. The merged form has no pool: its one
embedded engine is named instead.

Asked of the nameservers in the configuration at each request (soft state, cheap:
one RPC), never of storage itself.
"""

from __future__ import annotations

import time
from collections import Counter
from ssl import SSLContext
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from polymq.gateway.tls import internal_tls
from polymq.nameserver.client import NameserverClient
from polymq.protocols.http.admin_scope import AdminScope
from polymq.storage.errors import StorageError

__all__ = ["pool_router"]

_TIMEOUT_S = 2.0


def pool_router(scope: AdminScope) -> APIRouter:
    router = APIRouter(tags=["admin"])
    config = scope.context.config
    ssl: list[SSLContext | None] = []  # [tls] internal's client context, loaded once

    @router.get("/nodes", summary="Storage nodes and shards, as the nameservers know them")
    async def nodes(request: Request) -> dict[str, Any]:
        """``form`` is ``merged`` (one embedded engine, no nodes) or ``separated``;
        ``shards`` lists the nodes that own a shard of the replicated pool."""
        await scope.principal(request)
        nameservers = config.cluster.nameservers
        if not nameservers:
            return {"form": "merged", "route_version": None, "nodes": [], "shards": []}
        if not ssl:
            tls = internal_tls(config.tls)
            ssl.append(tls.client if tls is not None else None)
        client = NameserverClient(nameservers, timeout_s=_TIMEOUT_S, ssl=ssl[0])
        try:
            routes = await client.status()
        except StorageError as e:
            raise HTTPException(503, f"no nameserver answered: {e}") from None
        finally:
            await client.close()
        now_ms = int(time.time() * 1000)
        topics = Counter(routes.topics.values())
        shown = [
            {
                "node_id": n.node_id,
                "address": f"{n.host}:{n.port}",
                "alive": n.alive,
                "load": n.load,
                "disk_free_bytes": n.disk_free_bytes,
                "topics": topics.get(n.node_id, 0),
                "last_seen_ms_ago": max(0, now_ms - n.last_seen_ms),
                "owner": n.owner or None,
                "epoch": n.epoch,
            }
            for n in sorted(routes.nodes, key=lambda n: n.node_id)
        ]
        return {
            "form": "separated",
            "route_version": routes.version,
            "nodes": shown,
            "shards": [n for n in shown if n["owner"]],
        }

    return router
