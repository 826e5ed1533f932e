"""A shard between owners (``ShardAway``, and ``ShardMoved`` from a deposed owner's log)
is answered as any unavailable storage by every protocol: its retryable error, never
an internal one. MNS looked its storage errors up by exact class, and answered them
500 InternalError."""

from __future__ import annotations

import pytest

from polymq.protocols.amqp import errors as amqp_errors
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.mns.errors import from_exception
from polymq.protocols.rocketmq.status import status_for
from polymq.storage.errors import ShardAway, ShardMoved, StorageError, StorageUnavailable

ONE_FORM = True


@pytest.mark.parametrize("error_type", [ShardAway, ShardMoved])
def test_a_shard_between_owners_answers_as_unavailable_storage(
    error_type: type[StorageError],
) -> None:
    away, unavailable = error_type("shard-1 moving"), StorageUnavailable("node down")
    mns, mns_base = from_exception(away), from_exception(unavailable)
    assert mns is not None and mns_base is not None
    assert (mns.code, mns.status) == (mns_base.code, mns_base.status) == ("ServiceUnavailable", 503)
    assert error_code(away) == error_code(unavailable)
    assert status_for(away).code == status_for(unavailable).code
    amqp, amqp_base = amqp_errors.from_storage(away), amqp_errors.from_storage(unavailable)
    assert (type(amqp), amqp.code) == (type(amqp_base), amqp_base.code)
