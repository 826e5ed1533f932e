"""The pure parts: the document codec, the signature, attribute parsing and the
message mapping, checked against the SDK's own encoder and signer."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mns.auth import StaticCredentialsProvider
from mns.mns_client import MNSClient
from mns.mns_request import SendMessageRequest
from mns.mns_xml_handler import MessageEncoder, ReceiptHandlesEncoder, RecvMessageDecoder

from polymq.protocols.mns import codec
from polymq.protocols.mns.attributes import QueueAttributes, SubscriptionAttributes
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.messages import body_text, parse_message, render_message
from polymq.protocols.mns.notify import retry_delay_ms
from polymq.protocols.mns.signature import parse_authorization, sign, string_to_sign, verify
from polymq.storage.model import Message, QueueRef, StoredMessage

XML_TEXT = st.text(
    # What XML 1.0 can carry: no surrogates, controls, private use or noncharacters.
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Cn", "Co"), blacklist_characters="\r"
    ),
    max_size=50,
)
NAMES = st.text(alphabet=string.ascii_letters, min_size=1, max_size=12).filter(
    lambda n: n not in codec.ITEM_TAGS and n != "MessageBody"
)


def test_decodes_the_sdks_send_message_document() -> None:
    request = SendMessageRequest("q", "héllo <b>&amp;", delay_seconds=2, priority=3)
    request.message_group_id = "g1"
    raw = MessageEncoder.encode(request)
    root, doc = codec.decode(raw, json_body=False)
    assert root == "Message"
    assert doc["MessageBody"] == "aMOpbGxvIDxiPiZhbXA7"  # the SDK base64-encodes
    assert (doc["DelaySeconds"], doc["Priority"], doc["MessageGroupId"]) == ("2", "3", "g1")


def test_lists_stay_lists_even_with_one_item() -> None:
    root, doc = codec.decode(ReceiptHandlesEncoder.encode(["only-one"]), json_body=False)
    assert (root, doc) == ("ReceiptHandles", ["only-one"])
    root, doc = codec.decode(
        b"<Messages><Message><MessageBody> spaced </MessageBody></Message></Messages>",
        json_body=False,
    )
    assert (root, doc) == ("Messages", [{"MessageBody": " spaced "}])


@pytest.mark.parametrize(
    "raw",
    [
        b"<Message>",
        b"not xml",
        b"<Messages><Queue/></Messages>",
        b"<Message><A>1</A><A>2</A></Message>",
        b'<!DOCTYPE x [<!ENTITY a "b">]><Message/>',
    ],
)
def test_malformed_documents(raw: bytes) -> None:
    with pytest.raises(codec.MalformedDocument):
        codec.decode(raw, json_body=False)
    with pytest.raises(codec.MalformedDocument):
        codec.decode(b"{not json", json_body=True)


@given(st.dictionaries(NAMES, XML_TEXT, max_size=6))
def test_xml_round_trip(fields: dict[str, str]) -> None:
    raw = codec.encode("Message", {**fields, "MessageBody": " body "}, as_json=False)
    root, doc = codec.decode(raw, json_body=False)
    assert root == "Message"
    assert doc == {**{k: v.strip() for k, v in fields.items()}, "MessageBody": " body "}


def test_the_sdk_parses_what_we_render() -> None:
    stored = StoredMessage(
        message=Message(body=b"hi", properties=(("color", b"red"),), message_group="g"),
        queue=QueueRef("ns", "q"),
        offset=0,
        message_id="ID1",
        store_timestamp_ms=1000,
        delivery_attempt=2,
        receipt="R1",
        first_pop_ms=1500,
        next_visible_ms=9000,
    )
    raw = codec.encode("Message", render_message(stored, receipt=True), as_json=False)
    data = RecvMessageDecoder.decode(raw.decode(), False)
    assert data["MessageBody"] == "hi" and data["ReceiptHandle"] == "R1"
    assert (data["DequeueCount"], data["NextVisibleTime"], data["Priority"]) == ("2", "9000", "8")
    assert data["UserProperties"]["color"].get_string_value_by_type() == "red"
    assert data["MessageGroupId"] == "g"


def test_json_documents() -> None:
    assert codec.encode("Messages", [{"A": 1}], as_json=True) == b'{"Messages": [{"A": 1}]}'
    assert codec.encode("Message", {"A": 1, "B": None}, as_json=True) == b'{"A": 1}'
    listed = codec.encode("Queues", {"Queue": [{"A": 1}], "NextMarker": "n"}, as_json=True)
    assert listed == b'{"Queues": [{"A": 1}], "NextMarker": "n"}'
    assert codec.decode(b'{"MessageBody": "x"}', json_body=True) == (None, {"MessageBody": "x"})
    assert codec.decode(b"", json_body=True) == (None, {})


def test_signature_matches_the_sdk() -> None:
    headers = {
        "content-md5": "abc",
        "content-type": "text/xml;charset=UTF-8",
        "date": "Sun, 29 Nov 2026 16:00:00 GMT",
        "x-mns-version": "2015-06-06",
        "x-mns-user-request-id": "r1",
        "host": "example",
    }
    resource = "/queues/q/messages?waitseconds=3"
    client = MNSClient("http://example", "ak", "sk")
    credential = StaticCredentialsProvider("ak", "sk", "").get_credentials()
    expected = client.get_signature("GET", headers, resource, credential)
    text = string_to_sign(method="GET", resource=resource, headers=list(headers.items()))
    assert expected == f"MNS ak:{sign('sk', text)}"
    assert parse_authorization(expected) == ("ak", sign("sk", text))
    assert verify("sk", text, sign("sk", text)) and not verify("other", text, sign("sk", text))
    assert parse_authorization("Basic abc") is None
    assert parse_authorization("MNS nocolon") is None


def test_queue_attribute_ranges() -> None:
    attrs = QueueAttributes().updated({"VisibilityTimeout": "45"}, creating=True)
    assert attrs.visibility_timeout == 45
    for field, value in (("VisibilityTimeout", "0"), ("DelaySeconds", "x")):
        with pytest.raises(MnsError) as err:
            QueueAttributes().updated({field: value}, creating=True)
        assert err.value.code == "InvalidArgument"
    fifo = QueueAttributes().updated({"FifoQueue": "true"}, creating=True)
    with pytest.raises(MnsError):
        fifo.updated({"FifoQueue": "false"}, creating=False)


def test_subscription_endpoints_and_filters() -> None:
    queue = SubscriptionAttributes.parse({"Endpoint": "acs:mns:r:1:queues/q1"}, now_ms=1)
    assert queue.queue == "q1" and queue.notify_content_format == "SIMPLIFIED"
    web = SubscriptionAttributes.parse({"Endpoint": "http://h/x", "FilterTag": "red"}, now_ms=1)
    assert web.queue is None and web.notify_content_format == "XML"
    assert web.accepts("red") and not web.accepts("blue") and not web.accepts(None)
    with pytest.raises(MnsError):
        SubscriptionAttributes.parse({"Endpoint": "ftp://nope"}, now_ms=1)
    with pytest.raises(MnsError):
        SubscriptionAttributes.parse({"Endpoint": "http://h", "NotifyStrategy": "X"}, now_ms=1)


def test_message_mapping_limits_and_interop_names() -> None:
    doc = {
        "MessageBody": "b",
        "DelaySeconds": "5",
        "UserProperties": [
            {"Name": "content-type", "Value": "text/plain", "Type": "STRING"},
            {"Name": "polymq.key", "Value": "k1", "Type": "STRING"},
        ],
    }
    out = parse_message(
        doc, now_ms=1000, default_delay_s=0, max_body_bytes=10, retention_s=60
    ).message
    assert out.delivery_time_ms == 6000 and out.expiry_ms == 61000
    assert out.content_type == "text/plain" and out.key == b"k1" and out.properties == ()
    with pytest.raises(MnsError) as err:
        parse_message(
            {"MessageBody": "x" * 11},
            now_ms=0,
            default_delay_s=0,
            max_body_bytes=10,
            retention_s=None,
        )
    assert err.value.code == "MessageBodyTooLong"
    assert body_text(b"ok\x00\xff") == "ok\ufffd\ufffd"


def test_retry_strategies() -> None:
    assert [
        retry_delay_ms("BACKOFF_RETRY", a, unit_ms=1000, rng=lambda: 0.5) for a in (1, 3, 4)
    ] == [
        15000,
        15000,
        None,
    ]
    gaps = [retry_delay_ms("EXPONENTIAL_DECAY_RETRY", a, unit_ms=1) for a in (1, 2, 9, 10, 176)]
    assert gaps == [2, 4, 512, 512, 512]
    assert retry_delay_ms("EXPONENTIAL_DECAY_RETRY", 177, unit_ms=1) is None


def _element_tree_encode(root: str, value: object) -> bytes:
    """The reference: the same document built and written by ``ElementTree``."""
    from xml.etree import ElementTree

    def add(parent: ElementTree.Element, tag: str, value: object) -> None:
        if value is None:
            return
        if isinstance(value, dict):
            element = ElementTree.SubElement(parent, tag)
            for key, child in value.items():
                add(element, key, child)
        elif isinstance(value, list):
            item = codec.ITEM_TAGS.get(tag)
            if item is None:
                for entry in value:
                    add(parent, tag, entry)
            else:
                element = ElementTree.SubElement(parent, tag)
                for entry in value:
                    add(element, item, entry)
        else:
            text = ("True" if value else "False") if isinstance(value, bool) else str(value)
            ElementTree.SubElement(parent, tag).text = text

    element = ElementTree.Element(root, {"xmlns": codec.XMLNS})
    if isinstance(value, dict):
        for key, child in value.items():
            add(element, key, child)
    else:
        assert isinstance(value, list)
        for entry in value:
            add(element, codec.ITEM_TAGS[root], entry)
    written: bytes = ElementTree.tostring(element, encoding="utf-8", xml_declaration=True)
    return written


LEAF = st.one_of(st.none(), st.booleans(), st.integers(), XML_TEXT, st.just("a&b<c>d\"e'f"))


@given(
    fields=st.dictionaries(st.sampled_from(["MessageId", "MessageBody", "Code"]), LEAF),
    items=st.lists(st.dictionaries(st.sampled_from(["QueueURL", "QueueName"]), LEAF), max_size=3),
    marker=LEAF,
)
def test_xml_is_written_exactly_as_element_tree_writes_it(
    fields: dict[str, object], items: list[dict[str, object]], marker: object
) -> None:
    cases: list[tuple[str, object]] = [
        ("Message", fields),
        ("Message", {"Nested": fields, "Empty": {}}),
        ("Messages", [fields, fields]),
        ("Queues", {"Queue": items, "NextMarker": marker}),
        ("Errors", []),
    ]
    for root, value in cases:
        assert codec.encode(root, value, as_json=False) == _element_tree_encode(root, value)  # type: ignore[arg-type]
