from __future__ import annotations

import pytest

from polymq.gateway.accounts import (
    ANONYMOUS,
    AccessDenied,
    Accounts,
    AuthenticationFailed,
    Principal,
)
from polymq.gateway.config import AccountConfig, AuthConfig

ALICE = AccountConfig(
    user="alice",
    password="s3cret",
    access_key="AK-alice",
    secret_key="SK-alice",
    namespaces=("alice", "shared"),
)
BOB = AccountConfig(user="bob", password="hunter2", default_namespace=None)
OPS = AccountConfig(user="ops", password="root", namespaces=("ops",), admin=True)
KEY_ONLY = AccountConfig(user="mns-app", access_key="AK-app", secret_key="SK-app")


@pytest.fixture
def accounts() -> Accounts:
    return Accounts(AuthConfig(mode="accounts", accounts=(ALICE, BOB, OPS, KEY_ONLY)))


async def test_password_ok(accounts: Accounts) -> None:
    principal = await accounts.authenticate("alice", "s3cret", protocol="test")
    assert principal == Principal(
        name="alice",
        namespaces=frozenset({"alice", "shared"}),
        default_namespace="alice",
        admin=False,
    )


async def test_default_namespace_defaults_to_default(accounts: Accounts) -> None:
    bob = await accounts.authenticate("bob", "hunter2", protocol="test")
    assert bob.default_namespace == "default"
    assert bob.namespaces == frozenset({"default"})


@pytest.mark.parametrize(
    ("user", "password"),
    [
        ("alice", "wrong"),
        ("alice", ""),
        ("alice", None),
        ("nobody", "s3cret"),
        (None, None),
        ("mns-app", ""),  # an account without a password cannot log in with none
        ("mns-app", "\0unusable"),
    ],
)
async def test_password_bad(accounts: Accounts, user: str | None, password: str | None) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        await accounts.authenticate(user, password, protocol="test")
    assert str(info.value) == "bad user name or password"  # never says which part


async def test_access_key_lookup(accounts: Accounts) -> None:
    key = accounts.access_key("AK-alice")
    assert key.secret_key == "SK-alice"
    assert key.principal == await accounts.authenticate("alice", "s3cret", protocol="test")
    assert accounts.access_key("AK-app").principal.name == "mns-app"
    with pytest.raises(AuthenticationFailed):
        accounts.access_key("AK-unknown")
    with pytest.raises(AuthenticationFailed):
        accounts.access_key(None)


async def test_authorize(accounts: Accounts) -> None:
    alice = await accounts.authenticate("alice", "s3cret", protocol="test")
    accounts.authorize(alice, "alice")
    accounts.authorize(alice, "shared")
    with pytest.raises(AccessDenied, match="'alice' may not use namespace 'bob'"):
        accounts.authorize(alice, "bob")
    ops = await accounts.authenticate("ops", "root", protocol="test")
    accounts.authorize(ops, "anything")  # admins may use every namespace


def test_configured_namespaces(accounts: Accounts) -> None:
    assert accounts.namespaces() == frozenset({"alice", "shared", "default", "ops"})


async def test_open_mode_accepts_anyone() -> None:
    accounts = Accounts(AuthConfig(mode="open", accounts=(ALICE,)))
    assert accounts.open
    for user, password in [(None, None), ("alice", "wrong"), ("x", "y")]:
        assert await accounts.authenticate(user, password, protocol="test") is ANONYMOUS
    assert ANONYMOUS.name == "anonymous"
    assert ANONYMOUS.default_namespace == "default"
    accounts.authorize(ANONYMOUS, "any-namespace")
    key = accounts.access_key("whatever")
    assert key.principal is ANONYMOUS
    assert key.secret_key is None  # no signature to check


def test_errors_carry_stable_codes() -> None:
    assert AuthenticationFailed.code == "authentication_failed"
    assert AccessDenied.code == "access_denied"
