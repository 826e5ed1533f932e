"""The Kafka wire protocol adapter (issue 6).

Importing the package registers the ``kafka.v2`` batch expander, so record batches
are stored once, as produced, and other protocols still read single messages.
"""

from __future__ import annotations

from polymq.protocols.kafka.records import BATCH_FORMAT, expand_batch
from polymq.storage import batch_formats

batch_formats.register(BATCH_FORMAT, expand_batch)

__all__ = ["BATCH_FORMAT"]
