"""AMQP 0-9-1 (RabbitMQ-compatible) over polymq storage; see docs/amqp.md."""

from polymq.protocols.amqp.listener import amqp_listener

__all__ = ["amqp_listener"]
