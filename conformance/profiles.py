"""What each kind of target is known to lack, so the report can say "unsupported by
the target" rather than "fail". Keys are ``<protocol>.<feature>`` as the cases name
them, with shell wildcards. The lists come from the brokers' documentation for the
versions Debian 12 ships (RabbitMQ 3.10, Mosquitto 2.0), confirmed by the reference
runs."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["PROFILES"]

PROFILES: Mapping[str, frozenset[str]] = {
    "polymq": frozenset(),
    # RabbitMQ 3.10's MQTT plugin: MQTT 3.1/3.1.1 only (v5 came in 3.13), QoS 2 is
    # downgraded to QoS 1, no shared subscriptions.
    #
    # Two more are deviations from MQTT 3.1.1 that the reference runs found in 3.10's
    # plugin (reported the same way, so the run says "this broker does not do it"):
    # a PUBLISH to a topic name with a wildcard is accepted instead of closing the
    # connection (3.3.2.1), and a second SUBSCRIBE to the same filter adds a
    # subscription instead of replacing it, so each message arrives twice (3.8.4).
    "rabbitmq": frozenset(
        {
            "mqtt.qos2",
            "mqtt.v5-*",
            "mqtt.shared-subscription",
            "mqtt.publish-wildcard-refused",
            "mqtt.resubscribe-replaces",
        }
    ),
    # Mosquitto speaks only MQTT; it has every MQTT feature the cases use.
    "mosquitto": frozenset(),
}
