"""Who is connecting, and which namespaces (tenants) they may use.

Every protocol resolves its credentials here (SASL user, AMQP login, MQTT user name,
RocketMQ and MNS access keys), so there is one notion of a tenant across protocols.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.permissions import Rule, expand_operations
from polymq.storage.model import DEFAULT_NAMESPACE

__all__ = [
    "ANONYMOUS",
    "AccessDenied",
    "AccessKey",
    "Accounts",
    "AuthError",
    "AuthenticationFailed",
    "Principal",
]


class AuthError(Exception):
    """Base of the errors a peer provokes by who it is; ``code`` is stable so adapters
    map it to their wire error without parsing the message."""

    code = "auth_error"


class AuthenticationFailed(AuthError):
    """The credentials match no account. The message never says which part was wrong,
    so it does not help anyone guess user names."""

    code = "authentication_failed"


class AccessDenied(AuthError):
    code = "access_denied"


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """An authenticated identity. ``admin`` may use every namespace and create or
    delete namespaces; otherwise only those in ``namespaces``. ``permissions``: its
    configured rules (:mod:`gateway.permissions`), narrowing what it may do there."""

    name: str
    namespaces: frozenset[str]
    default_namespace: str
    admin: bool = False
    permissions: tuple[Rule, ...] = ()

    def may_use(self, namespace: str) -> bool:
        return self.admin or namespace in self.namespaces


# In open mode nobody is checked, so the one identity may do everything.
ANONYMOUS = Principal(
    name="anonymous",
    namespaces=frozenset({DEFAULT_NAMESPACE}),
    default_namespace=DEFAULT_NAMESPACE,
    admin=True,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessKey:
    """What a signed request (RocketMQ, MNS) needs: whose key it is and the secret to
    check the signature with. ``secret_key`` is ``None`` in open mode: no signature is
    checked then."""

    principal: Principal
    secret_key: str | None


class Accounts:
    """The configured accounts, looked up by user name or access key."""

    def __init__(self, config: AuthConfig) -> None:
        self._open = config.mode == "open"
        self._by_user: dict[str, tuple[AccountConfig, Principal]] = {}
        self._by_access_key: dict[str, AccessKey] = {}
        for account in config.accounts:
            principal = _principal(account)
            self._by_user[account.user] = (account, principal)
            if account.access_key is not None:
                self._by_access_key[account.access_key] = AccessKey(
                    principal=principal, secret_key=account.secret_key
                )

    @property
    def open(self) -> bool:
        return self._open

    def namespaces(self) -> frozenset[str]:
        """Namespaces named by any account: the gateway creates them at start-up."""
        named: set[str] = set()
        for account, _ in self._by_user.values():
            named.update(account.namespaces)
        return frozenset(named)

    def authenticate(self, username: str | None, password: str | None) -> Principal:
        """The principal for a user name and password; anyone in open mode.

        Always does one constant-time comparison, even for an unknown user, so the
        answer's timing does not tell which user names exist."""
        if self._open:
            return ANONYMOUS
        found = self._by_user.get(username or "")
        expected = found[0].password if found is not None else None
        ok = hmac.compare_digest(
            (expected if expected is not None else "\0unusable").encode(),
            (password or "").encode(),
        )
        if found is None or expected is None or password is None or not ok:
            raise AuthenticationFailed("bad user name or password")
        return found[1]

    def by_certificate(self, name: str) -> Principal:
        """The account a verified client certificate names (its CN, with ``[tls]
        principal_from``): the TLS handshake proved who it is, so no password is
        asked (RabbitMQ's EXTERNAL, Mosquitto's use_identity_as_username, Kafka's
        SSL principal). Anyone in open mode."""
        if self._open:
            return ANONYMOUS
        found = self._by_user.get(name)
        if found is None:
            raise AuthenticationFailed("the certificate names no account")
        return found[1]

    def access_key(self, access_key: str | None) -> AccessKey:
        """The owner and secret of an access key; anyone (and no secret) in open mode."""
        if self._open:
            return AccessKey(principal=ANONYMOUS, secret_key=None)
        found = self._by_access_key.get(access_key or "")
        if found is None:
            raise AuthenticationFailed("unknown access key")
        return found

    def rules(self) -> list[Rule]:
        """Every account's configured permission rules (read-only)."""
        return [rule for _, principal in self._by_user.values() for rule in principal.permissions]

    def authorize(self, principal: Principal, namespace: str) -> None:
        if not principal.may_use(namespace):
            raise AccessDenied(f"{principal.name!r} may not use namespace {namespace!r}")


def _principal(account: AccountConfig) -> Principal:
    namespaces = account.namespaces or (DEFAULT_NAMESPACE,)
    default = account.default_namespace or namespaces[0]
    return Principal(
        name=account.user,
        namespaces=frozenset(namespaces),
        default_namespace=default,
        admin=account.admin,
        permissions=tuple(
            Rule(
                principal=account.user,
                namespace=p.namespace or default,
                resource=p.resource,
                pattern=p.pattern,
                match=p.match,
                operations=expand_operations(p.operations),
                effect=p.effect,
            )
            for p in account.permissions
        ),
    )
