"""RocketMQ SQL92 filter expressions: ``parse`` then ``evaluate`` against messages with
and without the properties an expression names. The bytes are the expression's
UTF-8 text (undecodable bytes replaced, as a gRPC string cannot hold them).

Documented error: :class:`SqlError` (a subscription with ILLEGAL_FILTER_EXPRESSION).
"""

from __future__ import annotations

from polymq.protocols.rocketmq.sql92 import SqlError, evaluate, parse
from polymq.storage.model import Message

_MESSAGES = (
    Message(body=b"x"),
    Message(
        body=b"x",
        tag="TagA",
        properties=(("a", b"1"), ("b", b"abc"), ("c", b"2.5"), ("flag", b"true"), ("s", b"")),
    ),
)


def one_input(data: bytes) -> None:
    try:
        expression = parse(data.decode("utf-8", errors="replace"))
    except SqlError:
        return
    for message in _MESSAGES:
        evaluate(expression, message)
