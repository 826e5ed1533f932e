"""The pure parts of the several-gateways machinery: the change log's records, who is
live and who owns a queue's chores, and what a view queue reads."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from polymq.navigation.endpoints import GatewayEndpoint
from polymq.protocols import interop
from polymq.protocols.amqp.changes import Change, Membership
from polymq.protocols.amqp.errors import ChannelError
from polymq.protocols.amqp.queue_arguments import validate_view
from polymq.protocols.amqp.queues import GROUP, QueueDef
from polymq.storage.model import QueueRef


class _Directory:
    def __init__(self, *ids: str) -> None:
        self.ids = list(ids)

    @property
    def self_id(self) -> str:
        return "unused"

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]:
        return [GatewayEndpoint(gateway_id=i, host="h", port=1) for i in self.ids]


def test_a_change_survives_its_encoding_and_garbage_is_skipped() -> None:
    change = Change(kind="queue", name="q", value={"uid": "u", "n": [1, 2]}, origin="gw#1")
    assert Change.decode(change.encode()) == change
    assert Change.decode(b"not json") is None
    assert Change.decode(b'{"kind": "queue"}') is None


def test_membership_tells_this_run_from_earlier_ones_and_peers_by_the_directory() -> None:
    directory = _Directory("a", "b")
    me = Membership(directory, "amqp", "a")
    assert me.peers() == ["b"]
    assert me.is_live(me.instance) and me.is_live("b#old")
    assert not me.is_live("a#earlier-run")
    directory.ids.remove("b")
    assert not me.is_live("b#old") and me.peers() == []


def test_each_queue_has_one_owner_among_the_live_gateways() -> None:
    directory = _Directory("a", "b", "c")
    members = [Membership(directory, "amqp", i) for i in ("a", "b", "c")]
    for name in (f"q{i}" for i in range(20)):
        assert sum(m.is_owner(name) for m in members) == 1
    alone = Membership(_Directory(), "amqp", "a")
    assert alone.is_owner("anything")


def test_a_view_reads_its_topic_with_a_group_of_its_own() -> None:
    view = QueueDef(name="v", arguments={interop.AMQP_TOPIC_ARGUMENT: "orders"})
    assert view.topic == "orders" and view.group == "amqp:v"
    assert view.refs("ns") == ()  # until its topic is seen
    view.view_queues = 2
    assert view.refs("ns") == (QueueRef("ns", "orders", 0), QueueRef("ns", "orders", 1))
    plain = QueueDef(name="q", arguments={"x-max-priority": 1})
    assert plain.group == GROUP and plain.topic == "amqp:q"
    assert plain.refs("ns") == (QueueRef("ns", "amqp:q", 1), QueueRef("ns", "amqp:q", 0))


@pytest.mark.parametrize(
    "arguments",
    [
        {interop.AMQP_TOPIC_ARGUMENT: ""},
        {interop.AMQP_TOPIC_ARGUMENT: 7},
        {interop.AMQP_TOPIC_ARGUMENT: "bad\nname"},
        {interop.AMQP_TOPIC_ARGUMENT: "amqp:other"},
        {interop.AMQP_TOPIC_ARGUMENT: "%AMQP%changes"},
        {interop.AMQP_TOPIC_ARGUMENT: "t", "x-queue-type": "stream"},
        {interop.AMQP_TOPIC_ARGUMENT: "t", "x-max-priority": 3},
    ],
)
def test_bad_views_are_refused_with_406(arguments: dict[str, object]) -> None:
    with pytest.raises(ChannelError) as info:
        validate_view(QueueDef(name="v", arguments=dict(arguments)))
    assert info.value.code == 406


def test_good_views_pass() -> None:
    for extra in ({}, {"x-queue-type": "quorum"}, {"x-message-ttl": 1000}):
        arguments = {interop.AMQP_TOPIC_ARGUMENT: "orders.v1", **extra}
        validate_view(QueueDef(name="v", arguments=arguments))
