"""Natural names (docs/interop.md): an exchange ``T`` is the storage topic ``T``, and
``amq.topic`` is every topic under RabbitMQ's MQTT convention (MQTT topic ``a/b/c`` is
routing key ``a.b.c``), so applications that know nothing of polymq meet the other
protocols under the names they already use.

Pure functions and one settings object: which exchange reaches which topic, the MQTT
topic name an AMQP publish is shown under, and the routing key a message another
protocol stored is routed with. Publishing (:mod:`protocols.amqp.publishing`) and the
feeds (:mod:`protocols.amqp.feeds`) both read it, so both directions agree.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Final

from polymq.protocols import interop
from polymq.storage.errors import InvalidName
from polymq.storage.model import Message
from polymq.storage.names import check_name

__all__ = ["AMQ_TOPIC", "NaturalTopics", "feed_routing_key", "mqtt_name"]

AMQ_TOPIC: Final = "amq.topic"
# MQTT wildcards and the level separator: a topic holding one is no MQTT first level.
_NOT_IN_MQTT_LEVEL: Final = frozenset("/+#")


@dataclass(frozen=True, slots=True)
class NaturalTopics:
    """The operator's limits (``[amqp] natural_topics`` and
    ``natural_topics_exclude``): off, or on except for exchange names (and, for
    ``amq.topic``, first routing-key words) matching one of the shell-style patterns.
    An exchange's explicit ``x-polymq-topic`` argument always wins."""

    enabled: bool = True
    exclude: tuple[str, ...] = ()

    def topic_of(self, exchange: str, arguments: object = None) -> str | None:
        """The storage topic an exchange is, or None: the default exchange and the
        ``amq.*`` ones keep their meaning (``amq.topic`` maps per routing key, see
        :meth:`amq_topic_target`)."""
        if isinstance(arguments, dict):
            explicit = arguments.get(interop.AMQP_TOPIC_ARGUMENT)
            if isinstance(explicit, str) and explicit:
                return explicit
        if not exchange or exchange.startswith("amq."):
            return None
        return self._natural(exchange)

    def amq_topic_target(self, routing_key: str) -> tuple[str, str] | None:
        """Where a publish to ``amq.topic`` goes: (storage topic, MQTT topic name),
        the topic being the routing key's first word (``a.b.c`` -> ``a``, ``a/b/c``)."""
        if not self.enabled or not routing_key:
            return None
        first = routing_key.split(".", 1)[0]
        topic = self._natural(first)
        if topic is None:
            return None
        name = routing_key.replace(".", "/")
        if _NOT_IN_MQTT_LEVEL & set(routing_key):
            return None
        return topic, name

    def amq_topic_sources(self, binding_keys: list[str]) -> set[str]:
        """The topics ``amq.topic``'s bindings can hear: their first words. A binding
        key starting with a wildcard would mean every topic and is not followed."""
        topics: set[str] = set()
        for key in binding_keys:
            first = key.split(".", 1)[0]
            if first in ("*", "#"):
                continue
            topic = self._natural(first)
            if topic is not None:
                topics.add(topic)
        return topics

    def _natural(self, name: str) -> str | None:
        if not self.enabled or name.startswith("amqp:"):
            return None  # "amqp:" topics are AMQP's own queues
        try:
            check_name("topic", name)
        except InvalidName:
            return None
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude):
            return None
        return name


def mqtt_name(topic: str, routing_key: str) -> str | None:
    """The MQTT topic name a publish to exchange ``topic`` is shown under: routing key
    ``a.b`` -> ``topic/a/b``, an empty key -> ``topic`` (None when ``topic`` cannot be
    an MQTT first level or the key holds an MQTT wildcard)."""
    if _NOT_IN_MQTT_LEVEL & set(topic) or _NOT_IN_MQTT_LEVEL & set(routing_key):
        return None
    return f"{topic}/{routing_key.replace('.', '/')}" if routing_key else topic


def feed_routing_key(exchange: str, topic: str, message: Message) -> str:
    """The routing key a message another protocol stored in ``topic`` is routed
    through ``exchange`` with. For ``amq.topic``: its MQTT topic name with ``/`` as
    ``.`` (the storage topic's name for a message without one). For exchange ``T``:
    the MQTT sub-topic (``T/a/b`` -> ``a.b``, ``T`` -> empty), else the tag
    (RocketMQ), else the key (Kafka's record key, RocketMQ's keys), else empty."""
    raw = message.property(interop.MQTT_TOPIC)
    name = raw.decode(errors="replace") if raw is not None else None
    if exchange == AMQ_TOPIC:
        return (name or topic).replace("/", ".")
    if name is not None:
        if name == topic:
            return ""
        if name.startswith(topic + "/"):
            return name[len(topic) + 1 :].replace("/", ".")
    if message.tag:
        return message.tag
    if message.key is not None:
        return message.key.decode(errors="replace")
    return ""
