"""EndTransaction, and the check-back of orphaned transactions.

A half message left undecided for ``transaction_timeout_ms`` is checked with a
producer of its topic through that producer's Telemetry stream
(RecoverOrphanedTransactionCommand); the producer answers with EndTransaction, source
SOURCE_SERVER_CHECK. After ``transaction_max_checks`` unanswered checks the half is
rolled back, as Apache's broker discards it after 15.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq import mapping
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.sessions import PRODUCER
from polymq.protocols.rocketmq.status import RpcFailure, ok
from polymq.storage.errors import StorageError
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import HalfMessage, MessageType, StoredMessage

__all__ = ["TransactionChecker", "end_transaction"]

log = logging.getLogger(__name__)


async def end_transaction(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.topic.resource_namespace)
    await rt.processor.authorize(caller, "topic", request.topic.name, "write")
    if not request.transaction_id:
        raise RpcFailure(Code.INVALID_TRANSACTION_ID, "transaction id is empty")
    if request.resolution == definition_pb2.COMMIT:
        commit = True
    elif request.resolution == definition_pb2.ROLLBACK:
        commit = False
    elif request.source == definition_pb2.SOURCE_SERVER_CHECK:
        return service_pb2.EndTransactionResponse(status=ok())  # "unknown": ask again later
    else:
        raise RpcFailure(Code.BAD_REQUEST, "transaction resolution must be COMMIT or ROLLBACK")
    await rt.processor.end_transaction(caller, request.transaction_id, commit=commit)
    rt.transaction_checks.pop((caller.namespace, request.transaction_id), None)
    return service_pb2.EndTransactionResponse(status=ok())


def _check_command(rt: RocketMQServices, half: HalfMessage) -> Any:
    stored = StoredMessage(
        message=half.message,
        queue=half.queues[0],
        offset=0,
        message_id=half.message_id,
        store_timestamp_ms=half.store_timestamp_ms,
    )
    message = mapping.to_proto(
        stored,
        namespace=half.queues[0].namespace,
        message_type=MessageType.TRANSACTION,
        store_host=rt.store_host,
    )
    command = service_pb2.RecoverOrphanedTransactionCommand(
        message=message, transaction_id=half.transaction_id
    )
    return service_pb2.TelemetryCommand(recover_orphaned_transaction_command=command)


class TransactionChecker:
    """Runs while the listener serves; one pass every check interval."""

    def __init__(self, rt: RocketMQServices) -> None:
        self._rt = rt

    def start(self, tasks: TaskSet) -> None:
        """Check as one of the listener's ``tasks``, which its stop closes."""
        tasks.spawn(self._run(), name="rocketmq-transaction-check")

    async def _run(self) -> None:
        interval = self._rt.options.transaction_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_once()
            except Exception:
                log.exception("rocketmq: transaction check-back pass failed")

    async def check_once(self) -> None:
        """Ask a producer about each overdue half of each namespace with producers
        online (a half whose producers are all gone waits for one to connect)."""
        rt = self._rt
        callers = {s.caller.namespace: s.caller for s in rt.sessions if s.client_type == PRODUCER}
        for namespace, caller in callers.items():
            halves = await rt.processor.list_undecided(
                caller, older_than_ms=rt.options.transaction_timeout_ms
            )
            for half in halves:
                if not half.queues:
                    continue
                producer = rt.sessions.producer_for(namespace, half.queues[0].topic)
                if producer is None:
                    continue
                key = (namespace, half.transaction_id)
                checks = rt.transaction_checks.get(key, 0) + 1
                if checks > rt.options.transaction_max_checks:
                    await self._give_up(caller, half, key)
                    continue
                rt.transaction_checks[key] = checks
                producer.send(_check_command(rt, half))

    async def _give_up(self, caller: Caller, half: HalfMessage, key: tuple[str, str]) -> None:
        rt = self._rt
        rt.transaction_checks.pop(key, None)
        log.warning(
            "rocketmq: transaction %s undecided after %d checks; rolled back",
            half.transaction_id,
            rt.options.transaction_max_checks,
        )
        with contextlib.suppress(StorageError):  # decided meanwhile
            await rt.processor.end_transaction(caller, half.transaction_id, commit=False)
