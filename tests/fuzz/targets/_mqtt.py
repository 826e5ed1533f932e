"""What both MQTT targets do: decode a byte stream at one protocol level, then put the
filters of every SUBSCRIBE into a topic-filter index and match every PUBLISH's topic
against it, as the broker does. The index is fed any number of levels (the broker stops
at ``mqtt.max_topic_levels``, but the index must not depend on that: a 1,500-level
walk once recursed past Python's limit).

Documented errors: :class:`MalformedPacket` (and its :class:`UnsupportedProtocol`),
:class:`ProtocolError`, :class:`PacketTooLarge`; ``ValueError`` from ``split_shared``
for a malformed ``$share/`` filter.
"""

from __future__ import annotations

from polymq.protocols.mqtt.codec import (
    Decoder,
    MalformedPacket,
    PacketTooLarge,
    ProtocolError,
    Publish,
    Subscribe,
    Unsubscribe,
)
from polymq.protocols.mqtt.topic_filter_index import (
    TopicFilterIndex,
    is_valid_filter,
    is_valid_topic_name,
    split_shared,
)

_MAX_PACKET_BYTES = 1 << 20


def run(data: bytes, level: int) -> None:
    decoder = Decoder(level=level, max_packet_bytes=_MAX_PACKET_BYTES)
    try:
        packets = decoder.feed(data)
    except (MalformedPacket, ProtocolError, PacketTooLarge):
        return
    index: TopicFilterIndex[int] = TopicFilterIndex()
    for packet in packets:
        if isinstance(packet, Subscribe):
            for subscription in packet.subscriptions:
                topic_filter = subscription.filter
                try:
                    shared = split_shared(topic_filter)
                except ValueError:
                    continue
                if shared is not None:
                    topic_filter = shared[1]
                if is_valid_filter(topic_filter):
                    index.add(topic_filter, 0, subscription.qos)
        elif isinstance(packet, Unsubscribe):
            for topic_filter in packet.filters:
                index.remove(topic_filter, 0)
        elif isinstance(packet, Publish) and is_valid_topic_name(packet.topic):
            index.match(packet.topic)
