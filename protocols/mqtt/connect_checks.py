"""What a CONNECT the decoder took may still be refused for: checked at CONNECT, so
that nothing fails later, at a session save or at the will's publication."""

from __future__ import annotations

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.mapping import storage_topic
from polymq.protocols.mqtt.topic_filter_index import is_valid_topic_name, topic_levels
from polymq.storage.errors import InvalidName
from polymq.storage.names import check_name

__all__ = ["connect_problem", "will_topic_problem"]

# v5 reason codes (2.4)
_PROTOCOL_ERROR = 0x82
_CLIENT_ID_INVALID = 0x85
_TOPIC_INVALID = 0x90


def connect_problem(
    connect: codec.Connect, v5: bool, max_topic_levels: int
) -> tuple[int, str] | None:
    """The CONNACK code and the reason for refusing ``connect``, if it is refused."""
    props = connect.properties
    for pid, name in (
        (codec.RECEIVE_MAXIMUM, "receive maximum"),
        (codec.MAXIMUM_PACKET_SIZE, "maximum packet size"),
    ):
        if props.get(pid) == 0:  # v5 3.1.2.11.3-4
            return _PROTOCOL_ERROR, f"{name} 0"
    if connect.will_topic is not None:
        problem = will_topic_problem(connect.will_topic, max_topic_levels)
        if problem is not None:  # v3 has no such code: 3, as EMQX maps 0x90
            return (_TOPIC_INVALID if v5 else 3), f"will topic {problem}"
    persistent = props.get(codec.SESSION_EXPIRY, 0) > 0 if v5 else not connect.clean_start
    if persistent and connect.client_id:
        try:  # a kept session is stored under its client id
            check_name("client id", connect.client_id)
        except InvalidName as e:
            return (_CLIENT_ID_INVALID if v5 else 2), f"persistent session: {e}"
    return None


def will_topic_problem(topic: str, max_topic_levels: int) -> str | None:
    """Why a will topic could not be published at session end, if it could not:
    checked like a PUBLISH topic (v5 3.1.3.3), and against the storage topic's name
    rules, so no will fails only when the session ends."""
    if not is_valid_topic_name(topic):
        return "is empty or has a wildcard"
    if topic_levels(topic) > max_topic_levels:
        return f"has more than {max_topic_levels} levels"
    try:
        check_name("topic", storage_topic(topic))
    except InvalidName as e:
        return f"cannot be stored: {e}"
    return None
