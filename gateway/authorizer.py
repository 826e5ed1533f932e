"""Where permission rules come from, and the one check every protocol calls.

Rules are the accounts' configured ones (read-only, in :class:`~gateway.accounts.Principal`)
and those added at run time (Kafka's CreateAcls, the admin API), kept as storage
metadata of the namespace they govern (kind ``acl``, named by the rule's key) so they
survive restarts and every gateway of the separated form reads the same ones. A
gateway caches a namespace's stored rules for :data:`REFRESH_MS`: a rule added through
another gateway applies here within that time, one added here at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from polymq.gateway.accounts import AccessDenied, Principal
from polymq.gateway.permissions import Operation, ResourceKind, Rule, RuleError, decide
from polymq.storage.api import StorageAPI
from polymq.storage.clock import Clock
from polymq.storage.errors import StorageError

__all__ = ["ACL_KIND", "REFRESH_MS", "Authorizer"]

log = logging.getLogger(__name__)

ACL_KIND = "acl"
# How stale another gateway's view of a namespace's stored rules may be. Short, since
# a revoked permission should stop working soon; each refresh is one metadata read
# per namespace in use, and only for accounts that are not admins.
REFRESH_MS = 1000


class Authorizer:
    """Decides whether a principal may do an operation on a resource of a namespace."""

    def __init__(self, storage: StorageAPI, clock: Clock, configured: Iterable[Rule] = ()) -> None:
        self._storage = storage
        self._clock = clock
        self._configured = tuple(configured)
        self._cache: dict[str, tuple[int, tuple[Rule, ...]]] = {}
        self._loading: dict[str, asyncio.Future[tuple[Rule, ...]]] = {}

    # -- the check -----------------------------------------------------------------

    async def allowed(
        self,
        principal: Principal,
        namespace: str,
        kind: ResourceKind,
        name: str,
        operation: Operation,
    ) -> bool:
        """Admins may do everything; nobody may act in a namespace it may not use;
        otherwise :func:`~gateway.permissions.decide` over the principal's rules, no
        rules meaning the whole namespace."""
        if principal.admin:
            return True
        if not principal.may_use(namespace):
            return False
        rules = await self.rules_of(principal, namespace)
        verdict = decide(rules, kind, name, operation)
        return True if verdict is None else verdict

    async def check(
        self,
        principal: Principal,
        namespace: str,
        kind: ResourceKind,
        name: str,
        operation: Operation,
    ) -> None:
        """:meth:`allowed`, raising :class:`AccessDenied` (each protocol maps it to its
        own error) when not."""
        if not await self.allowed(principal, namespace, kind, name, operation):
            raise AccessDenied(
                f"{principal.name!r} may not {operation} {kind.replace('_', ' ')} "
                f"{name!r} in namespace {namespace!r}",
                resource=kind,
            )

    async def rules_of(self, principal: Principal, namespace: str) -> list[Rule]:
        own = [r for r in principal.permissions if r.namespace == namespace]
        stored = await self.stored(namespace)
        own.extend(r for r in stored if r.principal == principal.name)
        return own

    # -- listing and editing -------------------------------------------------------

    def configured(self, namespace: str | None = None) -> list[Rule]:
        """The configuration's rules (read-only), of one namespace or all."""
        return [r for r in self._configured if namespace is None or r.namespace == namespace]

    async def stored(self, namespace: str) -> tuple[Rule, ...]:
        """The namespace's rules kept in storage, as of at most :data:`REFRESH_MS` ago."""
        cached = self._cache.get(namespace)
        if cached is not None and self._clock.now_ms() - cached[0] < REFRESH_MS:
            return cached[1]
        loading = self._loading.get(namespace)
        if loading is None:
            loading = asyncio.ensure_future(self._load(namespace))
            self._loading[namespace] = loading
            loading.add_done_callback(lambda _: self._loading.pop(namespace, None))
        try:
            return await asyncio.shield(loading)
        except StorageError:
            if cached is not None:
                # Storage out of reach for a moment: the last rules read still hold
                # (never none, which could let through what a rule denies).
                log.warning("permissions: keeping the stored rules of %r read earlier", namespace)
                return cached[1]
            raise

    async def _load(self, namespace: str) -> tuple[Rule, ...]:
        entries = await self._storage.meta_list(namespace, ACL_KIND)
        rules: list[Rule] = []
        for name, value in entries.items():
            try:
                rules.append(Rule.from_json(value))
            except RuleError as e:
                log.error("permissions: stored rule %s of %r is unreadable: %s", name, namespace, e)
        loaded = tuple(sorted(rules, key=lambda r: r.key))
        self._cache[namespace] = (self._clock.now_ms(), loaded)
        return loaded

    async def add(self, rule: Rule) -> None:
        """Keep ``rule`` in storage (adding an equal rule again changes nothing)."""
        await self._storage.meta_put(rule.namespace, ACL_KIND, rule.key, rule.to_json())
        self._cache.pop(rule.namespace, None)

    async def remove(self, rule: Rule) -> bool:
        """Delete a stored rule; configured rules are not stored and stay."""
        removed = await self._storage.meta_delete(rule.namespace, ACL_KIND, rule.key)
        self._cache.pop(rule.namespace, None)
        return removed
