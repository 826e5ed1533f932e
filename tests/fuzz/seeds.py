"""Regenerates the committed seed corpus (``tests/fuzz/corpus/<target>/``) from real
bytes: frames and documents made by each protocol's own encoders (kio, pamqp, our MQTT
encoder, the aliyun-mns-sdk's XML encoders, protobuf, msgpack through the storage RPC
codec), so the fuzzer starts from inputs that reach deep into each parser instead of
spending its budget discovering a valid header.

``python -m tests.fuzz.seeds`` rewrites every target's folder (files named by their
content's hash, so a regeneration that changes nothing changes no file);
``python -m tests.fuzz.seeds --regressions`` writes the inputs of issue 14's findings
into ``tests/fuzz/regressions/<target>/`` (beside the crashes the fuzzer saved there).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import struct
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CORPUS = Path(__file__).resolve().parent / "corpus"


# -- Kafka -----------------------------------------------------------------------------


def _kafka_frame(api_key: int, version: int, body: dict[str, Any]) -> bytes:
    """A request frame without its size prefix, as ``decode_request`` takes it."""
    from tests.kafka.raw import encode_request

    return encode_request(api_key, version, body, correlation_id=7, client_id="rdkafka")


def _records() -> list[Any]:
    from polymq.protocols.kafka.records import KafkaRecord

    return [
        KafkaRecord(offset_delta=0, timestamp_ms=1_700_000_000_000, key=b"k", value=b"hello"),
        KafkaRecord(
            offset_delta=1,
            timestamp_ms=1_700_000_000_005,
            key=None,
            value=b"world" * 8,
            headers=(("mq.tag", b"TagA"), ("content-type", b"text/plain"), ("h", None)),
        ),
    ]


def kafka_request() -> Iterable[bytes]:
    from polymq.protocols.kafka.records import encode_batch
    from polymq.protocols.kafka.versions import SUPPORTED

    for api_key, (low, high) in SUPPORTED.items():
        for version in range(low, high + 1):
            yield _kafka_frame(api_key, version, {})
    batch = encode_batch(0, _records())
    yield _kafka_frame(
        18, 3, {"client_software_name": "librdkafka", "client_software_version": "2"}
    )
    yield _kafka_frame(3, 12, {"topics": [{"name": "orders"}, {"name": "events"}]})
    yield _kafka_frame(3, 1, {"topics": [{"name": "orders"}]})
    yield _kafka_frame(10, 4, {"key_type": 0, "coordinator_keys": ["group-a", "group-b"]})
    yield _kafka_frame(10, 0, {"key": "group-a"})
    yield _kafka_frame(
        0,
        9,
        {
            "acks": -1,
            "timeout": 30000,
            "topic_data": [{"name": "orders", "partition_data": [{"index": 0, "records": batch}]}],
        },
    )
    yield _kafka_frame(
        0,
        3,
        {
            "acks": 1,
            "timeout": 30000,
            "topic_data": [{"name": "orders", "partition_data": [{"index": 0, "records": batch}]}],
        },
    )
    fetch_partition = {"partition": 0, "fetch_offset": 5, "partition_max_bytes": 1 << 20}
    yield _kafka_frame(
        1,
        12,
        {
            "max_wait": 500,
            "min_bytes": 1,
            "max_bytes": 1 << 20,
            "topics": [{"topic": "orders", "partitions": [fetch_partition]}],
            "forgotten_topics_data": [{"topic": "old", "partitions": [1, 2]}],
        },
    )
    yield _kafka_frame(
        11,
        7,
        {
            "group_id": "group-a",
            "session_timeout": 10000,
            "rebalance_timeout": 30000,
            "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b"\x00\x01\x00\x00\x00\x01\x00\x06orders"}],
        },
    )
    commit = {"partition_index": 0, "committed_offset": 42, "committed_metadata": "m"}
    yield _kafka_frame(
        8,
        8,
        {
            "group_id": "group-a",
            "generation_id_or_member_epoch": 1,
            "member_id": "m-1",
            "topics": [{"name": "orders", "partitions": [commit]}],
        },
    )
    yield _kafka_frame(
        19,
        7,
        {
            "timeout": 30000,
            "topics": [
                {
                    "name": "orders",
                    "num_partitions": 3,
                    "replication_factor": 1,
                    "configs": [{"name": "retention.ms", "value": "60000"}],
                }
            ],
        },
    )
    yield _kafka_frame(
        2,
        7,
        {
            "replica_id": -1,
            "topics": [{"name": "orders", "partitions": [{"partition_index": 0, "timestamp": -1}]}],
        },
    )
    yield _kafka_frame(17, 1, {"mechanism": "SCRAM-SHA-256"})
    yield _kafka_frame(36, 2, {"auth_bytes": b"n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL"})


def kafka_records() -> Iterable[bytes]:
    import cramjam

    from polymq.protocols.kafka.records import HEADER_SIZE, encode_batch, encode_control_batch

    plain = encode_batch(100, _records(), producer_id=7, producer_epoch=0)
    yield plain
    yield encode_batch(0, [])
    yield encode_control_batch(7, 0, commit=True, timestamp_ms=1_700_000_000_000)
    records = plain[HEADER_SIZE:]
    snappy_raw = bytes(cramjam.snappy.compress_raw(records))
    xerial = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    xerial += struct.pack(">i", len(snappy_raw)) + snappy_raw
    compressed = {
        1: gzip.compress(records),
        2: snappy_raw,
        3: bytes(cramjam.lz4.compress(records)),
        4: bytes(cramjam.zstd.compress(records)),
    }
    for codec, body in [*compressed.items(), (2, xerial)]:
        batch = bytearray(plain[:HEADER_SIZE] + body)
        struct.pack_into(">h", batch, 21, codec)  # attributes: the compression bits
        yield bytes(batch)  # length and CRC: the target seals every input itself


# -- AMQP ------------------------------------------------------------------------------


def amqp_frames() -> Iterable[bytes]:
    import datetime
    import decimal

    from pamqp import body, commands, frame, header
    from pamqp.heartbeat import Heartbeat

    table: dict[str, Any] = {
        "product": "pika",
        "capabilities": {"publisher_confirms": True, "consumer_cancel_notify": True},
        "n": 7,
        "big": 1 << 40,
        "neg": -3,
        "f": 1.5,
        "d": decimal.Decimal("3.14"),
        "t": datetime.datetime(2024, 1, 2, 3, 4, 5),
        "list": [1, "two", {"three": 3}, [4]],
        "none": None,
    }
    start_ok = commands.Connection.StartOk(
        client_properties=table, mechanism="PLAIN", response="\x00guest\x00guest"
    )
    session = [
        frame.marshal(start_ok, 0),
        frame.marshal(commands.Connection.TuneOk(channel_max=2047, frame_max=131072), 0),
        frame.marshal(commands.Connection.Open(virtual_host="/"), 0),
        frame.marshal(commands.Channel.Open(), 1),
        frame.marshal(
            commands.Exchange.Declare(
                exchange="ex", exchange_type="topic", arguments={"alternate-exchange": "ae"}
            ),
            1,
        ),
        frame.marshal(
            commands.Queue.Declare(
                queue="q",
                durable=True,
                arguments={"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx"},
            ),
            1,
        ),
        frame.marshal(commands.Queue.Bind(queue="q", exchange="ex", routing_key="a.*"), 1),
        frame.marshal(commands.Confirm.Select(), 1),
        frame.marshal(commands.Basic.Qos(prefetch_count=10), 1),
        frame.marshal(commands.Basic.Publish(exchange="ex", routing_key="a.b"), 1),
        frame.marshal(
            header.ContentHeader(
                0,
                5,
                commands.Basic.Properties(
                    content_type="text/plain",
                    headers={"x-h": 1, "nested": {"a": [1, 2]}},
                    delivery_mode=2,
                    priority=3,
                    correlation_id="c-1",
                    reply_to="amq.rabbitmq.reply-to",
                    expiration="60000",
                    message_id="m-1",
                    timestamp=datetime.datetime(2024, 1, 2, 3, 4, 5),
                    message_type="t",
                    app_id="app",
                ),
            ),
            1,
        ),
        frame.marshal(body.ContentBody(b"hello"), 1),
        frame.marshal(commands.Basic.Consume(queue="q", consumer_tag="ctag"), 1),
        frame.marshal(commands.Basic.Ack(delivery_tag=1, multiple=True), 1),
        frame.marshal(commands.Basic.Nack(delivery_tag=2, requeue=False), 1),
        frame.marshal(Heartbeat(), 0),
        frame.marshal(
            commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1
        ),
        frame.marshal(
            commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0
        ),
    ]
    yield b"".join(session)
    yield from session


# -- MQTT ------------------------------------------------------------------------------


def _mqtt(level: int) -> Iterable[bytes]:
    from polymq.protocols.mqtt import codec as c

    v5 = level == c.LEVEL_5
    props: Callable[[dict[int, Any]], dict[int, Any]] = lambda p: p if v5 else {}  # noqa: E731
    connect = c.Connect(
        level=level,
        client_id="client-1",
        clean_start=True,
        keep_alive=30,
        username="user",
        password=b"secret",
        will_topic="status/client-1",
        will_payload=b"gone",
        will_qos=1,
        will_retain=True,
        will_properties=props({c.WILL_DELAY: 5, c.CONTENT_TYPE: "text/plain"}),
        properties=props(
            {c.SESSION_EXPIRY: 3600, c.RECEIVE_MAXIMUM: 20, c.USER_PROPERTY: [("a", "b")]}
        ),
    )
    packets: list[Any] = [
        connect,
        c.Subscribe(
            packet_id=1,
            subscriptions=[
                c.Subscription(filter="sensors/+/temp", qos=1),
                c.Subscription(filter="alerts/#", qos=2),
                c.Subscription(filter="$share/g1/jobs/+", qos=0),
            ],
            properties=props({c.SUBSCRIPTION_ID: [7]}),
        ),
        c.Publish(
            topic="sensors/kitchen/temp",
            payload=b"21.5",
            qos=1,
            packet_id=2,
            properties=props(
                {
                    c.MESSAGE_EXPIRY: 60,
                    c.RESPONSE_TOPIC: "replies/1",
                    c.CORRELATION_DATA: b"c1",
                    c.USER_PROPERTY: [("k", "v"), ("k", "w")],
                }
            ),
        ),
        c.Publish(topic="alerts/fire", payload=b"!", qos=2, retain=True, packet_id=3),
        c.Publish(topic="a/b", payload=b"", qos=0),
        c.PubAck(packet_id=2),
        c.PubRec(packet_id=3),
        c.PubRel(packet_id=3),
        c.PubComp(packet_id=3),
        c.Unsubscribe(packet_id=4, filters=["alerts/#"]),
        c.PingReq(),
        c.Disconnect(),
    ]
    if v5:
        packets.append(c.Auth(reason=0x18, properties={c.AUTH_METHOD: "SCRAM-SHA-1"}))
    encoded = [c.encode(packet, level) for packet in packets]
    yield b"".join(encoded)
    yield from encoded


def mqtt311() -> Iterable[bytes]:
    from polymq.protocols.mqtt.codec import LEVEL_311

    return _mqtt(LEVEL_311)


def mqtt5() -> Iterable[bytes]:
    from polymq.protocols.mqtt.codec import LEVEL_5

    return _mqtt(LEVEL_5)


# -- MNS / HTTP ------------------------------------------------------------------------


def _bytes(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


def mns_request() -> Iterable[bytes]:
    """The XML bodies the aliyun-mns-sdk sends (its own encoders)."""
    from mns import mns_xml_handler as sdk

    message = SimpleNamespace(
        base64encode=False,
        message_body="hello <world> & more",
        delay_seconds=5,
        priority=8,
        message_group_id="",
        user_properties={},
        system_properties={},
    )
    yield _bytes(sdk.MessageEncoder.encode(message))
    yield _bytes(sdk.MessagesEncoder.encode([message, message], False))
    queue = SimpleNamespace(
        visibility_timeout=30,
        maximum_message_size=65536,
        message_retention_period=345600,
        delay_seconds=0,
        polling_wait_seconds=10,
        logging_enabled=True,
    )
    yield _bytes(sdk.QueueEncoder.encode(queue))
    yield _bytes(
        sdk.TopicEncoder.encode(SimpleNamespace(maximum_message_size=1024, logging_enabled=False))
    )
    subscription = SimpleNamespace(
        notify_strategy="BACKOFF_RETRY",
        endpoint="acs:mns:cn-hangzhou:123:queues/q",
        filter_tag="tag",
        notify_content_format="SIMPLIFIED",
    )
    yield _bytes(sdk.SubscriptionEncoder.encode(subscription))
    yield _bytes(sdk.ReceiptHandlesEncoder.encode(["rh-1", "rh-2"]))
    ns = 'xmlns="http://mns.aliyuncs.com/doc/v1/"'
    yield (
        f'<?xml version="1.0" encoding="UTF-8"?><Message {ns}><MessageBody>b</MessageBody>'
        "<UserProperties><PropertyValue><Name>n</Name><Value>aGk=</Value><Type>BINARY</Type>"
        "</PropertyValue></UserProperties></Message>"
    ).encode()
    yield (
        f"<Queue {ns}><DlqPolicy><Enabled>true</Enabled>"
        "<DeadLetterTargetQueue>dlq</DeadLetterTargetQueue><MaxReceiveCount>3</MaxReceiveCount>"
        "</DlqPolicy><FifoQueue>true</FifoQueue></Queue>"
    ).encode()


def http_json() -> Iterable[bytes]:
    """The JSON forms of the same bodies, as curl users send them."""
    documents: list[Any] = [
        {"MessageBody": "hello", "DelaySeconds": 5, "Priority": 8},
        {
            "MessageBody": "b",
            "UserProperties": {"PropertyValue": [{"Name": "n", "Value": "aGk=", "Type": "BINARY"}]},
        },
        {"Messages": [{"MessageBody": "a"}, {"MessageBody": "b", "DelaySeconds": 1}]},
        {"ReceiptHandles": ["rh-1", "rh-2"]},
        {
            "VisibilityTimeout": 30,
            "DelaySeconds": 0,
            "LoggingEnabled": True,
            "DlqPolicy": {"Enabled": True, "DeadLetterTargetQueue": "dlq", "MaxReceiveCount": 3},
        },
        {"Endpoint": "http://example.com/notify", "NotifyStrategy": "EXPONENTIAL_DECAY_RETRY"},
        {"MaximumMessageSize": 1024, "LoggingEnabled": False},
        [{"MessageBody": "x", "Priority": 1.5}, None, True],
    ]
    for document in documents:
        yield json.dumps(document).encode()


# -- RocketMQ --------------------------------------------------------------------------


def rocketmq_mapping() -> Iterable[bytes]:
    from rocketmq.grpc_protocol import definition_pb2 as d
    from rocketmq.grpc_protocol import service_pb2 as s

    from tests.fuzz.targets.rocketmq_mapping import REQUESTS

    def framed(message: Any) -> bytes:
        payload: bytes = message.SerializeToString()
        return bytes([REQUESTS.index(type(message))]) + payload

    def sent(body: bytes, **system: Any) -> Any:
        pb = d.Message(body=body)
        pb.topic.name = "orders"
        pb.topic.resource_namespace = "ns"
        pb.user_properties["color"] = "red"
        pb.user_properties["content-type"] = "text/plain"
        props = pb.system_properties
        props.message_id = "01ABCDEF"
        props.born_host = "10.0.0.1"
        props.born_timestamp.seconds = 1_700_000_000
        props.body_encoding = system.pop("encoding", d.IDENTITY)
        for name, value in system.items():
            if name == "delivery_timestamp":
                props.delivery_timestamp.seconds = value
            elif name == "keys":
                props.keys.extend(value)
            else:
                setattr(props, name, value)
        return pb

    yield framed(
        s.SendMessageRequest(
            messages=[
                sent(b"hello", tag="TagA", keys=["k1", "k2"], message_type=d.NORMAL),
                sent(b"again", tag="TagB", message_type=d.NORMAL),
            ]
        )
    )
    yield framed(
        s.SendMessageRequest(messages=[sent(b"x", message_group="g1", message_type=d.FIFO)])
    )
    yield framed(
        s.SendMessageRequest(
            messages=[sent(b"y", delivery_timestamp=1_700_000_060, message_type=d.DELAY)]
        )
    )
    yield framed(s.SendMessageRequest(messages=[sent(gzip.compress(b"zipped"), encoding=d.GZIP)]))
    for kind, expression in ((d.TAG, "TagA || TagB"), (d.SQL, "color = 'red' AND a > 1")):
        receive = s.ReceiveMessageRequest(batch_size=16, auto_renew=True)
        receive.group.name = "group-a"
        receive.message_queue.topic.name = "orders"
        receive.filter_expression.type = kind
        receive.filter_expression.expression = expression
        receive.invisible_duration.seconds = 30
        yield framed(receive)
        pull = s.PullMessageRequest(offset=3, batch_size=32)
        pull.group.name = "group-a"
        pull.filter_expression.type = kind
        pull.filter_expression.expression = expression
        yield framed(pull)
    telemetry = s.TelemetryCommand()
    subscription = telemetry.settings.subscription
    subscription.group.name = "group-a"
    entry = subscription.subscriptions.add()
    entry.topic.name = "orders"
    entry.expression.type = d.SQL
    entry.expression.expression = "TAGS IN ('a', 'b') OR n BETWEEN 1 AND 5"
    telemetry.settings.client_type = d.PUSH_CONSUMER
    yield framed(telemetry)


def sql92() -> Iterable[bytes]:
    expressions = [
        "a > 1",
        "a = 1 AND b = 'abc'",
        "(a >= 1 OR c < 3.5) AND NOT flag = TRUE",
        "TAGS IN ('TagA', 'TagB')",
        "a NOT BETWEEN 1 AND 5",
        "b IS NOT NULL AND s IS NULL",
        "b CONTAINS 'b' OR b STARTSWITH 'a' OR b ENDSWITH 'c'",
        "b NOT IN ('x', 'it''s')",
        "TRUE",
        "a <> 2 AND a != 3 AND a <= -1.5",
    ]
    for expression in expressions:
        yield expression.encode()


# -- storage RPC -----------------------------------------------------------------------


def storage_rpc() -> Iterable[bytes]:
    from polymq.storage import model as m
    from polymq.storage.rpc import codec

    queue = m.QueueRef(namespace="ns", topic="orders", queue_id=1)
    message = m.Message(
        body=b"hello", key=b"k", tag="TagA", properties=(("a", b"1"),), born_timestamp_ms=5
    )
    stored = m.StoredMessage(
        message=message,
        queue=queue,
        offset=7,
        message_id="id-1",
        store_timestamp_ms=1_700_000_000_000,
        receipt="r",
    )
    frames = [
        codec.encode_request(
            1, "append", [m.AppendRequest(entry=message, queues=(queue,), dedup_key="d")], {}
        ),
        codec.encode_request(2, "read", [queue, 0], {"max_messages": 10, "wait_ms": 0}),
        codec.encode_request(
            3, "create_topic", ["ns", "orders"], {"config": m.TopicConfig(queue_count=4)}
        ),
        codec.encode_result(
            2,
            m.ReadResult(
                messages=(stored,), next_offset=8, offsets=m.QueueOffsets(earliest=0, latest=8)
            ),
        ),
        codec.encode_result(
            4, {(queue, "g"): m.CommittedOffset(offset=3, metadata="meta"), "s": frozenset({1, 2})}
        ),
        codec.encode_result(5, m.MessageType.FIFO),
        codec.encode_error(6, "offset_out_of_range", "no", {"earliest": 0, "latest": 9}),
        codec.encode_cancel(7),
    ]
    # The first byte of an input is where the target splits it (see its docstring).
    yield b"\x05" + b"".join(frames)
    for frame in frames:
        yield b"\x00" + frame


# -- gRPC over HTTP/2 ------------------------------------------------------------------


def grpc_frames() -> Iterable[bytes]:
    """Client sessions after the preface (hpack's encoder, Huffman and indexing as grpc
    clients use them) to the target's methods; the first byte steers the target (see
    its docstring)."""
    import hpack

    from polymq.protocols.grpc_server import frames as f
    from polymq.protocols.grpc_server.frames import Flag, FrameType, Setting
    from polymq.protocols.grpc_server.wire import message_bytes

    def session(*calls: tuple[str, list[tuple[str, str]], list[bytes]]) -> bytes:
        encoder = hpack.Encoder()
        out = [f.settings(((Setting.INITIAL_WINDOW_SIZE, 1 << 20),)), f.settings_ack()]
        for number, (path, extra, messages) in enumerate(calls):
            stream = 2 * number + 1
            block = encoder.encode(
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", path),
                    (":authority", "127.0.0.1:8081"),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                    ("user-agent", "grpc-python/1.60"),
                    *extra,
                ]
            )
            out.append(f.frame(FrameType.HEADERS, Flag.END_HEADERS, stream, block))
            for message in messages:
                out.append(f.frame(FrameType.DATA, 0, stream, message_bytes(message)))
            out.append(f.frame(FrameType.DATA, Flag.END_STREAM, stream, b""))
        out.append(f.frame(FrameType.PING, 0, 0, b"pingpong"))
        return b"".join(out)

    metadata = [("grpc-timeout", "5S"), ("x-key", "value"), ("x-data-bin", "AAEC")]
    sessions = [
        session(("/t/Echo", [], [b"hello"])),
        session(("/t/Count", metadata, [b"four"]), ("/t/Echo", [], [b"again"])),
        session(("/t/Bidi", [], [b"one", b"two", b"three"])),
        session(("/t/Total", [], [b"a", b"bb", b""])),
        session(("/t/Fail", [], [b"x"]), ("/t/Nothing", [], [b"x"])),
        session(("/t/Echo", [], [b"x" * 2000])),  # over the largest message
        session(*[("/t/Echo", [], [b"%d" % i]) for i in range(6)]),  # over the stream limit
    ]
    yield from (bytes((mode,)) + sessions[0] for mode in (0x00, 0x01, 0x03, 0x15))
    yield from (b"\x00" + one for one in sessions[1:])
    yield b"\x08" + f.CONNECTION_PREFACE + sessions[0]  # the preface from the input
    encoder = hpack.Encoder()
    block = encoder.encode(
        [(":method", "POST"), (":path", "/t/Bidi"), ("content-type", "application/grpc")]
    )
    tricky = b"".join(
        [
            f.settings(((Setting.INITIAL_WINDOW_SIZE, 0), (Setting.MAX_FRAME_SIZE, 1 << 15))),
            # a header block in three pieces, then padded DATA, a window for the answers,
            # the client's trailers, a compressed message on another stream, a reset
            f.frame(FrameType.HEADERS, Flag.PRIORITY, 1, b"\x00\x00\x00\x00\x10" + block[:4]),
            f.frame(FrameType.CONTINUATION, 0, 1, block[4:8]),
            f.frame(FrameType.CONTINUATION, Flag.END_HEADERS, 1, block[8:]),
            f.frame(FrameType.DATA, Flag.PADDED, 1, b"\x03" + message_bytes(b"padded") + b"\0" * 3),
            f.window_update(0, 100),
            f.window_update(1, 5),  # less than the answer
            f.frame(
                FrameType.HEADERS,
                Flag.END_HEADERS | Flag.END_STREAM,
                1,
                encoder.encode([("x-trailer", "t")]),
            ),
            f.frame(FrameType.HEADERS, Flag.END_HEADERS, 3, block),
            f.frame(FrameType.DATA, 0, 3, b"\x01" + struct.pack(">I", 2) + b"zz"),
            f.frame(FrameType.HEADERS, Flag.END_HEADERS, 5, block),
            f.rst_stream(5, 8),
            f.frame(FrameType.PRIORITY, 0, 7, b"\x00\x00\x00\x01\x10"),
            f.goaway(5, 0),
        ]
    )
    yield from (bytes((mode,)) + tricky for mode in (0x00, 0x02))  # answers run between reads


# -- the inputs issue 14 reported, as regression inputs -----------------------------


def _amqp_method(class_id: int, method_id: int, arguments: bytes) -> bytes:
    payload = struct.pack(">HH", class_id, method_id) + arguments
    return struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce"


def _declare_with_table(table: bytes) -> bytes:
    """Queue.Declare of queue "q" whose ``arguments`` table holds ``table``'s fields."""
    fields = b"\x00\x00" + b"\x01q" + b"\x00" + struct.pack(">I", len(table)) + table
    return _amqp_method(50, 10, fields)


def issue14() -> dict[str, list[tuple[str, bytes]]]:
    """Every input of the issue's findings that reaches a pure codec, by target."""
    from polymq.protocols.mqtt import codec as mqtt

    deep_table = b""
    for _ in range(15_000):
        deep_table = b"\x01aF" + struct.pack(">I", len(deep_table)) + deep_table
    deep_array = b""
    for _ in range(15_000):
        deep_array = b"A" + struct.pack(">I", len(deep_array)) + deep_array
    levels = 1_500
    mqtt_session: list[mqtt.Packet] = [
        mqtt.Subscribe(
            packet_id=1, subscriptions=[mqtt.Subscription(filter="/".join(["+"] * levels))]
        ),
        mqtt.Subscribe(packet_id=2, subscriptions=[mqtt.Subscription(filter="a/" * levels + "#")]),
        mqtt.Publish(topic="/".join(["a"] * levels), payload=b"x"),
    ]
    return {
        "kafka_request": [
            # FindCoordinator v4, keys array claiming 2^32-2 entries: the native decoder aborted
            (
                "issue14-findcoordinator-v4-huge-array",
                bytes.fromhex("000a0004000000010002667a0000ffffffff0f"),
            ),
        ],
        "amqp_frames": [
            ("issue14-table-15k-deep", _declare_with_table(deep_table)),
            ("issue14-array-15k-deep", _declare_with_table(b"\x01a" + deep_array)),
            (
                "issue14-table-string-claims-2g",
                _declare_with_table(b"\x01aS" + struct.pack(">I", 2**31 - 1) + b"abc"),
            ),
        ],
        "mqtt311": [
            ("issue14-1500-levels", b"".join(mqtt.encode(p, mqtt.LEVEL_311) for p in mqtt_session)),
        ],
        "mqtt5": [
            ("issue14-1500-levels", b"".join(mqtt.encode(p, mqtt.LEVEL_5) for p in mqtt_session)),
        ],
        "mns_request": [
            (
                "issue14-xml-20k-deep",
                b"<Message><MessageBody>x</MessageBody>"
                + b"<a>" * 20_000
                + b"</a>" * 20_000
                + b"</Message>",
            ),
        ],
        "http_json": [
            ("issue14-json-50k-deep-arrays", b"[" * 50_000 + b"]" * 50_000),
            ("issue14-json-50k-deep-objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
            (
                "issue14-json-deep-property-value",
                b'{"MessageBody":"x","UserProperties":[{"Name":"n","Value":'
                + b"[" * 900
                + b"]" * 900
                + b"}]}",
            ),
        ],
        "sql92": [
            ("issue14-20k-not", b"NOT " * 20_000 + b"TRUE"),
            ("issue14-20k-parens", b"(" * 20_000 + b"a = 1" + b")" * 20_000),
            ("issue14-50k-or", b" OR ".join([b"a = 1"] * 50_000)),
            ("issue14-50k-and", b" AND ".join([b"a = 1"] * 50_000)),
        ],
        "storage_rpc": [
            (
                "issue14-array-claims-2g",
                b"\x00" + struct.pack(">I", 10) + b"\x95\x00\x01\xa1m\x91\xdd\x7f\xff\xff\xff",
            ),
            (
                "issue14-100k-deep",
                b"\x00" + struct.pack(">I", 100_003) + b"\x93\x01\x01" + b"\x91" * 100_000,
            ),
        ],
    }


REGRESSIONS = CORPUS.parent / "regressions"


def write_regressions() -> None:
    for target, inputs in issue14().items():
        folder = REGRESSIONS / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in inputs:
            (folder / name).write_bytes(data)
        print(f"{target}: {len(inputs)} issue-14 inputs in {folder}")


SEEDS: dict[str, Callable[[], Iterable[bytes]]] = {
    "kafka_request": kafka_request,
    "kafka_records": kafka_records,
    "amqp_frames": amqp_frames,
    "mqtt311": mqtt311,
    "mqtt5": mqtt5,
    "mns_request": mns_request,
    "http_json": http_json,
    "rocketmq_mapping": rocketmq_mapping,
    "sql92": sql92,
    "storage_rpc": storage_rpc,
    "grpc_frames": grpc_frames,
}


def write(name: str, seeds: Iterable[bytes]) -> int:
    folder = CORPUS / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    count = 0
    for seed in seeds:
        digest = hashlib.sha1(seed, usedforsecurity=False).hexdigest()[:16]
        (folder / f"seed-{digest}").write_bytes(seed)
        count += 1
    return count


def main(argv: list[str]) -> int:
    if argv == ["--regressions"]:
        write_regressions()
        return 0
    names = argv or list(SEEDS)
    for name in names:
        count = write(name, SEEDS[name]())
        print(f"{name}: {count} seeds in {CORPUS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
