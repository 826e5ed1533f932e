"""SaslHandshake and SaslAuthenticate (KIP-152): the connection's auth states move
as protocols/kafka/_state.py says."""

from __future__ import annotations

from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.gateway.connections import AccountConnectionLimit
from polymq.protocols.kafka._state import AuthState
from polymq.protocols.kafka.sasl import MECHANISMS, start_exchange
from polymq.protocols.kafka.session import Session

__all__ = ["sasl_authenticate", "sasl_handshake"]


async def sasl_handshake(session: Session, request: Any, version: int) -> dict[str, Any]:
    services = session.services
    exchange = start_exchange(request.mechanism, services.accounts, session.peer.lstrip("/"))
    if exchange is None or session.state is not AuthState.START:
        code = (
            ErrorCode.unsupported_sasl_mechanism
            if exchange is None
            else ErrorCode.illegal_sasl_state
        )
        return {"error_code": code, "mechanisms": list(MECHANISMS)}
    session.sasl = exchange
    session.state = AuthState.HANDSHAKEN
    return {"error_code": ErrorCode.none, "mechanisms": list(MECHANISMS)}


async def sasl_authenticate(session: Session, request: Any, version: int) -> dict[str, Any]:
    if session.sasl is None:
        return {"error_code": ErrorCode.illegal_sasl_state, "error_message": "no handshake"}
    try:
        reply, principal = await session.sasl.step(request.auth_bytes)
    except AuthError:
        session.closing = True  # Kafka closes after a failed authentication
        return {
            "error_code": ErrorCode.sasl_authentication_failed,
            "error_message": "Authentication failed: invalid credentials",
            "auth_bytes": b"",
        }
    if principal is not None:
        try:
            session.authenticated(principal)
        except AccountConnectionLimit as e:  # the account's quota (docs/quotas.md)
            session.closing = True
            return {
                "error_code": ErrorCode.sasl_authentication_failed,
                "error_message": f"Connection refused: {e}",
                "auth_bytes": b"",
            }
    return {"error_code": ErrorCode.none, "auth_bytes": reply, "session_lifetime": 0}
