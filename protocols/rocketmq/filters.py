"""Subscription filter expressions (pure): tag expressions (``*``, ``a||b``), pushed
down to storage's tag filter, and SQL92 expressions over message properties,
evaluated here (see :mod:`protocols.rocketmq.sql92`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rocketmq.grpc_protocol import Code, definition_pb2

from polymq.protocols.rocketmq import sql92
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.model import Message

__all__ = ["MATCH_ALL", "Filter", "parse_filter", "parse_tags"]


@dataclass(frozen=True, slots=True)
class Filter:
    """``tags`` narrows what storage hands out (``None``: every tag); ``sql`` is then
    checked per message (``None``: no further check)."""

    tags: frozenset[str] | None = None
    sql: sql92.Expression | None = None

    def matches(self, message: Message) -> bool:
        if self.tags is not None and message.tag not in self.tags:
            return False
        return self.sql is None or sql92.evaluate(self.sql, message)


MATCH_ALL = Filter()


def parse_tags(expression: str) -> frozenset[str] | None:
    """``None`` for "every tag" (``*`` or empty), else the set of tags named."""
    text = expression.strip()
    if not text or text == "*":
        return None
    tags = frozenset(t.strip() for t in text.split("||") if t.strip())
    if not tags:
        raise RpcFailure(Code.ILLEGAL_FILTER_EXPRESSION, f"bad tag expression {expression!r}")
    return tags


@functools.lru_cache(maxsize=256)
def parse_filter(
    filter_type: int, expression: str, *, max_depth: int = sql92.DEFAULT_MAX_DEPTH
) -> Filter:
    """A subscription's filter; ILLEGAL_FILTER_EXPRESSION for one that does not parse
    or exceeds the bounds of :func:`sql92.parse` (``max_depth``: the gateway's
    ``limits.max_nesting_depth``). Cached: consumers send their filter with every
    receive, and a long one costs milliseconds of the event loop to parse."""
    if filter_type == definition_pb2.SQL:
        try:
            return Filter(sql=sql92.parse(expression, max_depth=max_depth))
        except sql92.SqlError as e:
            raise RpcFailure(Code.ILLEGAL_FILTER_EXPRESSION, str(e)) from e
    tags = parse_tags(expression)
    return MATCH_ALL if tags is None else Filter(tags=tags)
