"""One permission model for every protocol: who may do what to which resource.

A :class:`Rule` allows or denies an account some operations on the resources of one
kind whose names match a pattern, in one namespace (RabbitMQ's configure/write/read
per vhost, Kafka's ACL bindings). :func:`decide` is the whole policy:

* an account with no rule in a namespace keeps the namespace-wide behaviour (it may
  do everything in the namespaces it may use), so configurations written before rules
  existed keep working;
* an account with rules may do only what an ``allow`` rule grants, and nothing a
  ``deny`` rule names: deny wins over allow;
* any allowed operation implies ``describe`` (Kafka's READ, WRITE, DELETE and ALTER
  imply DESCRIBE), so a consumer allowed to read a topic also sees it listed;
* ``admin`` accounts never reach this module (the caller lets them through).

Pure: no I/O. Where rules come from (the account's configuration, storage metadata
written by Kafka's CreateAcls or the admin API) is :mod:`gateway.authorizer`'s job.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "EFFECTS",
    "MATCHES",
    "OPERATIONS",
    "RESOURCE_KINDS",
    "Effect",
    "Match",
    "Operation",
    "ResourceKind",
    "Rule",
    "RuleError",
    "decide",
    "expand_operations",
]

# ``topic`` names topics, AMQP exchanges and queues, MQTT first topic levels, RocketMQ
# topics and MNS queues and topics: one storage name space, one kind (an exchange T
# and a Kafka topic T are the same storage topic, docs/interop.md).
ResourceKind = Literal["topic", "group", "transactional_id"]
Operation = Literal["create", "write", "read", "describe", "delete", "admin"]
# literal: the name itself, "*" being every name (Kafka's LITERAL); prefix: names that
# start with the pattern (Kafka's PREFIXED); glob: fnmatch's * ? [...] over the whole
# name (RabbitMQ's regular expressions, in the shell's easier spelling).
Match = Literal["literal", "prefix", "glob"]
Effect = Literal["allow", "deny"]

RESOURCE_KINDS: tuple[ResourceKind, ...] = get_args(ResourceKind)
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
MATCHES: tuple[Match, ...] = get_args(Match)
EFFECTS: tuple[Effect, ...] = get_args(Effect)
ALL = "all"


class RuleError(ValueError):
    """A rule that cannot be built (an unknown kind, operation, match or effect)."""


def expand_operations(operations: Iterable[str]) -> frozenset[Operation]:
    """The operations named, ``all`` standing for every one."""
    expanded: set[Operation] = set()
    for op in operations:
        if op == ALL:
            expanded.update(OPERATIONS)
        elif op in OPERATIONS:
            expanded.add(op)
        else:
            raise RuleError(f"unknown operation {op!r} (one of {', '.join(OPERATIONS)}, all)")
    if not expanded:
        raise RuleError("a rule needs at least one operation")
    return frozenset(expanded)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Allow or deny ``principal`` (an account's user name) ``operations`` on the
    ``resource`` kind's names matching ``pattern`` in ``namespace``."""

    principal: str
    namespace: str
    resource: ResourceKind
    pattern: str
    match: Match = "literal"
    operations: frozenset[Operation]
    effect: Effect = "allow"

    def __post_init__(self) -> None:
        if self.resource not in RESOURCE_KINDS:
            raise RuleError(f"unknown resource kind {self.resource!r}")
        if self.match not in MATCHES:
            raise RuleError(f"unknown match {self.match!r} (one of {', '.join(MATCHES)})")
        if self.effect not in EFFECTS:
            raise RuleError(f"unknown effect {self.effect!r} (allow or deny)")
        if not self.pattern and self.match != "prefix":
            raise RuleError("an empty pattern matches nothing")
        if not self.principal or not self.namespace:
            raise RuleError("a rule names an account and a namespace")

    def matches(self, kind: ResourceKind, name: str) -> bool:
        """Whether this rule speaks of resource ``name`` of ``kind``."""
        if kind != self.resource:
            return False
        if self.match == "literal":
            return self.pattern == "*" or self.pattern == name
        if self.match == "prefix":
            return name.startswith(self.pattern)
        return fnmatch.fnmatchcase(name, self.pattern)

    @property
    def key(self) -> str:
        """A stable name for the rule (its storage metadata name): equal rules share
        it, so adding one twice stores it once."""
        digest = hashlib.blake2b(
            json.dumps(self.to_json(), sort_keys=True).encode(), digest_size=12
        ).hexdigest()
        return digest

    def to_json(self) -> dict[str, Any]:
        return {
            "principal": self.principal,
            "namespace": self.namespace,
            "resource": self.resource,
            "pattern": self.pattern,
            "match": self.match,
            "operations": sorted(self.operations),
            "effect": self.effect,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Rule:
        """A rule from :meth:`to_json`'s shape (storage, the admin API); raises
        :class:`RuleError` on anything else."""
        try:
            operations = value["operations"]
            if isinstance(operations, str) or not isinstance(operations, list | tuple):
                raise RuleError("'operations' must be a list")
            return cls(
                principal=str(value["principal"]),
                namespace=str(value["namespace"]),
                resource=value["resource"],
                pattern=str(value["pattern"]),
                match=value.get("match", "literal"),
                operations=expand_operations(operations),
                effect=value.get("effect", "allow"),
            )
        except KeyError as e:
            raise RuleError(f"a rule lacks {e.args[0]!r}") from None
        except TypeError as e:
            raise RuleError(str(e)) from None


def decide(
    rules: Iterable[Rule], kind: ResourceKind, name: str, operation: Operation
) -> bool | None:
    """Whether ``rules`` (one account's, in one namespace) allow ``operation`` on
    ``name``: ``None`` when there are no rules at all (the caller then applies the
    namespace-wide default), else a deny matching it wins, then any allow matching it
    (an allow of any operation also allows ``describe``), else no."""
    any_rule = False
    allowed = False
    for rule in rules:
        any_rule = True
        if not rule.matches(kind, name):
            continue
        if rule.effect == "deny":
            if operation in rule.operations:
                return False
        elif operation in rule.operations or operation == "describe":
            allowed = True
    if not any_rule:
        return None
    return allowed
