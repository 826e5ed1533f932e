"""SASL mechanisms for SaslAuthenticate: PLAIN (RFC 4616) and SCRAM-SHA-256/512
(RFC 5802, KIP-84), checked through the gateway's accounts.

PLAIN hands the password to :meth:`Accounts.authenticate` (argon2id off the loop).
SCRAM's server side needs only the account's stored keys (RFC 5802 §3,
:meth:`Accounts.scram_keys`), never a password: an account configured with an argon2id
hash alone has none, and its SCRAM attempt fails like a wrong password. So does an
unknown user's, at the same step (its exchange runs on throw-away keys), so SCRAM does
not tell which user names exist either (:meth:`Accounts.scram_decoy`).
"""

from __future__ import annotations

from scramp import ScramException, ScramMechanism

from polymq.gateway.accounts import Accounts, AuthenticationFailed, Principal
from polymq.gateway.credentials import SCRAM_MECHANISMS, ScramMechanismName

__all__ = ["MECHANISMS", "PlainExchange", "SaslExchange", "ScramExchange", "start_exchange"]

MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_PROTOCOL = "kafka"


class PlainExchange:
    def __init__(self, accounts: Accounts, peer: str) -> None:
        self._accounts = accounts
        self._peer = peer

    async def step(self, data: bytes) -> tuple[bytes, Principal | None]:
        """One round; the principal once authenticated (PLAIN needs one round)."""
        parts = data.split(b"\0")
        if len(parts) != 3:
            await self._accounts.refuse(protocol=_PROTOCOL, user=None, peer=self._peer)
        user, password = parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        principal = await self._accounts.authenticate(
            user, password, protocol=_PROTOCOL, peer=self._peer
        )
        return b"", principal


class ScramExchange:
    """Client-first, then client-final; the server's final message proves we hold the
    account's keys too."""

    def __init__(self, mechanism: ScramMechanismName, accounts: Accounts, peer: str) -> None:
        self._accounts = accounts
        self._peer = peer
        self._user: str | None = None
        self._known = False

        def auth_fn(user: str) -> tuple[bytes, bytes, bytes, int]:
            self._user = user
            keys = accounts.scram_keys(user, mechanism)
            self._known = keys is not None
            return (keys or accounts.scram_decoy(user, mechanism)).as_scramp()

        self._server = ScramMechanism(mechanism).make_server(auth_fn)
        self._round = 0

    async def step(self, data: bytes) -> tuple[bytes, Principal | None]:
        try:
            if self._round == 0:
                self._round = 1
                self._server.set_client_first(data.decode("utf-8"))
                return self._server.get_server_first().encode(), None
            self._server.set_client_final(data.decode("utf-8"))
            final = self._server.get_server_final().encode()
        except (ScramException, ValueError):  # UnicodeDecodeError is a ValueError
            await self._accounts.refuse(protocol=_PROTOCOL, user=self._user, peer=self._peer)
        principal = None if self._user is None else self._accounts.principal(self._user)
        if not self._known or principal is None:  # never: decoy keys match nothing
            raise AuthenticationFailed("SCRAM authentication failed")
        return final, self._accounts.accepted(principal, self._peer)


SaslExchange = PlainExchange | ScramExchange


def start_exchange(mechanism: str, accounts: Accounts, peer: str) -> SaslExchange | None:
    """The exchange for ``mechanism``, or ``None`` when it is not one we offer."""
    if mechanism == "PLAIN":
        return PlainExchange(accounts, peer)
    for scram in SCRAM_MECHANISMS:
        if mechanism == scram:
            return ScramExchange(scram, accounts, peer)
    return None
