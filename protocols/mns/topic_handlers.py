"""MNS topic and subscription operations, one handler per operation: read the
request, call the :class:`TopicService`, render the answer."""

from __future__ import annotations

from fastapi import Request, Response

from polymq.gateway.permissions import Operation
from polymq.gateway.processor import Caller
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import body_md5
from polymq.protocols.mns.request import RequestReader, message_documents
from polymq.protocols.mns.topics import TopicService

__all__ = ["TopicHandlers"]


class TopicHandlers:
    def __init__(self, reader: RequestReader, topics: TopicService) -> None:
        self._reader = reader
        self._topics = topics

    async def _authorize(self, caller: Caller, topic: str, operation: Operation) -> None:
        """The permission model's check on ``topic`` (docs/permissions.md): its
        AccessDenied answers MNS's AccessDenied, 403."""
        await self._topics.processor.authorize(caller, "topic", topic, operation)

    async def put_topic(self, request: Request, topic: str) -> Response:
        """CreateTopic, or SetTopicAttributes with ``?metaoverride=true``."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "create")
        return await call.create_or_override(
            self._topics.create,
            self._topics.set_attributes,
            topic,
            location=call.url("topics", topic),
        )

    async def get_topic(self, request: Request, topic: str) -> Response:
        """GetTopicAttributes."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "describe")
        attrs = await self._topics.attributes(call.caller, topic)
        fields = {
            "TopicName": topic,
            "MessageCount": await self._topics.message_count(call.caller, topic),
            "MaximumMessageSize": attrs.maximum_message_size,
            "MessageRetentionPeriod": attrs.message_retention_period,
            "CreateTime": attrs.create_time // 1000,
            "LastModifyTime": attrs.last_modify_time // 1000,
            "LoggingEnabled": attrs.logging_enabled,
        }
        return call.reply(200, "Topic", fields)

    async def delete_topic(self, request: Request, topic: str) -> Response:
        """DeleteTopic (and its subscriptions)."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "delete")
        await self._topics.delete(call.caller, topic)
        return call.reply(204)

    async def list_topics(self, request: Request) -> Response:
        """ListTopic."""
        call = await self._reader.read(request)
        processor = self._topics.processor
        names = [
            name
            for name in await self._topics.names(call.caller)
            if await processor.permitted(call.caller, "topic", name, "describe")
        ]
        page, marker = call.page(names)
        items = [{"TopicURL": call.url("topics", name), "TopicName": name} for name in page]
        return call.reply(200, "Topics", {"Topic": items, "NextMarker": marker})

    async def publish(self, request: Request, topic: str) -> Response:
        """PublishMessage."""
        call = await self._reader.read(request)
        documents, batch = message_documents(call.root, call.document)
        if batch or len(documents) != 1:
            raise MnsError.invalid_argument("PublishMessage takes one <Message>.")
        await self._authorize(call.caller, topic, "write")
        outgoing, result = await self._topics.publish(call.caller, topic, documents[0])
        return call.reply(
            201,
            "Message",
            {
                "MessageId": result.message_id,
                "MessageBodyMD5": body_md5(outgoing.message.body),
                "MessageGroupId": outgoing.message.message_group,
            },
        )

    async def put_subscription(self, request: Request, topic: str, subscription: str) -> Response:
        """Subscribe, or SetSubscriptionAttributes with ``?metaoverride=true``."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "read")
        return await call.create_or_override(
            self._topics.subscribe,
            self._topics.set_subscription,
            topic,
            subscription,
            location=call.url("topics", topic, "subscriptions", subscription),
        )

    async def get_subscription(self, request: Request, topic: str, subscription: str) -> Response:
        """GetSubscriptionAttributes."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "describe")
        attrs = await self._topics.subscription(call.caller, topic, subscription)
        fields = {
            "TopicOwner": call.caller.namespace,
            "TopicName": topic,
            "SubscriptionName": subscription,
            "Endpoint": attrs.endpoint,
            "NotifyStrategy": attrs.notify_strategy,
            "NotifyContentFormat": attrs.notify_content_format,
            "FilterTag": attrs.filter_tag or None,
            "CreateTime": attrs.create_time // 1000,
            "LastModifyTime": attrs.last_modify_time // 1000,
        }
        return call.reply(200, "Subscription", fields)

    async def delete_subscription(
        self, request: Request, topic: str, subscription: str
    ) -> Response:
        """Unsubscribe."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "read")
        await self._topics.unsubscribe(call.caller, topic, subscription)
        return call.reply(204)

    async def list_subscriptions(self, request: Request, topic: str) -> Response:
        """ListSubscriptionByTopic."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, topic, "describe")
        page, marker = call.page(await self._topics.subscriptions(call.caller, topic))
        items = [
            {"SubscriptionURL": call.url("topics", topic, "subscriptions", name)} for name in page
        ]
        return call.reply(200, "Subscriptions", {"Subscription": items, "NextMarker": marker})
