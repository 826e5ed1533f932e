"""TLS mechanics: the ``ssl.SSLContext`` every TLS listener shares, built from
``[tls]`` and reloaded in place, and the client certificate's name for principals.

Pure of protocols: listeners take :class:`ServerTls` and wrap their sockets with
``context`` (the gRPC listener with ``h2_context``, the same offering HTTP/2 by
ALPN). Reloading (SIGHUP, :meth:`ServerTls.reload`) loads
the files into the *same* context objects the listeners hold, so new handshakes use
the new certificate while established connections carry on with the one they made:
OpenSSL copies the certificate into each connection when it is created. A reload that
fails (a missing file, a key that does not match) leaves the old material serving.
CAs are added to the trust store on reload; removing a CA takes a restart.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Any

from polymq.gateway.config import ConfigError, TlsConfig

__all__ = [
    "InternalTls",
    "ServerTls",
    "client_context",
    "internal_tls",
    "peer_common_name",
    "server_tls",
]

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
_VERIFY = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _load_into(context: ssl.SSLContext, config: TlsConfig) -> None:
    assert config.cert_file is not None and config.key_file is not None
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
        if config.ca_file is not None:
            context.load_verify_locations(cafile=str(config.ca_file))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"[tls]: cannot load the certificate, key or CA: {e}") from e


def _new_context(config: TlsConfig, purpose: ssl.Purpose) -> ssl.SSLContext:
    context = ssl.create_default_context(purpose)
    context.minimum_version = _VERSIONS[config.min_version]
    return context


class ServerTls:
    """The server side of ``[tls]``: one live context for every TLS listener."""

    def __init__(self, config: TlsConfig) -> None:
        if config.cert_file is None or config.key_file is None:
            raise ConfigError("[tls]: no 'cert_file' and 'key_file': no TLS to serve")
        self.config = config
        self.context = self._server_context()
        # The gRPC listener's: the same, offering HTTP/2 by ALPN, as grpc clients
        # require of a server (the other listeners must not offer it).
        self.h2_context = self._server_context()
        self.h2_context.set_alpn_protocols(["h2"])

    def _server_context(self) -> ssl.SSLContext:
        context = _new_context(self.config, ssl.Purpose.CLIENT_AUTH)
        context.verify_mode = _VERIFY[self.config.verify]
        _load_into(context, self.config)
        return context

    def reload(self) -> None:
        """Load the files again into the live context: new connections use them,
        open ones are untouched. They are tried on a scratch context first, so a bad
        file raises :class:`ConfigError` and changes nothing."""
        _load_into(_new_context(self.config, ssl.Purpose.CLIENT_AUTH), self.config)
        _load_into(self.context, self.config)
        _load_into(self.h2_context, self.config)
        log.info("tls: reloaded %s", self.config.cert_file)

    def principal_name(self, ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
        """The account a connection's verified client certificate names, when
        ``principal_from`` says certificates name accounts; else ``None``."""
        if self.config.principal_from == "none" or ssl_object is None:
            return None
        return peer_common_name(ssl_object.getpeercert())


def server_tls(config: TlsConfig) -> ServerTls | None:
    """The live server context when ``[tls]`` names a certificate."""
    return ServerTls(config) if config.cert_file is not None else None


def peer_common_name(peercert: Any) -> str | None:
    """The subject CN of a certificate as ``SSLObject.getpeercert()`` gives it, which
    is non-empty only for a certificate the handshake verified (the last CN when the
    subject has several, as RabbitMQ's and Kafka's default mappings take the first
    most specific one: subjects list from the root of the name down)."""
    if not isinstance(peercert, dict):
        return None
    names = [
        value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"
    ]
    return names[-1] if names else None


@dataclass(frozen=True, slots=True)
class InternalTls:
    """TLS between polymq processes (``[tls] internal``): what the storage nodes,
    nameservers and navigation serve with (client certificates from ``ca_file``
    required: mutual TLS) and what every process dials them with."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def internal_tls(config: TlsConfig) -> InternalTls | None:
    """The contexts for ``[tls] internal``; ``None`` when it is off. Loaded once at
    start-up (SIGHUP reloads only the protocol listeners' context)."""
    client = client_context(config)
    if client is None:
        return None
    if config.ca_file is None:
        raise ConfigError("'tls.internal' needs 'tls.ca_file': the CA the processes trust")
    server = _new_context(config, ssl.Purpose.CLIENT_AUTH)
    server.verify_mode = ssl.CERT_REQUIRED
    _load_into(server, config)
    return InternalTls(server=server, client=client)


def client_context(config: TlsConfig) -> ssl.SSLContext | None:
    """The client side between polymq processes (``tls.internal``): trust ``ca_file``
    (or the system's CAs) and present ``cert_file`` for mutual TLS."""
    if not config.internal:
        return None
    context = _new_context(config, ssl.Purpose.SERVER_AUTH)
    try:
        if config.ca_file is not None:
            context.load_verify_locations(cafile=str(config.ca_file))
        if config.cert_file is not None and config.key_file is not None:
            context.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"[tls]: cannot load the certificate, key or CA: {e}") from e
    return context
