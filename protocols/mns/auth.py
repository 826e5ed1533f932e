"""Who sent an MNS request: the signature checked against the access key's secret,
and the Date header against the server's clock (MNS API reference, "Signature").

Unsigned requests pass only in open auth mode, as the anonymous admin."""

from __future__ import annotations

import email.utils
import urllib.parse
from collections.abc import Iterable

from polymq.gateway.accounts import ANONYMOUS, Accounts, Principal
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.signature import parse_authorization, string_to_sign, verify
from polymq.storage.clock import Clock

__all__ = ["RequestAuth"]


class RequestAuth:
    def __init__(self, accounts: Accounts, clock: Clock, *, max_date_skew_s: int) -> None:
        self._accounts = accounts
        self._clock = clock
        self._max_date_skew_ms = max_date_skew_s * 1000

    def principal(
        self,
        *,
        method: str,
        raw_path: str,
        query: str,
        headers: Iterable[tuple[str, str]],
    ) -> Principal:
        """``raw_path`` and ``query`` as they came on the request line: the signature
        covers them byte for byte."""
        headers = list(headers)
        plain = {name.lower(): value for name, value in headers}
        header = plain.get("authorization")
        if header is None:
            if not self._accounts.open:
                raise MnsError("MissingAuthorizationHeader", "Authorization header is required.")
            return ANONYMOUS
        parsed = parse_authorization(header)
        if parsed is None:
            raise MnsError(
                "InvalidAuthorizationHeader", "The Authorization header format is invalid."
            )
        access_key, signature = parsed
        key = self._accounts.access_key(access_key)
        if key.secret_key is None:  # open mode: nothing to check against
            return key.principal
        self._check_date(plain.get("date"))
        resource = f"{raw_path}?{query}" if query else raw_path
        # Signed as sent; some clients sign the path before percent-encoding it.
        candidates = dict.fromkeys((resource, urllib.parse.unquote(resource)))
        if not any(
            verify(
                key.secret_key,
                string_to_sign(method=method, resource=candidate, headers=headers),
                signature,
            )
            for candidate in candidates
        ):
            raise MnsError(
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you "
                "provided. Check your key and signing method.",
                403,
            )
        return key.principal

    def _check_date(self, date: str | None) -> None:
        if date is None:
            raise MnsError("MissingDateHeader", "Date header is required.")
        try:
            sent_ms = int(email.utils.parsedate_to_datetime(date).timestamp() * 1000)
        except (TypeError, ValueError, OverflowError, IndexError):
            raise MnsError("InvalidDateHeader", "The Date header format is invalid.") from None
        if abs(self._clock.now_ms() - sent_ms) > self._max_date_skew_ms:
            raise MnsError("TimeExpired", "The http request you sent is expired.", 408)
