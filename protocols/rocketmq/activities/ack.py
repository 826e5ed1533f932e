"""AckMessage, ChangeInvisibleDuration and ForwardMessageToDeadLetterQueue: what a
consumer does with a received message, named by its receipt handle."""

from __future__ import annotations

from typing import Any

from rocketmq.grpc_protocol import Code, service_pb2

from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq.activities.receive import duration_ms
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.slicing import slices_between
from polymq.protocols.rocketmq.status import RpcFailure, ok, status

__all__ = ["ack_message", "change_invisible_duration", "forward_to_dead_letter_queue"]

_ERROR_CODES = {"invalid_receipt": Code.INVALID_RECEIPT_HANDLE}


async def _ack_slice(
    rt: RocketMQServices, caller: Caller, group: str, held: list[str]
) -> list[Any]:
    """Acks one slice with one write, fsynced before the answer with ``rocketmq.flush =
    "sync"`` only (with ASYNC_FLUSH a power loss may bring an acked message back: at
    least once still holds); the errors (``None``: acked), in order."""
    durable = rt.sync_flush
    receipts = [rt.renewer.current(caller, group, r) for r in held]
    errors = await rt.processor.ack_many(caller, group, receipts, durable=durable)
    # A renewal may have replaced a receipt while the ack was on its way: ack the new one.
    retry = [
        i
        for i, (r, error) in enumerate(zip(receipts, errors, strict=True))
        if error is not None and rt.renewer.current(caller, group, held[i]) != r
    ]
    if retry:
        again = [rt.renewer.current(caller, group, held[i]) for i in retry]
        acked = await rt.processor.ack_many(caller, group, again, durable=durable)
        for i, error in zip(retry, acked, strict=True):
            errors[i] = error
    for receipt in held:
        rt.renewer.release(caller, group, receipt)
    return list(errors)


async def ack_message(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """Acks the entries a slice at a time (one write each, the loop handed back
    between them); each entry gets its own status and the response MULTIPLE_RESULTS
    when they differ (Apache's rule)."""
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    count = len(request.entries)
    if not count:
        raise RpcFailure(Code.BAD_REQUEST, "no entry to ack")
    limit = rt.config.limits.max_batch_items
    if count > limit:
        raise RpcFailure(
            Code.PAYLOAD_TOO_LARGE, f"an ack carries at most {limit} entries, got {count}"
        )
    group = request.group.name
    held = [entry.receipt_handle for entry in request.entries]
    if any(not r for r in held):
        raise RpcFailure(Code.INVALID_RECEIPT_HANDLE, "receipt handle is empty")
    errors: list[Any] = []
    async for part in slices_between(count):
        errors += await _ack_slice(rt, caller, group, held[part])
    results = []
    for entry, error in zip(request.entries, errors, strict=True):
        entry_status = (
            ok()
            if error is None
            else status(_ERROR_CODES.get(error, Code.INTERNAL_ERROR), f"ack failed: {error}")
        )
        results.append(
            service_pb2.AckMessageResultEntry(
                message_id=entry.message_id,
                receipt_handle=entry.receipt_handle,
                status=entry_status,
            )
        )
    codes = {r.status.code for r in results}
    if len(codes) == 1:
        overall = results[0].status
    else:
        overall = status(Code.MULTIPLE_RESULTS, "entries have different results")
    return service_pb2.AckMessageResponse(status=overall, entries=results)


async def change_invisible_duration(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """Also the negative acknowledgement: the message is visible again after the new
    duration (counted from now) and its next delivery is a new attempt."""
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    invisible = duration_ms(request.invisible_duration)
    if not 0 <= invisible <= rt.options.max_invisible_ms:
        raise RpcFailure(Code.ILLEGAL_INVISIBLE_TIME, f"invisible duration {invisible} ms")
    if not request.receipt_handle:
        raise RpcFailure(Code.INVALID_RECEIPT_HANDLE, "receipt handle is empty")
    group = request.group.name
    receipt = rt.renewer.current(caller, group, request.receipt_handle)
    rt.renewer.release(caller, group, request.receipt_handle)  # a nack ends renewal
    stored = await rt.processor.change_invisibility(caller, group, receipt, invisible)
    return service_pb2.ChangeInvisibleDurationResponse(
        status=ok(), receipt_handle=stored.receipt or ""
    )


async def forward_to_dead_letter_queue(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    if not request.receipt_handle:
        raise RpcFailure(Code.INVALID_RECEIPT_HANDLE, "receipt handle is empty")
    group = request.group.name
    receipt = rt.renewer.current(caller, group, request.receipt_handle)
    rt.renewer.release(caller, group, request.receipt_handle)
    await rt.processor.dead_letter(caller, group, receipt)
    return service_pb2.ForwardMessageToDeadLetterQueueResponse(status=ok())
