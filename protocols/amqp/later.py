"""Shared AMQP state written once storage is back.

Some writes concern every gateway but not the client that caused them: a consumer's
registration (exclusive consumers, single-active-consumer's line, consumer counts
on other gateways) and its removal. When the node they need is down (the
namespace's home, for the metadata; the vhost's change log's node), the client's own
operation goes on (a consumer of a queue on a live node consumes; a channel closes
with close-ok) and the write is retried here until it lands or is moot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from polymq.storage.errors import StorageError, StorageUnavailable

__all__ = ["until_stored"]

log = logging.getLogger(__name__)

_FIRST_PAUSE_S: Final = 0.2
_MAX_PAUSE_S: Final = 5.0


async def until_stored(
    write: Callable[[], Awaitable[None]], wanted: Callable[[], bool], what: str
) -> None:
    """Retry ``write`` while storage is unavailable and ``wanted()`` holds."""
    pause = _FIRST_PAUSE_S
    while wanted():
        try:
            await write()
            log.info("amqp: %s stored, storage is back", what)
            return
        except StorageUnavailable as e:
            log.debug("amqp: %s still waits for storage: %s", what, e)
        except StorageError as e:
            log.warning("amqp: %s given up: %s", what, e)
            return
        await asyncio.sleep(pause)
        pause = min(_MAX_PAUSE_S, pause * 2)
