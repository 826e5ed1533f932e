"""Logins verified recently, so a reconnect storm does not hash every attempt again.

argon2id costs tens of milliseconds per check on purpose; a thousand clients coming
back after a restart with the right password would queue for minutes. An entry is
keyed by a keyed digest of the user name and the password (HMAC-SHA-256 under a
random key that never leaves the process), so the cache holds no password and no
digest an attacker could test guesses against offline. A hit needs the exact same
password (a different one is a different digest), and the entry names the stored
credentials it was checked against: once the configuration changes them, the entry
no longer counts (:meth:`get` returns the old object, the caller compares identity),
and :meth:`clear` drops everything on a reload.
"""

from __future__ import annotations

import collections
import hmac
import os
from typing import Generic, TypeVar

__all__ = ["VerifiedCache"]

_V = TypeVar("_V")


class VerifiedCache(Generic[_V]):
    """A bounded LRU of successful verifications: digest -> what was verified against."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._key = os.urandom(32)
        self._entries: collections.OrderedDict[bytes, _V] = collections.OrderedDict()

    def _digest(self, user: str, password: str) -> bytes:
        # Length-prefixed, so no (user, password) pair reads as another.
        raw_user = user.encode("utf-8", "surrogatepass")
        message = (
            len(raw_user).to_bytes(4, "big") + raw_user + password.encode("utf-8", "surrogatepass")
        )
        return hmac.digest(self._key, message, "sha256")

    def get(self, user: str, password: str) -> _V | None:
        """What this exact user and password were last verified against, if cached."""
        digest = self._digest(user, password)
        found = self._entries.get(digest)
        if found is not None:
            self._entries.move_to_end(digest)
        return found

    def put(self, user: str, password: str, verified: _V) -> None:
        digest = self._digest(user, password)
        self._entries[digest] = verified
        self._entries.move_to_end(digest)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
