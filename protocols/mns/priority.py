"""Priority levels of an MNS queue: one storage queue per level, popped highest first
(as the AMQP adapter does ``x-max-priority``). Pure.

MNS priorities run from 1 (highest) to 16 (lowest), 8 by default. A queue starts with
one storage queue, and grows to 16 on its first message of another priority (storage
topics only grow: the messages already there stay put). The default level is storage
queue 0, so the messages stored before the growth are at the default level, as is what
other protocols (Kafka partition 0, AMQP, dead letters, topic subscriptions) append.
Levels 1-7 are storage queues 1-7, levels 9-16 storage queues 8-15. A storage topic
of 2 to 15 queues (another protocol's) is unprioritised: queue 0 only, as before.
"""

from __future__ import annotations

from polymq.storage.model import Message, QueueRef, TopicInfo

__all__ = [
    "DEFAULT_PRIORITY",
    "LEVELS",
    "PRIORITY",
    "levels_of",
    "priority_of",
    "queue_id_for",
    "refs_in_pop_order",
]

DEFAULT_PRIORITY = 8
LEVELS = 16  # storage queues of a prioritised MNS queue
PRIORITY = "mns.priority"  # the property a non-default priority travels under


def priority_of(message: Message) -> int:
    """A message's MNS priority; the default for messages without a valid one."""
    raw = message.property(PRIORITY)
    try:
        value = int(raw) if raw else DEFAULT_PRIORITY
    except ValueError:
        return DEFAULT_PRIORITY
    return value if 1 <= value <= LEVELS else DEFAULT_PRIORITY


def levels_of(info: TopicInfo) -> int:
    """The priority levels of an MNS queue held in this storage topic."""
    return LEVELS if len(info.queues) >= LEVELS else 1


def queue_id_for(priority: int, levels: int) -> int:
    """The storage queue holding messages of ``priority`` in a queue of ``levels``."""
    if levels < LEVELS or priority == DEFAULT_PRIORITY:
        return 0
    return priority if priority < DEFAULT_PRIORITY else priority - 1


def refs_in_pop_order(namespace: str, topic: str, levels: int) -> tuple[QueueRef, ...]:
    """The storage queues of an MNS queue, highest priority first."""
    if levels < LEVELS:
        return (QueueRef(namespace, topic),)
    return tuple(QueueRef(namespace, topic, queue_id_for(p, levels)) for p in range(1, LEVELS + 1))
