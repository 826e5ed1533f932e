"""The permission model alone (gateway/permissions.py), its configuration keys, and the
Authorizer's storage-kept rules over an in-memory engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from polymq.gateway.accounts import AccessDenied, Accounts, Principal
from polymq.gateway.authorizer import Authorizer
from polymq.gateway.config import ConfigError, load_config
from polymq.gateway.permissions import Rule, RuleError, decide, expand_operations
from polymq.storage.clock import ManualClock
from polymq.storage.engine import Engine
from polymq.storage.engine.config import EngineConfig


def _rule(
    pattern: str, *ops: str, match: str = "glob", effect: str = "allow", kind: str = "topic"
) -> Rule:
    return Rule(
        principal="alice",
        namespace="ns",
        resource=kind,  # type: ignore[arg-type]
        pattern=pattern,
        match=match,  # type: ignore[arg-type]
        operations=expand_operations(ops),
        effect=effect,  # type: ignore[arg-type]
    )


def test_no_rules_means_the_namespace_default() -> None:
    assert decide([], "topic", "t", "write") is None


def test_matching() -> None:
    assert _rule("orders.*", "read").matches("topic", "orders.eu")
    assert not _rule("orders.*", "read").matches("topic", "order")
    assert not _rule("orders.*", "read").matches("group", "orders.eu")
    assert _rule("orders.", "read", match="prefix").matches("topic", "orders.eu")
    assert _rule("*", "read", match="literal").matches("topic", "anything")  # Kafka's *
    assert not _rule("orders", "read", match="literal").matches("topic", "orders.eu")


def test_deny_wins_and_allow_implies_describe() -> None:
    rules = [_rule("orders.*", "read", "write"), _rule("orders.secret", "write", effect="deny")]
    assert decide(rules, "topic", "orders.eu", "write") is True
    assert decide(rules, "topic", "orders.secret", "write") is False
    assert decide(rules, "topic", "orders.secret", "read") is True
    assert decide(rules, "topic", "orders.eu", "describe") is True  # implied
    assert decide(rules, "topic", "orders.eu", "delete") is False
    assert decide(rules, "topic", "other", "read") is False  # rules: default deny
    assert decide(rules, "group", "g", "read") is False


def test_bad_rules_are_refused() -> None:
    with pytest.raises(RuleError):
        expand_operations(["reed"])
    with pytest.raises(RuleError):
        Rule.from_json(
            {
                "principal": "a",
                "namespace": "n",
                "resource": "queue",
                "pattern": "x",
                "operations": ["read"],
            }
        )
    rule = _rule("x*", "all", effect="deny")
    assert Rule.from_json(rule.to_json()) == rule
    assert rule.key == Rule.from_json(rule.to_json()).key


def test_configuration(tmp_path: Path) -> None:
    path = tmp_path / "polymq.toml"
    path.write_text(
        """
[auth]
mode = "accounts"
[[auth.accounts]]
user = "alice"
password = "p"
namespaces = ["shop"]
permissions = [
  {resource = "topic", pattern = "orders.*", operations = ["read"]},
  {resource = "group", pattern = "g-", match = "prefix", operations = ["all"], effect = "deny"},
]
"""
    )
    accounts = Accounts(load_config(path, env={}).auth)
    rules = accounts.rules()
    assert [(r.namespace, r.resource, r.match, r.effect) for r in rules] == [
        ("shop", "topic", "glob", "allow"),
        ("shop", "group", "prefix", "deny"),
    ]
    path.write_text(path.read_text().replace('["read"]', '["reed"]'))
    with pytest.raises(ConfigError, match=r"permissions\[0\].*unknown operation 'reed'"):
        load_config(path, env={})


async def test_stored_rules_apply_and_survive_a_new_authorizer(tmp_path: Path) -> None:
    alice = Principal(name="alice", namespaces=frozenset({"ns"}), default_namespace="ns")
    clock = ManualClock()
    engine = Engine(EngineConfig(data_dir=tmp_path / "data"), clock=clock)
    await engine.start()
    try:
        await engine.create_namespace("ns")
        authorizer = Authorizer(engine, clock)
        assert await authorizer.allowed(alice, "ns", "topic", "t", "write")  # no rules
        rule = _rule("t", "write", match="literal", effect="deny")
        await authorizer.add(rule)
        with pytest.raises(AccessDenied) as caught:
            await authorizer.check(alice, "ns", "topic", "t", "write")
        assert caught.value.resource == "topic"
        # Another gateway's authorizer over the same storage sees it.
        assert not await Authorizer(engine, clock).allowed(alice, "ns", "topic", "t", "write")
        assert not await authorizer.allowed(
            alice, "other", "topic", "t", "read"
        )  # not its namespace
        assert await authorizer.remove(rule)
        assert await authorizer.allowed(alice, "ns", "topic", "t", "write")
    finally:
        await engine.close()
