"""Stored credentials: what the config holds instead of a clear password.

Two forms, because two kinds of login need different things:

* an **argon2id hash** in its standard PHC string
  (``$argon2id$v=19$m=65536,t=3,p=4$<salt>$<hash>``, RFC 9106) checks a password a client
  sends in the clear inside its protocol (Kafka SASL PLAIN, AMQP PLAIN/AMQPLAIN, MQTT,
  HTTP Basic). It is slow on purpose (tens of milliseconds, megabytes of memory), so a
  stolen config does not give the passwords away cheaply; callers never run
  :func:`verify_password` on the event loop.
* **SCRAM keys** in RFC 5803 form
  (``SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>``, base64 parts) are all a
  SCRAM server needs (RFC 5802 §3): the client proves it knows the password without
  sending it, and the server proves it holds the keys. A hash cannot stand in for them
  (SCRAM needs the PBKDF2-derived keys themselves), hence both forms.

Pure functions and values: no I/O, no asyncio.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass
from functools import cache
from typing import Literal

import argon2
from argon2.exceptions import InvalidHashError, VerificationError

__all__ = [
    "DEFAULT_SCRAM_ITERATIONS",
    "SCRAM_MECHANISMS",
    "CredentialError",
    "ScramKeys",
    "ScramMechanismName",
    "StoredCredentials",
    "check_password_hash",
    "dummy_hash",
    "hash_password",
    "verify_password",
]

ScramMechanismName = Literal["SCRAM-SHA-256", "SCRAM-SHA-512"]
SCRAM_MECHANISMS: tuple[ScramMechanismName, ...] = ("SCRAM-SHA-256", "SCRAM-SHA-512")
_DIGESTS = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
# Kafka's kafka-configs.sh default, and scramp's minimum (RFC 7677 §4 asks for >= 4096).
DEFAULT_SCRAM_ITERATIONS = 4096
_MIN_SCRAM_ITERATIONS = 4096
# scramp refuses more (a bound on what one login may cost), and shorter salts.
_MAX_SCRAM_ITERATIONS = 10_000_000
_MIN_SALT_BYTES = 12
_SALT_BYTES = 16

# argon2-cffi's defaults are RFC 9106's second recommended profile (t=3, 64 MiB, p=4).
_HASHER = argon2.PasswordHasher()


class CredentialError(ValueError):
    """A stored credential string is malformed; the message says what is expected and
    never echoes the hash itself."""


def hash_password(password: str) -> str:
    """An argon2id PHC string for ``password`` with a fresh random salt."""
    return _HASHER.hash(password)


def check_password_hash(text: str) -> None:
    """Raise :class:`CredentialError` unless ``text`` is an argon2id PHC string this
    server can verify (checked once, at config load, so a typo is not a login failure
    discovered later)."""
    try:
        parameters = argon2.extract_parameters(text)
    except (InvalidHashError, ValueError) as e:
        raise CredentialError(
            "not an argon2id PHC string ($argon2id$v=19$m=…,t=…,p=…$salt$hash);"
            " make one with `polymq passwd`"
        ) from e
    if parameters.salt_len < 8 or parameters.hash_len < 16:
        raise CredentialError("the salt or the hash is too short to be an argon2id PHC string")
    if parameters.type is not argon2.Type.ID:
        raise CredentialError(f"argon2{parameters.type.name.lower()} is not accepted: use argon2id")


def verify_password(password_hash: str, password: str) -> bool:
    """Whether ``password`` matches ``password_hash``. Slow (the hash's own cost): run
    it in a thread."""
    try:
        return _HASHER.verify(password_hash, password)
    except (VerificationError, InvalidHashError):
        return False


def dummy_hash(like: str | None = None) -> str:
    """A hash of a random password with the cost of ``like`` (a configured hash; the
    default cost without one): what an unknown user's attempt is checked against, so
    it takes as long as a known user's. Made once per cost."""
    try:
        p = argon2.extract_parameters(like) if like is not None else None
    except (InvalidHashError, ValueError):
        p = None
    if p is None:
        return _dummy_hash(None)
    return _dummy_hash((p.time_cost, p.memory_cost, p.parallelism, p.hash_len, p.salt_len))


@cache
def _dummy_hash(cost: tuple[int, int, int, int, int] | None) -> str:
    hasher = _HASHER if cost is None else argon2.PasswordHasher(*cost)
    return hasher.hash(base64.b64encode(os.urandom(18)).decode())


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise CredentialError(f"{what} is not valid base64") from e


@dataclass(frozen=True, slots=True, kw_only=True)
class ScramKeys:
    """One SCRAM mechanism's server-side credential (RFC 5802 §3): the salt and
    iteration count the client salts its password with, ``StoredKey = H(ClientKey)``
    to check the client's proof, ``ServerKey`` to sign the server's final message."""

    mechanism: ScramMechanismName
    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes

    @classmethod
    def derive(
        cls,
        mechanism: ScramMechanismName,
        password: str,
        *,
        iterations: int = DEFAULT_SCRAM_ITERATIONS,
        salt: bytes | None = None,
    ) -> ScramKeys:
        """The keys for ``password`` (RFC 5802 §3; SASLprep is left out, as Kafka
        leaves it out)."""
        salt = os.urandom(_SALT_BYTES) if salt is None else salt
        digest = _DIGESTS[mechanism]
        salted = hashlib.pbkdf2_hmac(digest, password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", digest)
        return cls(
            mechanism=mechanism,
            iterations=iterations,
            salt=salt,
            stored_key=hashlib.new(digest, client_key).digest(),
            server_key=hmac.digest(salted, b"Server Key", digest),
        )

    @classmethod
    def parse(cls, mechanism: ScramMechanismName, text: str) -> ScramKeys:
        """Read RFC 5803's ``<mechanism>$<iterations>:<salt>$<StoredKey>:<ServerKey>``."""
        expected = f"{mechanism}$<iterations>:<salt base64>$<StoredKey base64>:<ServerKey base64>"
        parts = text.split("$")
        if len(parts) != 3 or parts[0] != mechanism:
            raise CredentialError(f"expected {expected}")
        count, sep, salt_text = parts[1].partition(":")
        stored_text, sep2, server_text = parts[2].partition(":")
        if not sep or not sep2 or not count.isdigit():
            raise CredentialError(f"expected {expected}")
        iterations = int(count)
        if not _MIN_SCRAM_ITERATIONS <= iterations <= _MAX_SCRAM_ITERATIONS:
            raise CredentialError(
                f"iterations must be {_MIN_SCRAM_ITERATIONS}..{_MAX_SCRAM_ITERATIONS}"
            )
        size = hashlib.new(_DIGESTS[mechanism]).digest_size
        stored_key = _b64decode(stored_text, "StoredKey")
        server_key = _b64decode(server_text, "ServerKey")
        if len(stored_key) != size or len(server_key) != size:
            raise CredentialError(f"{mechanism} keys are {size} bytes each")
        salt = _b64decode(salt_text, "the salt")
        if len(salt) < _MIN_SALT_BYTES:
            raise CredentialError(f"the salt must be at least {_MIN_SALT_BYTES} bytes")
        return cls(
            mechanism=mechanism,
            iterations=iterations,
            salt=salt,
            stored_key=stored_key,
            server_key=server_key,
        )

    def format(self) -> str:
        """RFC 5803's text form, as :meth:`parse` reads it."""

        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode()

        return (
            f"{self.mechanism}${self.iterations}:{b64(self.salt)}"
            f"${b64(self.stored_key)}:{b64(self.server_key)}"
        )

    def matches(self, password: str) -> bool:
        """Whether ``password`` derives these keys: lets a SCRAM-only account log in
        with a mechanism that sends the password (PLAIN). Costs ``iterations`` PBKDF2
        rounds: run it in a thread."""
        derived = ScramKeys.derive(
            self.mechanism, password, iterations=self.iterations, salt=self.salt
        )
        return hmac.compare_digest(derived.stored_key, self.stored_key)

    def as_scramp(self) -> tuple[bytes, bytes, bytes, int]:
        """The tuple scramp's server ``auth_fn`` returns."""
        return self.salt, self.stored_key, self.server_key, self.iterations


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StoredCredentials:
    """What one account logs in with, as configured. Compared by identity: a new
    config makes new objects, which is how a cache of past verifications knows an
    entry is stale."""

    password_hash: str | None = None
    # Trials only: the password itself, in the config.
    clear_password: str | None = None
    scram: dict[ScramMechanismName, ScramKeys]

    @classmethod
    def from_config(
        cls,
        *,
        password: str | None,
        password_hash: str | None,
        scram_sha_256: str | None,
        scram_sha_512: str | None,
    ) -> StoredCredentials:
        """Parse the account's keys (already validated at load). A clear password
        also yields SCRAM keys for both mechanisms, so trials can use SCRAM."""
        scram: dict[ScramMechanismName, ScramKeys] = {}
        texts = {"SCRAM-SHA-256": scram_sha_256, "SCRAM-SHA-512": scram_sha_512}
        for name in SCRAM_MECHANISMS:
            text = texts[name]
            if text is not None:
                scram[name] = ScramKeys.parse(name, text)
            elif password is not None:
                scram[name] = ScramKeys.derive(name, password)
        return cls(password_hash=password_hash, clear_password=password, scram=scram)

    @property
    def verifies_passwords(self) -> bool:
        """Whether a password sent in the clear (PLAIN) can be checked at all."""
        return bool(self.password_hash or self.clear_password is not None or self.scram)

    def verify(self, password: str) -> bool:
        """Whether ``password`` is this account's: against the argon2id hash when
        there is one, else the clear trial password, else the SCRAM keys (PBKDF2).
        Slow: run it in a thread."""
        if self.password_hash is not None:
            return verify_password(self.password_hash, password)
        if self.clear_password is not None:
            return hmac.compare_digest(self.clear_password.encode(), password.encode())
        keys = next(iter(self.scram.values()), None)
        return keys is not None and keys.matches(password)
