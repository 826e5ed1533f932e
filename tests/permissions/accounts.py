"""One server configuration for every permission test: accounts with rules in
namespace ``shop``, an admin, an account without rules, and a tenant of another
namespace (docs/permissions.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polymq.gateway.config import AccountConfig, AuthConfig, PermissionConfig
from tests.live_server import LiveServer, live_server, server_config

SHOP = "shop"
OTHER = "other"
PASSWORD = "pw-secret"


def _account(
    user: str, namespace: str, *rules: PermissionConfig, admin: bool = False
) -> AccountConfig:
    return AccountConfig(
        user=user,
        password=PASSWORD,
        access_key=f"{user}-ak",
        secret_key=f"{user}-sk",
        namespaces=(namespace,),
        admin=admin,
        permissions=rules,
    )


def allow(resource: str, pattern: str, *operations: str, match: str = "glob") -> PermissionConfig:
    return PermissionConfig(
        resource=resource,  # type: ignore[arg-type]
        pattern=pattern,
        operations=operations,
        match=match,  # type: ignore[arg-type]
    )


# reader: reads data-* (any group); writer: writes and creates data-*, transactional
# ids tx-ok*; viewer: reads data-* but only describes groups; guest: no rules (the
# whole namespace); ops: admin; outsider: namespace "other" only.
ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(
        _account("reader", SHOP, allow("topic", "data-*", "read"), allow("group", "*", "read")),
        _account(
            "writer",
            SHOP,
            allow("topic", "data-*", "write", "create"),
            allow("transactional_id", "tx-ok", "write", match="prefix"),
        ),
        _account("viewer", SHOP, allow("topic", "data-*", "read"), allow("group", "*", "describe")),
        _account("guest", SHOP),
        _account("ops", SHOP, admin=True),
        _account("outsider", OTHER),
    ),
)


@contextmanager
def permission_server(data_dir: Path, listeners: tuple[str, ...]) -> Iterator[LiveServer]:
    config = dataclasses.replace(server_config(data_dir, listeners), auth=ACCOUNTS)
    with live_server(data_dir, listeners, config=config) as server:
        yield server
