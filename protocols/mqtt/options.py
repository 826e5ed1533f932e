"""Tunables of the MQTT adapter, filled from ``[mqtt]`` by the listener factories.

Defaults are Mosquitto's; tests pass shorter times (fractions of a second, which
the config's whole seconds cannot say) through :class:`MqttOptions` rather than
waiting through the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MqttOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MqttOptions:
    # Mosquitto's max_keepalive: a v5 client asking for a longer keep-alive, or for
    # none (0), is told this one in CONNACK (Server Keep Alive, v5 3.2.2.3.14) and
    # held to it. 0 lets clients choose, 0 included. v3 clients keep their own.
    max_keep_alive_s: int = 65535
    # Mosquitto's sys_interval: how often ``$SYS`` subscribers get fresh values.
    sys_interval_s: float = 10.0
    # A TCP connection that received nothing for this long (and at most as long
    # again) parks: its task ends until bytes come (protocols/mqtt/tcp_listener.py).
    # Not at once: a busy connection would pay a task per batch.
    park_after_s: float = 5.0
    # How far behind (bytes written and not yet taken by its socket) an online
    # subscriber may fall before its QoS 0 deliveries are dropped, as Mosquitto drops
    # them past max_queued_messages (1000 packets by default, 2.0's
    # db__ready_for_flight) and EMQX past max_mqueue_len (1000): at most once, and a
    # client that reads slowly must not hold the server's memory. Counted in
    # ``$SYS/broker/publish/messages/dropped`` (Mosquitto's name) and logged.
    qos0_drop_bytes: int = 8 << 20
