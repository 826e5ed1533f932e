"""A Kafka connection's authentication states, as one table.

Without SASL (open mode) a connection starts authenticated. With SASL, Kafka (KIP-43,
KIP-152) allows only ApiVersions and SaslHandshake first, then SaslAuthenticate rounds
until the mechanism finishes; anything else before that closes the connection.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ALLOWED", "API_VERSIONS", "SASL_AUTHENTICATE", "SASL_HANDSHAKE", "AuthState"]

API_VERSIONS = 18
SASL_HANDSHAKE = 17
SASL_AUTHENTICATE = 36


class AuthState(Enum):
    START = "start"  # waiting for SaslHandshake
    HANDSHAKEN = "handshaken"  # mechanism chosen, SaslAuthenticate rounds under way
    AUTHENTICATED = "authenticated"


# API keys a connection may send in each state; None: any.
ALLOWED: dict[AuthState, frozenset[int] | None] = {
    AuthState.START: frozenset({API_VERSIONS, SASL_HANDSHAKE}),
    AuthState.HANDSHAKEN: frozenset({API_VERSIONS, SASL_AUTHENTICATE}),
    AuthState.AUTHENTICATED: None,
}
