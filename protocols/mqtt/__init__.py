"""MQTT 3.1, 3.1.1 and 5.0 over TCP and WebSocket (docs/mqtt.md)."""

from polymq.protocols.mqtt.listener import mqtt_listener, mqtt_ws_listener

__all__ = ["mqtt_listener", "mqtt_ws_listener"]
