"""Log lines for machines: ``[server] log_format = "json"`` (``--log-format json``)
writes one JSON object per line, with the connection and account a line is about
where the code logging it serves a connection, so a log pipeline can follow one
client without parsing messages.

The connection comes from :func:`gateway.connections.current_connection_id` (the
transport sets it for the task serving each connection) and its protocol and account
from the gateway's registry, through :class:`ConnectionFields`, a handler filter the
server installs once the gateway exists. Nothing here adds a secret: the fields are
ids and names, and messages are what the code logged (the tests check that no
password, key or signature of a failed login reaches the log in either format).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from polymq.gateway.connections import ConnectionRegistry, current_connection_id

__all__ = ["CONTEXT_FIELDS", "ConnectionFields", "JsonFormatter"]

# Attributes a record may carry (from ConnectionFields or a logger's ``extra=``).
CONTEXT_FIELDS = ("connection_id", "protocol", "account", "namespace", "peer")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", [context fields], ["exc"]}``; ``ts`` is
    UTC ISO 8601 with milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, Any] = {
            "ts": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, default=str)


class ConnectionFields(logging.Filter):
    """Adds ``connection_id`` and, from the registry, the connection's ``protocol``,
    ``peer``, ``account`` and ``namespace`` to records logged while a connection is
    served (fields a record already has are kept)."""

    def __init__(self, registry: ConnectionRegistry) -> None:
        super().__init__()
        self._registry = registry

    def filter(self, record: logging.LogRecord) -> bool:
        connection_id = current_connection_id()
        if connection_id is None or getattr(record, "connection_id", None) is not None:
            return True
        record.connection_id = connection_id
        connection = self._registry.get(connection_id)
        if connection is not None:
            record.protocol = getattr(record, "protocol", None) or connection.protocol
            record.peer = getattr(record, "peer", None) or connection.peer
            if connection.principal is not None:
                record.account = connection.principal.name
            if connection.namespace is not None:
                record.namespace = connection.namespace
        return True
