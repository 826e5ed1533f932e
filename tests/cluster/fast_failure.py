"""The environment for separated-form processes in tests: heartbeats every 200 ms, a
silent gateway or storage node dropped after 2 s, so a death is noticed within
seconds; the developer's own ``POLYMQ_`` settings left out."""

from __future__ import annotations

import os

from polymq.gateway.config import ENV_PREFIX

__all__ = ["cluster_env"]

_SETTINGS = {
    "CLUSTER__HEARTBEAT_MS": "200",
    "NAVIGATION__GATEWAY_EXPIRY_MS": "2000",
    "NAMESERVER__NODE_EXPIRY_MS": "2000",
}


def cluster_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + k: v for k, v in _SETTINGS.items()})
    return env
