"""The admin API's permission rules (docs/permissions.md): ``GET /admin/permissions``
lists the rules of the namespaces the caller may see (an account that is no admin sees
only its own), ``POST`` adds a rule (kept in storage, as Kafka's CreateAcls does) and
``DELETE /admin/permissions/{namespace}/{key}`` removes a stored one; adding and
deleting are for admin accounts (anyone in open mode, where nobody is checked). The
configuration's rules are listed with ``"source": "config"`` and cannot be deleted."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response

from polymq.gateway.accounts import Principal
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.permissions import Rule, RuleError
from polymq.gateway.processor import Caller

__all__ = ["permissions_router"]

_PROTOCOL = "http"

PrincipalOf = Callable[[ListenerContext, Request], Awaitable[Principal]]


def _shown(rule: Rule, source: str) -> dict[str, Any]:
    return {**rule.to_json(), "key": rule.key, "source": source}


def permissions_router(context: ListenerContext, principal_of: PrincipalOf) -> APIRouter:
    # Included into the admin router, which adds /admin.
    router = APIRouter(tags=["admin"])
    processor = context.processor
    permissions = processor.permissions

    async def visible(principal: Principal) -> list[str]:
        base = Caller(
            principal=principal, namespace=principal.default_namespace, protocol=_PROTOCOL
        )
        return await processor.list_namespaces(base)

    async def admin(request: Request) -> Principal:
        principal = await principal_of(context, request)
        if not principal.admin:
            raise HTTPException(403, "only admin accounts manage permission rules")
        return principal

    @router.get("/permissions", summary="Permission rules, configured and stored")
    async def list_rules(request: Request, namespace: str | None = None) -> dict[str, Any]:
        principal = await principal_of(context, request)
        names = await visible(principal)
        if namespace is not None:
            if namespace not in names:
                raise HTTPException(404, f"no namespace {namespace!r} is visible to you")
            names = [namespace]
        rules: list[dict[str, Any]] = []
        for name in names:
            shown = [(r, "config") for r in permissions.configured(name)]
            shown += [(r, "stored") for r in await permissions.stored(name)]
            rules.extend(
                _shown(rule, source)
                for rule, source in shown
                if principal.admin or rule.principal == principal.name
            )
        return {"rules": rules}

    @router.post("/permissions", status_code=201, summary="Add a permission rule")
    async def add_rule(request: Request) -> dict[str, Any]:
        """The body is a rule as listed: principal, namespace, resource, pattern,
        match, operations, effect."""
        principal = await admin(request)
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise RuleError("the body must be a JSON object")
            rule = Rule.from_json(body)
        except (ValueError, RuleError) as e:
            raise HTTPException(400, f"not a rule: {e}") from None
        if rule.namespace not in await visible(principal):
            raise HTTPException(404, f"no namespace {rule.namespace!r}")
        await permissions.add(rule)
        return _shown(rule, "stored")

    @router.delete(
        "/permissions/{namespace}/{key}", status_code=204, summary="Delete a stored rule"
    )
    async def delete_rule(request: Request, namespace: str, key: str) -> Response:
        principal = await admin(request)
        if namespace not in await visible(principal):
            raise HTTPException(404, f"no namespace {namespace!r}")
        if any(r.key == key for r in permissions.configured(namespace)):
            raise HTTPException(409, "configured rules are read-only")
        for rule in await permissions.stored(namespace):
            if rule.key == key and await permissions.remove(rule):
                return Response(status_code=204)
        raise HTTPException(404, f"no stored rule {key!r} in namespace {namespace!r}")

    return router
