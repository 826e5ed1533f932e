"""Queue, topic and subscription attributes: defaults, ranges (MNS API reference,
CreateQueue / CreateTopic / Subscribe) and their parsing from request documents. Pure.

Attributes are kept in the metadata store as the JSON form of these dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Self, cast

from polymq.protocols.mns.errors import MnsError
from polymq.storage.model import TopicConfig

__all__ = [
    "NOTIFY_FORMATS",
    "NOTIFY_STRATEGIES",
    "QueueAttributes",
    "SubscriptionAttributes",
    "TopicAttributes",
    "parse_int",
]

# (element, attribute, low, high): MNS's documented ranges.
_QUEUE_RANGES: tuple[tuple[str, str, int, int], ...] = (
    ("DelaySeconds", "delay_seconds", 0, 604800),
    ("MaximumMessageSize", "maximum_message_size", 1024, 65536),
    ("MessageRetentionPeriod", "message_retention_period", 60, 604800),
    ("VisibilityTimeout", "visibility_timeout", 1, 43200),
    ("PollingWaitSeconds", "polling_wait_seconds", 0, 30),
)

NOTIFY_STRATEGIES = ("BACKOFF_RETRY", "EXPONENTIAL_DECAY_RETRY")
NOTIFY_FORMATS = ("XML", "JSON", "SIMPLIFIED")


def parse_int(name: str, value: Any, low: int, high: int) -> int:
    """An integer element within [low, high], or MNS's InvalidArgument naming it."""
    text = str(value).strip()
    try:
        number = int(text)
    except ValueError:  # also past int()'s 4,300 digits
        shown = text if len(text) <= 40 else f"{text[:40]}..."
        raise MnsError.invalid_argument(f"{name} must be an integer, got {shown!r}.") from None
    if not low <= number <= high:
        raise MnsError.invalid_argument(f"The value of {name} should between {low} and {high}.")
    return number


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0", ""):
        return False
    raise MnsError.invalid_argument(f"{name} must be true or false, got {value!r}.")


def _section(document: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(document, Mapping):
        raise MnsError.invalid_argument(f"expected a <{what}> document")
    return document


class _Stored:
    """Attributes kept in the metadata store as a JSON object of their fields; keys a
    later version dropped are ignored on the way back."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(cast(Any, self))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        known = {f.name for f in fields(cast(Any, cls))}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueAttributes(_Stored):
    delay_seconds: int = 0
    maximum_message_size: int = 65536
    message_retention_period: int = 345600
    visibility_timeout: int = 30
    polling_wait_seconds: int = 0
    logging_enabled: bool = False
    # Beyond MNS, as SQS has them: a FIFO queue, and a dead-letter policy.
    fifo: bool = False
    dead_letter_queue: str | None = None
    max_receive_count: int | None = None
    create_time: int = 0
    last_modify_time: int = 0

    def updated(self, document: Any, *, creating: bool) -> Self:
        """These attributes with those named in a ``<Queue>`` document replaced."""
        doc = _section(document, "Queue")
        changes: dict[str, Any] = {}
        for element, attribute, low, high in _QUEUE_RANGES:
            if element in doc:
                changes[attribute] = parse_int(element, doc[element], low, high)
        if "LoggingEnabled" in doc:
            changes["logging_enabled"] = parse_bool("LoggingEnabled", doc["LoggingEnabled"])
        if "FifoQueue" in doc:
            fifo = parse_bool("FifoQueue", doc["FifoQueue"])
            if not creating and fifo != self.fifo:
                raise MnsError.invalid_argument("FifoQueue cannot change after creation.")
            changes["fifo"] = fifo
        if "DlqPolicy" in doc:
            policy = _section(doc["DlqPolicy"], "DlqPolicy")
            enabled = parse_bool("Enabled", policy.get("Enabled", True))
            target = str(policy.get("DeadLetterTargetQueue", "")).strip()
            if enabled and not target:
                raise MnsError.invalid_argument("DlqPolicy needs a DeadLetterTargetQueue.")
            changes["dead_letter_queue"] = target if enabled else None
            changes["max_receive_count"] = (
                parse_int("MaxReceiveCount", policy.get("MaxReceiveCount", 16), 1, 1000)
                if enabled
                else None
            )
        return replace(self, **changes)

    def to_fields(self) -> dict[str, Any]:
        """The attribute elements of GetQueueAttributes, in MNS's names."""
        out: dict[str, Any] = {
            "DelaySeconds": self.delay_seconds,
            "MaximumMessageSize": self.maximum_message_size,
            "MessageRetentionPeriod": self.message_retention_period,
            "VisibilityTimeout": self.visibility_timeout,
            "PollingWaitSeconds": self.polling_wait_seconds,
            "LoggingEnabled": self.logging_enabled,
            "CreateTime": self.create_time // 1000,
            "LastModifyTime": self.last_modify_time // 1000,
            "FifoQueue": self.fifo,
        }
        if self.dead_letter_queue is not None:
            out["DlqPolicy"] = {
                "Enabled": True,
                "DeadLetterTargetQueue": self.dead_letter_queue,
                "MaxReceiveCount": self.max_receive_count,
            }
        return out

    def same_settings(self, other: QueueAttributes) -> bool:
        """Equal but for timestamps: CreateQueue of an existing queue with the same
        attributes succeeds (204), with others it is QueueAlreadyExist."""
        return replace(self, create_time=0, last_modify_time=0) == replace(
            other, create_time=0, last_modify_time=0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicAttributes(_Stored):
    maximum_message_size: int = 65536
    # How long the topic keeps its own copy of each message (MNS: a day by default).
    message_retention_period: int = 86400
    logging_enabled: bool = False
    create_time: int = 0
    last_modify_time: int = 0

    def updated(self, document: Any) -> Self:
        doc = _section(document, "Topic")
        changes: dict[str, Any] = {}
        if "MaximumMessageSize" in doc:
            changes["maximum_message_size"] = parse_int(
                "MaximumMessageSize", doc["MaximumMessageSize"], 1024, 65536
            )
        if "MessageRetentionPeriod" in doc:
            changes["message_retention_period"] = parse_int(
                "MessageRetentionPeriod", doc["MessageRetentionPeriod"], 60, 604800
            )
        if "LoggingEnabled" in doc:
            changes["logging_enabled"] = parse_bool("LoggingEnabled", doc["LoggingEnabled"])
        return replace(self, **changes)

    @property
    def topic_config(self) -> TopicConfig:
        """The storage topic: its own queue keeps messages MessageRetentionPeriod."""
        return TopicConfig(queue_count=1, retention_ms=self.message_retention_period * 1000)


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionAttributes(_Stored):
    """``endpoint`` is an ``http(s)://`` URL or an MNS queue endpoint
    (``acs:mns:<region>:<account>:queues/<name>``, or just ``queues/<name>``)."""

    endpoint: str
    notify_strategy: str = "BACKOFF_RETRY"
    notify_content_format: str = "XML"
    filter_tag: str = ""
    create_time: int = 0
    last_modify_time: int = 0

    @property
    def queue(self) -> str | None:
        """The subscribed queue's name, for a queue endpoint."""
        if self.endpoint.startswith(("http://", "https://")):
            return None
        _, sep, name = self.endpoint.rpartition("queues/")
        return name if sep and name else None

    @classmethod
    def parse(cls, document: Any, *, now_ms: int) -> SubscriptionAttributes:
        doc = _section(document, "Subscription")
        endpoint = str(doc.get("Endpoint", "")).strip()
        if not endpoint:
            raise MnsError.invalid_argument("Subscription needs an Endpoint.")
        attrs = cls(endpoint=endpoint, create_time=now_ms, last_modify_time=now_ms)
        if attrs.queue is None and not endpoint.startswith(("http://", "https://")):
            raise MnsError.invalid_argument(
                f"Endpoint {endpoint!r} is neither an http(s) URL nor a queue endpoint."
            )
        if attrs.queue is not None and "NotifyContentFormat" not in doc:
            # A queue receives the published message itself: one stored body.
            attrs = replace(attrs, notify_content_format="SIMPLIFIED")
        return attrs.updated(doc, now_ms=now_ms, creating=True)

    def updated(self, document: Any, *, now_ms: int, creating: bool = False) -> Self:
        doc = _section(document, "Subscription")
        changes: dict[str, Any] = {"last_modify_time": now_ms}
        if "NotifyStrategy" in doc:
            strategy = str(doc["NotifyStrategy"]).strip()
            if strategy not in NOTIFY_STRATEGIES:
                raise MnsError.invalid_argument(
                    f"NotifyStrategy must be one of {', '.join(NOTIFY_STRATEGIES)}."
                )
            changes["notify_strategy"] = strategy
        if creating and "NotifyContentFormat" in doc:
            content_format = str(doc["NotifyContentFormat"]).strip()
            if content_format not in NOTIFY_FORMATS:
                raise MnsError.invalid_argument(
                    f"NotifyContentFormat must be one of {', '.join(NOTIFY_FORMATS)}."
                )
            changes["notify_content_format"] = content_format
        if creating and "FilterTag" in doc:
            tag = str(doc["FilterTag"]).strip()
            if len(tag) > 16:
                raise MnsError.invalid_argument("FilterTag is at most 16 characters long.")
            changes["filter_tag"] = tag
        return replace(self, **changes)

    def accepts(self, tag: str | None) -> bool:
        """Tag filtering: a subscription with a FilterTag gets only messages with it."""
        return not self.filter_tag or self.filter_tag == tag
