"""polymq gateway: the stateless compute node in front of storage.

Protocol adapters use :class:`Processor` (with a :class:`Caller`) and nothing below it;
the server bootstrap composes a :class:`Gateway` from a :class:`GatewayConfig`.
"""

from polymq.gateway.accounts import (
    ANONYMOUS,
    AccessDenied,
    AccessKey,
    Accounts,
    AuthenticationFailed,
    AuthError,
    Principal,
)
from polymq.gateway.config import ConfigError, GatewayConfig, engine_config, load_config
from polymq.gateway.connections import (
    Connection,
    ConnectionRegistry,
    TooManyConnections,
    current_connection_id,
)
from polymq.gateway.gateway import Gateway
from polymq.gateway.listeners import (
    ConnectionHandler,
    Listener,
    ListenerContext,
    ListenerFactory,
    ListenerSet,
    TcpListener,
)
from polymq.gateway.metering import Metering, Usage, render_prometheus
from polymq.gateway.processor import Caller, Processor

__all__ = [
    "ANONYMOUS",
    "AccessDenied",
    "AccessKey",
    "Accounts",
    "AuthError",
    "AuthenticationFailed",
    "Caller",
    "ConfigError",
    "Connection",
    "ConnectionHandler",
    "ConnectionRegistry",
    "Gateway",
    "GatewayConfig",
    "Listener",
    "ListenerContext",
    "ListenerFactory",
    "ListenerSet",
    "Metering",
    "Principal",
    "Processor",
    "TcpListener",
    "TooManyConnections",
    "Usage",
    "current_connection_id",
    "engine_config",
    "load_config",
    "render_prometheus",
]
