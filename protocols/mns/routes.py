"""The MNS HTTP API as FastAPI routes (MNS API reference: queues, topics,
subscriptions, account), each to one handler of :mod:`queue_handlers` or
:mod:`topic_handlers`.

Requests are signed per request (``Authorization: MNS AccessKeyId:Signature``); the
access key decides the namespace. In open auth mode unsigned requests act as the
anonymous admin in the default namespace.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from gateway.accounts import Accounts
from gateway.connections import ConnectionRegistry
from gateway.processor import Processor
from protocols.mns.auth import RequestAuth
from protocols.mns.notify import Notifier
from protocols.mns.queue_handlers import QueueHandlers
from protocols.mns.queues import QueueService
from protocols.mns.request import RequestReader
from protocols.mns.topic_handlers import TopicHandlers
from protocols.mns.topics import TopicService

__all__ = ["MnsApi"]


class MnsApi:
    """The services and handlers of the MNS API, and the router over them."""

    def __init__(
        self,
        *,
        processor: Processor,
        accounts: Accounts,
        notifier: Notifier,
        max_message_bytes: int,
        max_date_skew_s: int,
        connections: ConnectionRegistry | None = None,
    ) -> None:
        auth = RequestAuth(accounts, processor.clock, max_date_skew_s=max_date_skew_s)
        reader = RequestReader(auth, max_message_bytes=max_message_bytes, connections=connections)
        self.queues = QueueService(processor, max_message_bytes=max_message_bytes)
        self.topics = TopicService(processor, notifier, max_message_bytes=max_message_bytes)
        self._queue_handlers = QueueHandlers(reader, self.queues)
        self._topic_handlers = TopicHandlers(reader, self.topics)

    def router(self) -> APIRouter:
        router = APIRouter(tags=["MNS"])
        q, t = self._queue_handlers, self._topic_handlers
        table: tuple[tuple[str, str, Any, str], ...] = (
            ("GET", "/", q.get_account, "GetAccountAttributes"),
            ("PUT", "/", q.put_account, "SetAccountAttributes"),
            ("GET", "/queues", q.list_queues, "ListQueue"),
            ("PUT", "/queues/{queue}", q.put_queue, "CreateQueue / SetQueueAttributes"),
            ("GET", "/queues/{queue}", q.get_queue, "GetQueueAttributes"),
            ("DELETE", "/queues/{queue}", q.delete_queue, "DeleteQueue"),
            ("POST", "/queues/{queue}/messages", q.post_messages, "SendMessage / Batch"),
            ("GET", "/queues/{queue}/messages", q.get_messages, "Receive / Peek (Batch)"),
            ("DELETE", "/queues/{queue}/messages", q.delete_messages, "DeleteMessage / Batch"),
            ("PUT", "/queues/{queue}/messages", q.put_messages, "ChangeMessageVisibility"),
            ("GET", "/topics", t.list_topics, "ListTopic"),
            ("PUT", "/topics/{topic}", t.put_topic, "CreateTopic / SetTopicAttributes"),
            ("GET", "/topics/{topic}", t.get_topic, "GetTopicAttributes"),
            ("DELETE", "/topics/{topic}", t.delete_topic, "DeleteTopic"),
            ("POST", "/topics/{topic}/messages", t.publish, "PublishMessage"),
            ("GET", "/topics/{topic}/subscriptions", t.list_subscriptions, "ListSubscription"),
            (
                "PUT",
                "/topics/{topic}/subscriptions/{subscription}",
                t.put_subscription,
                "Subscribe / SetSubscriptionAttributes",
            ),
            (
                "GET",
                "/topics/{topic}/subscriptions/{subscription}",
                t.get_subscription,
                "GetSubscriptionAttributes",
            ),
            (
                "DELETE",
                "/topics/{topic}/subscriptions/{subscription}",
                t.delete_subscription,
                "Unsubscribe",
            ),
        )
        for method, path, endpoint, summary in table:
            router.add_api_route(
                path,
                endpoint,
                methods=[method],
                summary=summary,
                response_class=Response,
                name=summary,
            )
        return router
