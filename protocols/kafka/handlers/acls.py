"""DescribeAcls, CreateAcls and DeleteAcls over polymq's one permission model
(docs/permissions.md): a Kafka ACL binding is a :class:`~gateway.permissions.Rule` of
the connection's namespace.

* resource type TOPIC, GROUP, TRANSACTIONAL_ID are the model's kinds; pattern LITERAL
  (``*`` for every name) and PREFIXED its ``literal`` and ``prefix`` matches;
* principal ``User:<account>``, host ``*`` only (the model has no hosts);
* operations READ, WRITE, CREATE, DELETE, DESCRIBE are the model's; ALTER and
  ALTER_CONFIGS are ``admin``, DESCRIBE_CONFIGS is ``describe``, ALL all of them;
* ALLOW and DENY its effects.

Created bindings are kept in storage (each one rule), so they survive restarts and
every gateway applies them; the configuration's rules are listed too but never
deleted. Only admin accounts manage ACLs (CLUSTER_AUTHORIZATION_FAILED otherwise); in
open mode, where nobody is checked, Kafka's own answer: SECURITY_DISABLED.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.gateway.permissions import (
    OPERATIONS,
    Effect,
    Operation,
    ResourceKind,
    Rule,
    RuleError,
)
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.kafka.session import Session
from polymq.storage.errors import StorageError

__all__ = ["create_acls", "delete_acls", "describe_acls"]

log = logging.getLogger(__name__)

# org.apache.kafka.common.resource.ResourceType / PatternType, acl.AclOperation /
# AclPermissionType codes.
_ANY = 1
_MATCH = 2
_LITERAL, _PREFIXED = 3, 4
_KINDS: dict[int, ResourceKind] = {2: "topic", 3: "group", 5: "transactional_id"}
_KIND_CODES = {kind: code for code, kind in _KINDS.items()}
_ALL_OPS = 2
_OPS: dict[int, frozenset[Operation]] = {
    _ALL_OPS: frozenset(OPERATIONS),
    3: frozenset({"read"}),
    4: frozenset({"write"}),
    5: frozenset({"create"}),
    6: frozenset({"delete"}),
    7: frozenset({"admin"}),  # ALTER
    8: frozenset({"describe"}),
    10: frozenset({"describe"}),  # DESCRIBE_CONFIGS
    11: frozenset({"admin"}),  # ALTER_CONFIGS
}
_OP_CODES: dict[Operation, int] = {
    "read": 3,
    "write": 4,
    "create": 5,
    "delete": 6,
    "admin": 7,
    "describe": 8,
}
_DENY, _ALLOW = 2, 3
_EFFECTS: dict[int, Effect] = {_DENY: "deny", _ALLOW: "allow"}
_USER = "User:"
_ANY_HOST = "*"


class _Invalid(ValueError):
    """A binding the model cannot hold (its message is the client's error message)."""


@dataclass(frozen=True, slots=True)
class _Binding:
    """One Kafka ACL binding, as DescribeAcls and DeleteAcls show it."""

    resource_type: int
    resource_name: str
    pattern_type: int
    principal: str
    operation: int
    permission_type: int

    def acl(self) -> dict[str, Any]:
        return {
            "principal": self.principal,
            "host": _ANY_HOST,
            "operation": self.operation,
            "permission_type": self.permission_type,
        }


def _rule(namespace: str, creation: Any) -> Rule:
    """The model's rule for a CreateAcls binding."""
    kind = _KINDS.get(creation.resource_type)
    if kind is None:
        raise _Invalid("only TOPIC, GROUP and TRANSACTIONAL_ID resources are supported")
    if creation.resource_pattern_type not in (_LITERAL, _PREFIXED):
        raise _Invalid("the pattern type must be LITERAL or PREFIXED")
    if not creation.principal.startswith(_USER) or creation.principal == _USER:
        raise _Invalid("the principal must be User:<name>")
    if creation.host != _ANY_HOST:
        raise _Invalid("only host '*' is supported")
    operations = _OPS.get(creation.operation)
    if operations is None:
        raise _Invalid("unsupported operation")
    effect = _EFFECTS.get(creation.permission_type)
    if effect is None:
        raise _Invalid("the permission type must be ALLOW or DENY")
    try:
        return Rule(
            principal=creation.principal.removeprefix(_USER),
            namespace=namespace,
            resource=kind,
            pattern=creation.resource_name,
            match="literal" if creation.resource_pattern_type == _LITERAL else "prefix",
            operations=operations,
            effect=effect,
        )
    except RuleError as e:
        raise _Invalid(str(e)) from None


def _bindings(rule: Rule) -> list[_Binding]:
    """How Kafka sees a rule: one binding per operation (ALL for all of them); glob
    rules other than ``*`` and ``prefix*`` have no Kafka form and are not shown."""
    if rule.match == "glob":
        if rule.pattern == "*":
            pattern_type, name = _LITERAL, "*"
        elif rule.pattern.endswith("*") and not any(c in rule.pattern[:-1] for c in "*?["):
            pattern_type, name = _PREFIXED, rule.pattern[:-1]
        else:
            return []
    else:
        pattern_type = _LITERAL if rule.match == "literal" else _PREFIXED
        name = rule.pattern
    codes = (
        [_ALL_OPS]
        if rule.operations == frozenset(OPERATIONS)
        else sorted(_OP_CODES[op] for op in rule.operations)
    )
    return [
        _Binding(
            _KIND_CODES[rule.resource],
            name,
            pattern_type,
            _USER + rule.principal,
            code,
            _ALLOW if rule.effect == "allow" else _DENY,
        )
        for code in codes
    ]


def _selects(f: Any, binding: _Binding) -> bool:
    """Whether a DescribeAcls request or DeleteAcls filter selects ``binding``
    (ANY for any value, MATCH for the bindings that apply to the named resource)."""
    if f.resource_type_filter not in (_ANY, binding.resource_type):
        return False
    if f.pattern_type_filter == _MATCH and f.resource_name_filter is not None:
        name = f.resource_name_filter
        applies = (
            binding.resource_name in (name, "*")
            if binding.pattern_type == _LITERAL
            else name.startswith(binding.resource_name)
        )
        if not applies:
            return False
    else:
        if f.pattern_type_filter not in (_ANY, _MATCH, binding.pattern_type):
            return False
        if f.resource_name_filter is not None and f.resource_name_filter != binding.resource_name:
            return False
    if f.principal_filter is not None and f.principal_filter != binding.principal:
        return False
    if f.host_filter not in (None, _ANY_HOST):
        return False
    if f.operation not in (_ANY, binding.operation):
        return False
    return f.permission_type in (_ANY, binding.permission_type)


def _refusal(session: Session) -> ErrorCode | None:
    if session.services.accounts.open:
        return ErrorCode.security_disabled
    if not session.caller.principal.admin:
        return ErrorCode.cluster_authorization_failed
    return None


async def _rules(session: Session) -> tuple[list[Rule], list[Rule]]:
    """The namespace's configured and stored rules."""
    permissions = session.processor.permissions
    return permissions.configured(session.namespace), list(
        await permissions.stored(session.namespace)
    )


def _described(bindings: Iterable[_Binding]) -> list[dict[str, Any]]:
    by_resource: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for b in bindings:
        key = (b.resource_type, b.resource_name, b.pattern_type)
        by_resource.setdefault(key, []).append(b.acl())
    return [
        {"resource_type": t, "resource_name": n, "pattern_type": p, "acls": acls}
        for (t, n, p), acls in sorted(by_resource.items())
    ]


async def describe_acls(session: Session, request: Any, version: int) -> dict[str, Any]:
    refused = _refusal(session)
    if refused is not None:
        return {"throttle_time": 0, "error_code": refused, "resources": []}
    try:
        configured, stored = await _rules(session)
    except (StorageError, AuthError) as e:
        return {"throttle_time": 0, "error_code": error_code(e), "error_message": str(e)}
    found = {b for rule in configured + stored for b in _bindings(rule) if _selects(request, b)}
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "error_message": None,
        "resources": _described(found),
    }


async def create_acls(session: Session, request: Any, version: int) -> dict[str, Any]:
    refused = _refusal(session)
    results: list[dict[str, Any]] = []
    for creation in request.creations:
        if refused is not None:
            results.append({"error_code": refused, "error_message": None})
            continue
        try:
            await session.processor.permissions.add(_rule(session.namespace, creation))
        except _Invalid as e:
            results.append({"error_code": ErrorCode.invalid_request, "error_message": str(e)})
        except (StorageError, AuthError) as e:
            results.append({"error_code": error_code(e), "error_message": str(e)})
        else:
            results.append({"error_code": ErrorCode.none, "error_message": None})
    return {"throttle_time": 0, "results": results}


async def delete_acls(session: Session, request: Any, version: int) -> dict[str, Any]:
    """Deletes the stored rules any of whose bindings a filter selects (a rule of
    several operations goes whole); configured rules are never deleted."""
    refused = _refusal(session)
    results: list[dict[str, Any]] = []
    for f in request.filters:
        if refused is not None:
            results.append({"error_code": refused, "error_message": None, "matching_acls": []})
            continue
        try:
            _, stored = await _rules(session)
            matching: list[dict[str, Any]] = []
            for rule in stored:
                selected = [b for b in _bindings(rule) if _selects(f, b)]
                if selected and await session.processor.permissions.remove(rule):
                    matching.extend(
                        {
                            "error_code": ErrorCode.none,
                            "error_message": None,
                            "resource_type": b.resource_type,
                            "resource_name": b.resource_name,
                            "pattern_type": b.pattern_type,
                            **b.acl(),
                        }
                        for b in selected
                    )
        except (StorageError, AuthError) as e:
            results.append({"error_code": error_code(e), "error_message": str(e)})
            continue
        results.append(
            {"error_code": ErrorCode.none, "error_message": None, "matching_acls": matching}
        )
    return {"throttle_time": 0, "filter_results": results}
