"""MNS queue operations (and the account's), one handler per operation: read the
request, call the :class:`QueueService`, render the answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request, Response

from polymq.gateway.fairness import cooperatively
from polymq.gateway.permissions import Operation
from polymq.gateway.processor import Caller
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import body_md5, render_message
from polymq.protocols.mns.queues import QueueService, Sent
from polymq.protocols.mns.request import BATCH_MAX, RequestReader, message_documents
from polymq.storage.model import StoredMessage

__all__ = ["QueueHandlers"]


class QueueHandlers:
    def __init__(self, reader: RequestReader, queues: QueueService) -> None:
        self._reader = reader
        self._queues = queues

    async def _authorize(self, caller: Caller, queue: str, operation: Operation) -> None:
        """The permission model's check on ``queue`` (docs/permissions.md): its
        AccessDenied answers MNS's AccessDenied, 403."""
        await self._queues.processor.authorize(caller, "topic", queue, operation)

    async def put_queue(self, request: Request, queue: str) -> Response:
        """CreateQueue, or SetQueueAttributes with ``?metaoverride=true``."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, queue, "create")
        return await call.create_or_override(
            self._queues.create,
            self._queues.set_attributes,
            queue,
            location=call.url("queues", queue),
        )

    async def get_queue(self, request: Request, queue: str) -> Response:
        """GetQueueAttributes."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, queue, "describe")
        attrs = await self._queues.attributes(call.caller, queue)
        counts = await self._queues.counts(call.caller, queue)
        fields = {
            "QueueName": queue,
            **attrs.to_fields(),
            "ActiveMessages": counts.active,
            "InactiveMessages": counts.inactive,
            "DelayMessages": counts.delayed,
        }
        return call.reply(200, "Queue", fields)

    async def delete_queue(self, request: Request, queue: str) -> Response:
        """DeleteQueue."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, queue, "delete")
        await self._queues.delete(call.caller, queue)
        return call.reply(204)

    async def list_queues(self, request: Request) -> Response:
        """ListQueue (``x-mns-prefix``, ``x-mns-marker``, ``x-mns-ret-number``)."""
        call = await self._reader.read(request)
        processor = self._queues.processor
        names = [
            name
            for name in await self._queues.names(call.caller)
            if await processor.permitted(call.caller, "topic", name, "describe")
        ]
        page, marker = call.page(names)
        with_meta = call.option("with-meta") == "true"
        items: list[dict[str, Any]] = []
        for name in page:
            item: dict[str, Any] = {"QueueURL": call.url("queues", name)}
            if with_meta:
                item["QueueName"] = name
                item.update((await self._queues.attributes(call.caller, name)).to_fields())
            items.append(item)
        return call.reply(200, "Queues", {"Queue": items, "NextMarker": marker})

    async def post_messages(self, request: Request, queue: str) -> Response:
        """SendMessage (a ``<Message>``) or BatchSendMessage (``<Messages>``)."""
        call = await self._reader.read(request)
        documents, batch = message_documents(call.root, call.document)
        await self._authorize(call.caller, queue, "write")
        sent = await self._queues.send(call.caller, queue, documents)
        if not batch:
            if isinstance(sent[0], MnsError):
                raise sent[0]
            return call.reply(201, "Message", _sent_message(sent[0], with_group=True))
        stored = [one for one in sent if not isinstance(one, MnsError)]
        if len(stored) == len(sent):
            return call.reply(201, "Messages", [_sent_message(s, with_group=True) for s in stored])
        # Some refused: MNS answers 500 with an entry per message, the error or (exactly
        # MessageId and MessageBodyMD5, all the SDK takes there) the stored message.
        entries = [
            {"ErrorCode": one.code, "ErrorMessage": one.message}
            if isinstance(one, MnsError)
            else _sent_message(one, with_group=False)
            for one in sent
        ]
        return call.reply(500, "Messages", entries)

    async def get_messages(self, request: Request, queue: str) -> Response:
        """ReceiveMessage / BatchReceiveMessage (``numOfMessages``, ``waitseconds``),
        PeekMessage / BatchPeekMessage (``peekonly=true``)."""
        call = await self._reader.read(request)
        count = call.int_query("numOfMessages", 1, BATCH_MAX)
        await self._authorize(call.caller, queue, "read")
        messages: list[StoredMessage]
        peek = call.query.get("peekonly") == "true"
        if peek:
            messages = await self._queues.peek(call.caller, queue, count=count or 1)
        else:
            wait = call.int_query("waitseconds", 0, 30)
            messages = await self._queues.receive(call.caller, queue, count=count or 1, wait_s=wait)
        rendered = [render_message(m, receipt=not peek) async for m in cooperatively(messages)]
        if count is None:
            return call.reply(200, "Message", rendered[0])
        return call.reply(200, "Messages", rendered)

    async def delete_messages(self, request: Request, queue: str) -> Response:
        """DeleteMessage (``?ReceiptHandle=``) or BatchDeleteMessage (``<ReceiptHandles>``)."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, queue, "read")
        receipt = call.query.get("receipthandle")
        if receipt is not None:
            await self._queues.delete_message(call.caller, queue, receipt)
            return call.reply(204)
        receipts = _receipt_handles(call.root, call.document)
        if not receipts:
            raise MnsError("MissingReceiptHandle", "ReceiptHandle is required.")
        outcomes = await self._queues.delete_messages(call.caller, queue, receipts)
        errors = [
            {
                "ErrorCode": "ReceiptHandleError"
                if code == "invalid_receipt"
                else "MessageNotExist",
                "ErrorMessage": "The receipt handle you provided is not valid.",
                "ReceiptHandle": handle,
            }
            for handle, code in zip(receipts, outcomes, strict=True)
            if code is not None
        ]
        if errors:
            return call.reply(404, "Errors", errors)
        return call.reply(204)

    async def put_messages(self, request: Request, queue: str) -> Response:
        """ChangeMessageVisibility (``?ReceiptHandle=&VisibilityTimeout=``)."""
        call = await self._reader.read(request)
        await self._authorize(call.caller, queue, "read")
        receipt = call.query.get("receipthandle")
        if not receipt:
            raise MnsError("MissingReceiptHandle", "ReceiptHandle is required.")
        timeout = call.int_query("VisibilityTimeout", 1, 43200)
        if timeout is None:
            raise MnsError("MissingVisibilityTimeout", "VisibilityTimeout is required.")
        stored = await self._queues.change_visibility(call.caller, queue, receipt, timeout)
        return call.reply(
            200,
            "ChangeVisibility",
            {"ReceiptHandle": stored.receipt, "NextVisibleTime": stored.next_visible_ms or 0},
        )

    async def get_account(self, request: Request) -> Response:
        """GetAccountAttributes (``/?accountmeta=true``): no logging bucket here."""
        call = await self._reader.read(request)
        return call.reply(200, "Account", {"LoggingBucket": ""})

    async def put_account(self, request: Request) -> Response:
        """SetAccountAttributes: accepted and ignored (polymq has no logging bucket)."""
        call = await self._reader.read(request)
        return call.reply(204)


def _sent_message(sent: Sent, *, with_group: bool) -> dict[str, Any]:
    outgoing, result = sent
    fields = {"MessageId": result.message_id, "MessageBodyMD5": body_md5(outgoing.message.body)}
    if with_group and outgoing.message.message_group is not None:
        fields["MessageGroupId"] = outgoing.message.message_group
    return fields


def _receipt_handles(root: str | None, document: Any) -> list[str]:
    if root is None and isinstance(document, Mapping):
        document = document.get("ReceiptHandles", [])
    elif root not in (None, "ReceiptHandles"):
        raise MnsError.invalid_argument(f"expected <ReceiptHandles>, got <{root}>.")
    if not isinstance(document, list) or not all(isinstance(r, str) for r in document):
        raise MnsError.invalid_argument("ReceiptHandles must be a list of strings.")
    return [r for r in document if r]
