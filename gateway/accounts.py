"""Who is connecting, and which namespaces (tenants) they may use.

Every protocol resolves its credentials here (SASL user, AMQP login, MQTT user name,
RocketMQ and MNS access keys), so there is one notion of a tenant across protocols.

Passwords are checked against stored credentials (:mod:`gateway.credentials`: an
argon2id hash, SCRAM keys, or a clear password for trials) off the event loop, with a
cache of recent successes (:mod:`gateway.verified_cache`); failures are counted,
logged and slowed down per address (:mod:`gateway.login_guard`). RocketMQ and MNS
sign requests with HMAC, which needs the secret key itself: it stays in the config.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass
from typing import NoReturn

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.credentials import (
    DEFAULT_SCRAM_ITERATIONS,
    ScramKeys,
    ScramMechanismName,
    StoredCredentials,
    dummy_hash,
    verify_password,
)
from polymq.gateway.login_guard import LoginGuard, LoginGuardConfig
from polymq.gateway.permissions import Rule, expand_operations
from polymq.gateway.verified_cache import VerifiedCache
from polymq.storage.clock import Clock, SystemClock
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

log = logging.getLogger(__name__)

# argon2id at its default cost takes 64 MiB per check: at most this many at once.
_CONCURRENT_HASHES = 2


class AuthError(Exception):
    """Base of the errors a peer provokes by who it is; ``code`` is stable so adapters
    map it to their wire error without parsing the message."""

    code = "auth_error"


class AuthenticationFailed(AuthError):
    """The credentials match no account. The message never says which part was wrong,
    so it does not help anyone guess user names."""

    code = "authentication_failed"


class AccessDenied(AuthError):
    """Not allowed. ``resource`` is the kind a permission rule refused (``topic``,
    ``group``, ``transactional_id``; docs/permissions.md), so a protocol with one error
    per kind (Kafka) picks it; ``None`` for a namespace the principal may not use."""

    code = "access_denied"

    def __init__(self, message: str, *, resource: str | None = None) -> None:
        super().__init__(message)
        self.resource = resource


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
    """The configured accounts, looked up by user name or access key.

    ``clock`` times the slowdown of failed logins (:mod:`gateway.login_guard`)."""

    def __init__(self, config: AuthConfig, *, clock: Clock | None = None) -> None:
        self._guard = LoginGuard(
            LoginGuardConfig(
                free_failures=config.login_failures_free,
                first_delay_ms=config.login_failure_delay_ms,
                max_delay_ms=config.login_failure_max_delay_ms,
            ),
            clock or SystemClock(),
        )
        self._verified: VerifiedCache[StoredCredentials] = VerifiedCache()
        # A threading semaphore, taken in the worker thread: bounds memory without
        # tying this object to one event loop.
        self._hashing = threading.BoundedSemaphore(_CONCURRENT_HASHES)
        self._decoy_key = os.urandom(32)  # salts of SCRAM decoys (scram_decoy)
        self._load(config)

    def _load(self, config: AuthConfig) -> None:
        self._open = config.mode == "open"
        self._by_user: dict[str, tuple[AccountConfig, Principal]] = {}
        self._by_access_key: dict[str, AccessKey] = {}
        self._credentials: dict[str, StoredCredentials] = {}
        # An unknown user is hashed at the cost of the configured hashes (the first).
        self._typical_hash = next(
            (a.password_hash for a in config.accounts if a.password_hash is not None), None
        )
        for account in config.accounts:
            principal = _principal(account)
            self._by_user[account.user] = (account, principal)
            self._credentials[account.user] = StoredCredentials.from_config(
                password=account.password,
                password_hash=account.password_hash,
                scram_sha_256=account.scram_sha_256,
                scram_sha_512=account.scram_sha_512,
            )
            if account.password is not None and not self._open:
                log.warning(
                    "account %r: its password is stored in clear in the config (fine for"
                    " a trial; use password_hash and SCRAM keys from `polymq passwd`)",
                    account.user,
                )
            if account.access_key is not None:
                self._by_access_key[account.access_key] = AccessKey(
                    principal=principal, secret_key=account.secret_key
                )

    def reload(self, config: AuthConfig) -> None:
        """Take new accounts; every cached verification is dropped with the old ones."""
        self._load(config)
        self._verified.clear()

    @property
    def open(self) -> bool:
        return self._open

    def namespaces(self) -> frozenset[str]:
        """Namespaces named by any account: the gateway creates them at start-up."""
        named: set[str] = set()
        for account, _ in self._by_user.values():
            named.update(account.namespaces)
        return frozenset(named)

    async def authenticate(
        self, username: str | None, password: str | None, *, protocol: str, peer: str = ""
    ) -> Principal:
        """The principal for a user name and password; anyone in open mode.

        The check runs in a worker thread (argon2id is slow on purpose), except when
        this exact user and password were verified against the same stored
        credentials recently. An unknown user's attempt is hashed against a dummy,
        so the answer's timing does not tell which user names exist. A failure is
        counted, logged (user name, protocol, ``peer``; never the password) and
        answered after the address's backoff, then raises
        :class:`AuthenticationFailed`."""
        if self._open:
            return ANONYMOUS
        user = username or ""
        found = self._by_user.get(user)
        credentials = self._credentials.get(user)
        if (
            found is not None
            and credentials is not None
            and password is not None
            and self._verified.get(user, password) is credentials
        ):
            return self.accepted(found[1], peer)
        ok = await asyncio.to_thread(self._verify, credentials, password)
        if not ok or found is None or credentials is None or password is None:
            await self.refuse(protocol=protocol, user=user, peer=peer)
        self._verified.put(user, password, credentials)
        return self.accepted(found[1], peer)

    def _verify(self, credentials: StoredCredentials | None, password: str | None) -> bool:
        with self._hashing:
            if credentials is None or password is None or not credentials.verifies_passwords:
                verify_password(dummy_hash(self._typical_hash), password or "")
                return False
            return credentials.verify(password)

    def scram_keys(self, username: str, mechanism: ScramMechanismName) -> ScramKeys | None:
        """The SCRAM server keys of ``username`` for ``mechanism``; ``None`` when the
        user is unknown or was given none (an argon2id hash cannot stand in for them),
        which the SCRAM exchange turns into an ordinary authentication failure."""
        credentials = self._credentials.get(username)
        return None if credentials is None else credentials.scram.get(mechanism)

    def scram_decoy(self, username: str, mechanism: ScramMechanismName) -> ScramKeys:
        """Keys no password derives, for a SCRAM exchange with a user that has none:
        the exchange runs to the end and fails like a wrong password. The salt is the
        same on every try for one user name (RFC 5802 §9), as a real account's is, so
        it does not tell which user names exist."""
        digest = "sha512" if mechanism == "SCRAM-SHA-512" else "sha256"
        size = hashlib.new(digest).digest_size
        return ScramKeys(
            mechanism=mechanism,
            iterations=DEFAULT_SCRAM_ITERATIONS,
            salt=hmac.digest(self._decoy_key, username.encode("utf-8", "replace"), "sha256")[:16],
            stored_key=os.urandom(size),
            server_key=os.urandom(size),
        )

    def principal(self, username: str) -> Principal | None:
        """The principal of a user whose proof was checked elsewhere (SCRAM); anyone
        in open mode."""
        if self._open:
            return ANONYMOUS
        found = self._by_user.get(username)
        return None if found is None else found[1]

    def accepted(self, principal: Principal, peer: str) -> Principal:
        """Note a successful login from ``peer`` (its address's failures are forgotten)."""
        self._guard.succeeded(peer)
        return principal

    async def refuse(self, *, protocol: str, user: str | None, peer: str) -> NoReturn:
        """Count and log a failed login, wait the address's backoff, then raise
        :class:`AuthenticationFailed`."""
        delay_ms = self._guard.failed(protocol=protocol, user=user, peer=peer)
        if delay_ms:
            clock = self._guard.clock
            await clock.sleep_until(clock.now_ms() + delay_ms)
        raise AuthenticationFailed("bad user name or password")

    def login_failures(self) -> dict[str, int]:
        """Failed logins so far, by protocol (for ``/metrics``)."""
        return self._guard.failures()

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
