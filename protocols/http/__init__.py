"""The HTTP port: the MNS API, the admin API, ``/metrics``, ``/healthz`` and ``/docs``."""

from polymq.protocols.http.listener import HttpListener, http_listener

__all__ = ["HttpListener", "http_listener"]
