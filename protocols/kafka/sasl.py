"""SASL mechanisms for SaslAuthenticate: PLAIN (RFC 4616) and SCRAM-SHA-256/512
(RFC 5802, KIP-84), checked against the gateway's accounts. Pure: bytes in, bytes out."""

from __future__ import annotations

from functools import cache

from scramp import ScramException, ScramMechanism

from polymq.gateway.accounts import Accounts, AuthenticationFailed, Principal

__all__ = ["MECHANISMS", "PlainExchange", "SaslExchange", "ScramExchange", "start_exchange"]

MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_ITERATIONS = 4096


class PlainExchange:
    def __init__(self, accounts: Accounts) -> None:
        self._accounts = accounts

    def step(self, data: bytes) -> tuple[bytes, Principal | None]:
        """One round; the principal once authenticated (PLAIN needs one round)."""
        parts = data.split(b"\0")
        if len(parts) != 3:
            raise AuthenticationFailed("malformed PLAIN message")
        user, password = parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        return b"", self._accounts.authenticate(user, password)


@cache
def _auth_info(mechanism: str, password: str) -> tuple[bytes, bytes, bytes, int]:
    info = ScramMechanism(mechanism).make_auth_info(password, iteration_count=_ITERATIONS)
    return info  # type: ignore[no-any-return]


class ScramExchange:
    """Client-first, then client-final; the server's final message proves we knew
    the password too."""

    def __init__(self, mechanism: str, accounts: Accounts, passwords: dict[str, str]) -> None:
        self._accounts = accounts
        self._passwords = passwords
        self._mechanism = mechanism
        self._user: str | None = None

        def auth_fn(user: str) -> tuple[bytes, bytes, bytes, int]:
            password = passwords.get(user)
            if password is None:
                raise ScramException("unknown user")
            self._user = user
            return _auth_info(mechanism, password)

        self._server = ScramMechanism(mechanism).make_server(auth_fn)
        self._round = 0

    def step(self, data: bytes) -> tuple[bytes, Principal | None]:
        try:
            if self._round == 0:
                self._round = 1
                self._server.set_client_first(data.decode("utf-8"))
                return self._server.get_server_first().encode(), None
            self._server.set_client_final(data.decode("utf-8"))
            final = self._server.get_server_final().encode()
        except (ScramException, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise AuthenticationFailed("SCRAM authentication failed") from e
        assert self._user is not None
        return final, self._accounts.authenticate(self._user, self._passwords[self._user])


SaslExchange = PlainExchange | ScramExchange


def start_exchange(
    mechanism: str, accounts: Accounts, passwords: dict[str, str]
) -> SaslExchange | None:
    if mechanism == "PLAIN":
        return PlainExchange(accounts)
    if mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        return ScramExchange(mechanism, accounts, passwords)
    return None
