"""Hostile Kafka input (issue 14): frames that made kio's native reader abort the whole
process, requests before SASL, sockets that send nothing or a byte at a time, frames
declared large and never finished, requests of too many partitions. Each costs at most
its own connection; the process lives and every protocol still answers.

Run ``python -m tests.kafka.test_kafka_hostile COUNT SEED [native]`` for a longer
mutation search (``native``: straight into kio's reader, to find aborting inputs).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pika
import psutil
import pytest
from kio.schema.errors import ErrorCode
from mns.account import Account
from mns.queue import Message, QueueMeta

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.protocols.kafka.bounds import check_request
from polymq.protocols.kafka.codec import BadRequest, decode_request, request_class
from polymq.protocols.kafka.listener import KafkaListener
from polymq.protocols.kafka.records import KafkaRecord, encode_batch
from polymq.protocols.kafka.versions import SUPPORTED
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.kafka.raw import RawKafka, encode_request, sample_request, seconds_until_closed
from tests.live_server import LiveServer, live_server, server_config
from tests.mqtt.helpers import Paho

ROOT = Path(__file__).resolve().parents[2]
GIVE_UP_S = 20.0  # far beyond every deadline under test: reaching it means no close
DEADLINE_MS = 300  # handshake and frame timeouts of the strict servers
BUDGET = 8 << 20  # max_buffered_frame_bytes of the strict server
MAX_ITEMS = 100  # max_batch_items of the strict server
ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(AccountConfig(user="alice", password="alice-secret", namespaces=("tenant-k",)),),
)

# The issue's frame, size included: FindCoordinator v4 whose key array claims 2^32-2
# entries, which made the native reader ask for 34 GB and abort the process.
ISSUE_FRAME = bytes.fromhex("00000013000a0004000000010002667a0000ffffffff0f")

# Every input (without its size) that aborted kio's native reader in a search of
# 23,000 mutations of real frames (byte flips and inserted large varints): one per
# API version that did, the shortest found.
ABORTING = {
    "ListOffsets v6": "00020006000000030002667a00000000010102036162ffffffff0f02000000fffffffe"
    "010000000000ffffff7f0000",
    "Metadata v11": "0003000b000000030002667a00ffffffff0f020000000000000000000000ffffff7f07"
    "03616200010100",
    "Metadata v12": "0003000c000000030002667a00ffffffff0f00000000000000000000000703616200010100",
    "OffsetCommit v8": "00080008000000030002667a0003616200000001036162036162030361620300000001"
    "00000000000000010000000103616200000000017fffffff0000007fffffff0100000001ffffffff0f"
    "03616200000361620300000001000000000000000100000001036162000000000100000000000000010000"
    "0001036162000000",
    "OffsetFetch v8": "00090008000000030002667a00ffffffff0f036162020000000100d70100",
    "OffsetFetch v9": "00090009000000030002667a00808080801580808003616200000001020361620200"
    "00000100000100",
    "FindCoordinator v4": "000a0004000000030002667a0001ffffffff0f0203616200",
    "LeaveGroup v4": "000d0004000000030002667a00036162ffffffff0f020361620361ff0000",
    "SyncGroup v5": "000e0005000000030002667a0003616200000001036162036162036162036162ffffff"
    "ff0f020361620378790000",
    "ListGroups v4": "00100004000000030002667a00ffffffff0f616200",
    "CreateTopics v5": "00130005000000030002667a00020361620000000100010200000001020000000100"
    "ffffffff0f020361ff0361620000000000050100",
    "CreateTopics v6": "00130006000000030002667a00ffffffff0f0203616200000001000102000000010200"
    "0000010002036162037fffffff000000050199",
    "CreateTopics v7": "00130007000000030002667a00ffffffff0f03036162000000010001030000000103"
    "00000001000000010000000001030000000100000001000303616203616200036162036162000003616200"
    "000001000103ffffff7f000000010300000001000000010000000001030000000100000001000303616203"
    "6162000361620361620000000000050100",
    "DeleteTopics v5": "00140005000000030002667a00ffffffff7f036162036162008080808000000500",
    "TxnOffsetCommit v3": "001c0003000000030002667a00036162036162002c0000000000fffffffe00000103"
    "6162036162ffffffff0f00000001000000000000000100000001036162000000",
    "DescribeConfigs v4": "00200004000000030002667a8080808000fffffffe620203d16200010100",
    "CreatePartitions v2": "00250002000000030002667a00ffffffff0f0203616800000001020200000001000000"
    "0000050100",
    "CreatePartitions v3": "00250003000000030002667a000303616200000001ffffffff0f010000000100030000"
    "00010000000100000361620000000103030000000100000001000300000001000000017f16ffff00050100",
    "DeleteGroups v2": "002a0002000000030002667a00ffffffff5c03036162fe616200",
    "IncrementalAlterConfigs v1": "002c0001000000030002667a00ffffffff0f020103fffffffe616202036162"
    "0103616200000100",
    "ConsumerGroupHeartbeat v0": "00440000000000030002667a0003616203146200000001036162036162000000"
    "05020361620361620200000000000000000000000000000007ffffffff0f02000000010000",
    "ConsumerGroupDescribe v0": "00450000000000030002667a00ffffdaff0fffffffff0f00",
    "ConsumerGroupDescribe v1": "00450001000000030002667a00fffffffe7f0361620100",
    "ShareGroupDescribe v1": "004d0001000000030002667a00ffffffff0f0361620100",
}

# Decodes every line of stdin, saying before each which it is (so a parent knows which
# input an abort came from) and after it how it ended.
_CHILD = r"""
import sys
from polymq.protocols.kafka.codec import decode_request
mode = sys.argv[1]
if mode == "native":
    import struct
    from polymq.protocols.kafka.codec import _reader, request_class
for i, line in enumerate(sys.stdin):
    print("start", i, flush=True)
    frame = bytes.fromhex(line.strip())
    try:
        if mode == "native":
            cls = request_class(*struct.unpack_from(">hh", frame))
            _, offset = _reader(cls.__header_schema__)(frame, 0)
            _reader(cls)(frame, offset)
        else:
            decode_request(frame)
        outcome = "decoded"
    except BaseException as e:
        outcome = type(e).__name__
    print("end", i, outcome, flush=True)
"""


@dataclasses.dataclass
class Decoded:
    outcomes: dict[int, str]  # input index -> how its decoding ended
    aborted: list[int]  # inputs whose decoding killed the process


def decode_in_subprocess(frames: Sequence[bytes], mode: str = "checked") -> Decoded:
    """Decode ``frames`` in child processes (an abort kills only the child, which is
    restarted after the input that killed it)."""
    result = Decoded({}, [])
    start = 0
    while start < len(frames):
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, mode],
            input="".join(f.hex() + "\n" for f in frames[start:]),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            check=False,
        )
        last = start - 1
        for line in child.stdout.splitlines():
            words = line.split()
            index = start + int(words[1])
            if words[0] == "end":
                result.outcomes[index] = words[2]
            last = index
        if child.returncode == 0:
            break
        result.aborted.append(last)
        start = last + 1
    return result


_LARGE = [bytes.fromhex(h) for h in ("ffffffff0f", "ffffff7f", "7fffffff", "fffffffe", "80808080")]


def mutations(count: int, seed: int) -> list[bytes]:
    """``count`` mutations of real frames of every API version we serve: random byte
    flips, and large varints or counts inserted or written over the bytes."""
    rng = random.Random(seed)
    bases = [
        sample_request(key, version, rng.choice((1, 2)))
        for key, (low, high) in SUPPORTED.items()
        for version in range(low, high + 1)
    ]
    out = []
    for _ in range(count):
        frame = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(8, len(frame)) if len(frame) > 8 else 8
            what = rng.random()
            if what < 0.4 and len(frame) > 8:
                frame[at] = rng.randrange(256)
            elif what < 0.7:
                frame[at:at] = rng.choice(_LARGE)
            else:
                large = rng.choice(_LARGE)
                frame[at : at + len(large)] = large
        out.append(bytes(frame))
    return out


# -- the decoder, in a subprocess (an abort must not take pytest with it) -------------


def test_frames_that_aborted_the_process_are_bad_requests() -> None:
    frames = [ISSUE_FRAME[4:], *(bytes.fromhex(h) for h in ABORTING.values())]
    decoded = decode_in_subprocess(frames)
    assert decoded.aborted == []
    assert decoded.outcomes == dict.fromkeys(range(len(frames)), "BadRequest")


def test_mutations_of_real_frames_never_abort() -> None:
    decoded = decode_in_subprocess(mutations(2000, seed=14))
    assert decoded.aborted == []
    assert set(decoded.outcomes.values()) <= {"decoded", "BadRequest", "UnsupportedVersion"}
    assert len(decoded.outcomes) == 2000


# Unknown tagged fields (KIP-482: a newer client's additions), each as tag, size, value.
UNKNOWN_TAGS = b"\x02" + b"\x05\x01\x00" + b"\xc8\x01\x02ab"  # tags 5 and 200
UNKNOWN_TAG = b"\x01" + b"\x09\x00"  # tag 9, empty


def _metadata_with_unknown_tags(topic: str) -> bytes:
    """Metadata v12 for ``topic`` with unknown tagged fields in the request header, in
    the topic (a struct inside an array) and at the top level of the body."""
    frame = encode_request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
    # Header: key, version, correlation id, client id "raw" (legacy string), tags.
    assert frame[8:14] == b"\x00\x03raw\x00"
    # Body: ... topic name, topic tags, allow creation, include operations, tags.
    assert frame.endswith(b"\x00\x01\x00\x00")
    return frame[:13] + UNKNOWN_TAG + frame[14:-4] + UNKNOWN_TAGS + b"\x01\x00" + UNKNOWN_TAGS


def test_unknown_tagged_fields_are_skipped() -> None:
    """Apache Kafka skips tagged fields it does not know; so do we, wherever they are."""
    request = decode_request(_metadata_with_unknown_tags("t1"))
    assert request.client_id == "raw"
    assert [t.name for t in request.body.topics] == ["t1"]
    assert request.body.allow_auto_topic_creation is True
    frame = bytearray(sample_request(18, 3))  # ApiVersions v3: ends with its tag count
    assert frame[-1] == 0
    frame[-1:] = UNKNOWN_TAGS
    assert decode_request(bytes(frame)).body == decode_request(sample_request(18, 3)).body


def test_unknown_tagged_field_beside_a_known_one_is_skipped() -> None:
    """Fetch v12's cluster_id is tag 0: the one known field of the section is kept."""
    frame = encode_request(1, 12, {"topics": [], "forgotten_topics_data": [], "rack_id": ""})
    assert frame.endswith(b"\x01\x01\x01\x00")
    tags = b"\x02" + b"\x00\x03\x03c1" + b"\x0b\x01\x00"  # cluster_id "c1", tag 11
    assert decode_request(frame[:-1] + tags).body.cluster_id == "c1"


# A schema in kio's shape (real types: this module's annotations are strings).
_Inner = dataclasses.make_dataclass(
    "_Inner",
    [("value", int, dataclasses.field(metadata={"kafka_type": "int8"}))],
    namespace={"__flexible__": True},
    frozen=True,
)
_Outer = dataclasses.make_dataclass(
    "_Outer",
    [("inner", _Inner, dataclasses.field(metadata={"tag": 0}))],
    namespace={"__flexible__": True},
    frozen=True,
)


def test_unknown_tagged_field_inside_a_known_tagged_value_is_cut_out_and_resized() -> None:
    """No request we serve has a struct as a known tagged field, but the walk handles
    one: the unknown field inside it goes, and the known field's size shrinks."""
    header_cls = request_class(18, 3).__header_schema__
    header = encode_request(18, 3, {})[:14]
    inner = b"\x07" + b"\x01" + b"\x63\x81\x01" + b"x" * 129  # int8, tag 99 of 129 bytes
    assert len(inner) == 134  # its size takes two bytes (86 01), its rest's one
    sent = header + b"\x01" + b"\x00\x86\x01" + inner
    kept = header + b"\x01" + b"\x00\x02" + b"\x07\x00"
    assert check_request(sent, _Outer, header_cls) == kept
    assert check_request(kept, _Outer, header_cls) is kept  # nothing to cut: no copy


def test_null_array_the_schema_forbids_is_a_bad_request() -> None:
    frame = encode_request(1, 12, {"topics": [], "forgotten_topics_data": [], "rack_id": ""})
    # topics, forgotten_topics_data, rack_id and the tag count close the body.
    assert frame.endswith(b"\x01\x01\x01\x00")
    with pytest.raises(BadRequest, match=r"null FetchRequest\.topics"):
        decode_request(frame[:-4] + b"\x00\x01\x01\x00")


# -- live servers --------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.INFO):
        yield
    bad = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, bad


@pytest.fixture(scope="module")
def everyone(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    """Open mode, every protocol served: what one Kafka frame must not take down."""
    with live_server(
        tmp_path_factory.mktemp("kafka-everyone"), ("kafka", "amqp", "mqtt", "http")
    ) as live:
        yield live


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("kafka-secure")
    config = dataclasses.replace(server_config(data_dir, ("kafka",)), auth=ACCOUNTS)
    with live_server(data_dir, ("kafka",), config=config) as live:
        yield live


_STRICT = {
    "limits.handshake_timeout_ms": str(DEADLINE_MS),
    "limits.frame_timeout_ms": str(DEADLINE_MS),
    "limits.max_buffered_frame_bytes": str(BUDGET),
    "limits.max_batch_items": str(MAX_ITEMS),
}


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("kafka-strict"), ("kafka",), overrides=_STRICT) as s:
        yield s


@pytest.fixture(scope="module")
def strict_secure(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("kafka-strict-secure")
    config = dataclasses.replace(server_config(data_dir, ("kafka",), _STRICT), auth=ACCOUNTS)
    with live_server(data_dir, ("kafka",), config=config) as live:
        yield live


def _sized(frame: bytes) -> bytes:
    return struct.pack(">i", len(frame)) + frame


def _closed(sock: socket.socket, timeout: float = GIVE_UP_S) -> bool:
    """Whether the server closes ``sock`` (reading and dropping what it sends)."""
    return seconds_until_closed(sock, timeout) is not None


def _send_each_on_its_own_connection(server: LiveServer, frames: Sequence[bytes]) -> None:
    for frame in frames:
        with RawKafka(*server.address("kafka")) as bad:
            bad.send_bytes(frame)
            assert _closed(bad.sock)


def _hostile_frames() -> list[bytes]:
    return [ISSUE_FRAME, *(_sized(bytes.fromhex(h)) for h in ABORTING.values())]


def _kafka_round_trip(bootstrap: str, topic: str, **options: Any) -> None:
    producer = confluent_producer(bootstrap, **options)
    producer.produce(topic, value=b"still here")
    assert producer.flush(30) == 0
    consumer = confluent_consumer(bootstrap, f"g-{topic}", **options)
    consumer.subscribe([topic])
    try:
        assert confluent_consume(consumer, 1)[0].value() == b"still here"
    finally:
        consumer.close()


def _bootstrap(server: LiveServer) -> str:
    host, port = server.address("kafka")
    return f"{host}:{port}"


def test_hostile_frames_leave_every_protocol_answering(everyone: LiveServer, topic: str) -> None:
    _send_each_on_its_own_connection(everyone, _hostile_frames())
    _kafka_round_trip(_bootstrap(everyone), topic)
    params = pika.ConnectionParameters(
        host=everyone.host, port=everyone.port("amqp"), connection_attempts=1
    )
    with pika.BlockingConnection(params) as amqp:
        channel = amqp.channel()
        channel.queue_declare(f"amqp-{topic}")
        channel.basic_publish("", f"amqp-{topic}", b"amqp")
        got = None
        for _ in range(100):
            method, _, body = channel.basic_get(f"amqp-{topic}", auto_ack=True)
            if method is not None:
                got = body
                break
            amqp.sleep(0.05)
        assert got == b"amqp"
    mqtt = Paho(everyone.port("mqtt"), v5=True).connect()
    mqtt.subscribe("alive/#", qos=1)
    assert mqtt.publish("alive/x", b"mqtt", qos=1) == 0
    assert [m.payload for m in mqtt.wait_messages(1)] == [b"mqtt"]
    mqtt.disconnect()
    host, port = everyone.address("http")
    queue = Account(f"http://{host}:{port}", "ak", "sk").get_queue(f"mns-{topic}")
    queue.create(QueueMeta())
    queue.send_message(Message("http"))
    assert queue.receive_message(0).message_body in ("http", b"http")


def test_hostile_frames_before_sasl(secure: LiveServer, topic: str) -> None:
    _send_each_on_its_own_connection(secure, _hostile_frames())
    options = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "alice",
        "sasl.password": "alice-secret",
    }
    _kafka_round_trip(_bootstrap(secure), topic, **options)


def test_metadata_before_sasl_closes(secure: LiveServer) -> None:
    with RawKafka(*secure.address("kafka")) as client:
        client.send_bytes(client.frame(3, 12, {"topics": None}))
        assert _closed(client.sock)


def test_large_frame_before_sasl_closes_before_its_body(secure: LiveServer) -> None:
    """A 1 MiB ApiVersions (an API allowed before SASL) is refused from its size: the
    server closes while all but its first 12 bytes are still unsent."""
    with RawKafka(*secure.address("kafka")) as client:
        client.send_bytes(struct.pack(">ihhi", 1 << 20, 18, 3, 1))
        assert _closed(client.sock)


def test_silent_socket_is_closed_after_the_handshake_timeout(strict: LiveServer) -> None:
    with socket.create_connection(strict.address("kafka")) as silent:
        assert _closed(silent)


def test_partial_first_frame_is_closed_in_open_mode(strict: LiveServer) -> None:
    with socket.create_connection(strict.address("kafka")) as partial:
        partial.sendall(struct.pack(">ih", 40, 18))  # a size and half a header
        assert _closed(partial)


def test_sasl_never_finished_is_closed(strict_secure: LiveServer) -> None:
    with RawKafka(*strict_secure.address("kafka")) as client:
        assert client.request(17, 1, {"mechanism": "PLAIN"}).error_code is ErrorCode.none
        assert _closed(client.sock)  # no SaslAuthenticate within the handshake timeout


def test_slow_frame_is_closed_after_the_frame_timeout(strict: LiveServer) -> None:
    """An established connection trickling a frame a byte at a time is closed before
    it has sent the frame (the frame timeout, not the handshake one)."""
    with RawKafka(*strict.address("kafka")) as client:
        assert client.request(18, 3, {}).error_code is ErrorCode.none  # established
        frame = client.frame(18, 3, {"client_software_name": "x" * 100})
        client.sock.settimeout(DEADLINE_MS / 1000 / 20)
        sent = 0
        for sent in range(1, len(frame) + 1):
            try:
                client.sock.sendall(frame[sent - 1 : sent])
                if client.sock.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                break
        assert sent < len(frame), "the server let the whole trickled frame in"
        assert _closed(client.sock)


def test_idle_connection_is_closed(strict: LiveServer) -> None:
    listener = strict.gateway.listeners.get("kafka")
    assert isinstance(listener, KafkaListener)
    listener.services.idle_timeout_s = DEADLINE_MS / 1000
    try:
        with RawKafka(*strict.address("kafka")) as client:
            assert client.request(18, 3, {}).error_code is ErrorCode.none
            assert _closed(client.sock)
    finally:
        listener.services.idle_timeout_s = 600.0


def _batch() -> bytes:
    return encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=1, key=None, value=b"x")])


def test_produce_of_too_many_partitions_is_invalid_request(strict: LiveServer, topic: str) -> None:
    partitions = [{"index": i, "records": _batch()} for i in range(MAX_ITEMS + 1)]
    body = {
        "acks": -1,
        "timeout": 5000,
        "topic_data": [{"name": topic, "partition_data": partitions}],
    }
    with RawKafka(*strict.address("kafka")) as client:
        answer = client.request(0, 9, body)
        codes = {p.error_code for p in answer.responses[0].partition_responses}
        assert codes == {ErrorCode.invalid_request}
        assert len(answer.responses[0].partition_responses) == MAX_ITEMS + 1
        # The connection goes on, and one partition fewer is served.
        body["topic_data"][0]["partition_data"] = partitions[:1]  # type: ignore[index]
        client.request(3, 12, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
        one = client.request(0, 9, body).responses[0].partition_responses[0]
        assert one.error_code is ErrorCode.none


def test_fetch_of_too_many_partitions_is_invalid_request(strict: LiveServer, topic: str) -> None:
    partitions = [
        {"partition": i, "fetch_offset": 0, "partition_max_bytes": 1024}
        for i in range(MAX_ITEMS + 1)
    ]
    body = {"max_wait": 0, "min_bytes": 1, "topics": [{"topic": topic, "partitions": partitions}]}
    with RawKafka(*strict.address("kafka")) as client:
        answer = client.request(1, 12, body)
        codes = {p.error_code for p in answer.responses[0].partitions}
        assert codes == {ErrorCode.invalid_request}


def test_too_many_items_in_one_request_closes(strict: LiveServer) -> None:
    """Past 2 x max_batch_items array items a request is not even decoded."""
    topics = [{"name": f"t{i}"} for i in range(2 * MAX_ITEMS + 1)]
    with RawKafka(*strict.address("kafka")) as client:
        client.send_bytes(client.frame(3, 12, {"topics": topics}))
        assert _closed(client.sock)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _flood(
    address: tuple[str, int], count: int, payload: memoryview, sample: Callable[[], None]
) -> None:
    """``count`` connections each sending ``payload`` (see :func:`_push`), all closed
    after."""
    sockets = [socket.create_connection(address) for _ in range(count)]
    try:
        for sock in sockets:
            sock.setblocking(False)
        _push(sockets, payload, sample)
    finally:
        for sock in sockets:
            sock.close()


def _push(sockets: list[socket.socket], payload: memoryview, on_round: Callable[[], None]) -> None:
    """Send ``payload`` on every (non-blocking) socket as far as each will take it,
    until the server has closed them all; ``on_round`` runs between rounds."""
    sent = [0] * len(sockets)
    open_ = set(range(len(sockets)))
    deadline = time.monotonic() + GIVE_UP_S * 2
    while open_:
        assert time.monotonic() < deadline, "the server never closed the partial frames"
        for i in list(open_):
            try:
                if sent[i] < len(payload):
                    sent[i] += sockets[i].send(payload[sent[i] : sent[i] + (256 << 10)])
                elif sockets[i].recv(1) == b"":
                    open_.discard(i)
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                open_.discard(i)
        on_round()
        select.select([sockets[i] for i in open_], [], [], 0.02)


def test_frames_declared_large_are_bounded_by_the_frame_budget(strict: LiveServer) -> None:
    """Sixteen connections each declare a 4 MiB frame and send 3.5 MiB of it: at most
    the 8 MiB budget of them is read at once (the rest wait, unread, in the kernel), so
    memory grows by far less than the 56 MiB they sent; each is closed by the frame
    timeout. (Unbounded, every one of them was read at once: 3.5 MiB each.)"""
    connections = 16
    declared = 4 << 20
    head = struct.pack(">ihhi", declared, 0, 9, 1)
    payload = memoryview(head + b"\x00" * ((7 << 19) - len(head)))
    budget = strict.gateway.frame_budget
    before = _rss()
    peak = {"held": 0, "rss": before}

    def sample() -> None:
        peak["held"] = max(peak["held"], budget.held)
        peak["rss"] = max(peak["rss"], _rss())

    _flood(strict.address("kafka"), connections, payload, sample)
    assert 0 < peak["held"] <= BUDGET
    growth = peak["rss"] - before
    print(f"frame budget: at most {peak['held'] >> 10} KiB held, RSS grew {growth >> 10} KiB")
    assert growth < connections * declared // 2, f"RSS grew by {growth >> 20} MiB"
    assert budget.held == 0


def test_unauthenticated_memory_ceiling(secure: LiveServer) -> None:
    """Fifty connections before SASL, each sending 500 KiB of a frame declared at the
    512 KiB limit, hold about what they sent and no more, until the handshake timeout
    closes them (the figure in docs/kafka.md)."""
    declared = 512 << 10
    count = 50
    head = struct.pack(">ihhi", declared, 18, 3, 1)
    payload = memoryview(head + b"\x00" * ((500 << 10) - len(head)))
    before = _rss()
    peak = {"rss": before}

    def sample() -> None:
        peak["rss"] = max(peak["rss"], _rss())

    _flood(secure.address("kafka"), count, payload, sample)
    per_connection = (peak["rss"] - before) / count
    print(f"RSS growth per unauthenticated connection: {per_connection / 1024:.0f} KiB")
    assert per_connection < declared + (256 << 10), f"{per_connection / 1024:.0f} KiB each"


# -- a peer that leaves while its request waits ---------------------------------------

LONG_MS = 600_000  # a wait far beyond GIVE_UP_S: only the peer's leaving can end it


def _peer(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def _listed(server: LiveServer, peer: str, *, identified: bool = False) -> bool:
    """Whether the server lists the connection from ``peer`` (and, with ``identified``,
    has read its first whole request: open mode identifies it then)."""
    return any(
        c.peer == peer and (c.principal is not None or not identified)
        for c in server.gateway.connections.list(protocol="kafka")
    )


def _wait_until(condition: Callable[[], bool], timeout_s: float = GIVE_UP_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# How the peer leaves: a reset (SO_LINGER 0) or a close (FIN), with or without more
# requests pipelined behind the waiting one (the fuzzer writes a whole session at once).
LEAVING = ["reset", "close", "reset-pipelined", "close-pipelined"]


def _leave(client: RawKafka, how: str) -> None:
    if how.startswith("reset"):
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def _join(group: str) -> dict[str, Any]:
    return {
        "group_id": group,
        "session_timeout": 30_000,
        "rebalance_timeout": LONG_MS,
        "member_id": "",
        "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": b"m"}],
    }


def _long_fetch(topic: str) -> dict[str, Any]:
    partitions = [{"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1024}]
    return {
        "replica_id": -1,
        "max_wait": LONG_MS,
        "min_bytes": 1,
        "max_bytes": 1 << 20,
        "topics": [{"topic": topic, "partitions": partitions}],
    }


def _create(client: RawKafka, topic: str) -> None:
    answer = client.request(3, 4, {"topics": [{"name": topic}], "allow_auto_topic_creation": True})
    assert answer.topics[0].error_code is ErrorCode.none


def _left_waiting(server: LiveServer, frame: bytes, how: str) -> None:
    """Send ``frame`` as a new connection's first request, leave once the server has
    read it, and wait until the server no longer lists the connection."""
    client = RawKafka(*server.address("kafka"))
    peer = _peer(client.sock)
    if how.endswith("-pipelined"):  # a whole ApiVersions, and the start of another
        more = client.frame(18, 3, {})
        frame += more + more[:5]
    try:
        client.send_bytes(frame)
        assert _wait_until(lambda: _listed(server, peer, identified=True))
        _leave(client, how)
        assert _wait_until(lambda: not _listed(server, peer)), f"{peer} still listed"
    finally:
        client.close()


@pytest.mark.parametrize("how", LEAVING)
def test_peer_leaving_a_join_group_is_unregistered(everyone: LiveServer, how: str) -> None:
    """netfuzz's lingering finding: a JoinGroup waiting for an earlier member to rejoin
    (up to the rebalance timeout the client chose) kept a connection whose peer had
    reset it, listed and holding its slot, until the join ended."""
    join = _join(f"lingering-{how}")
    with RawKafka(*everyone.address("kafka")) as first:
        leader = first.request(11, 5, join)
        assert leader.error_code is ErrorCode.none
        _left_waiting(everyone, first.frame(11, 5, join), how)
        # The member stays in its group until its session ends, as in Kafka; the
        # leader, rejoining, is answered as ever.
        rejoin = first.request(11, 5, {**join, "member_id": leader.member_id})
        assert rejoin.error_code is ErrorCode.none


@pytest.mark.parametrize("how", LEAVING)
def test_peer_leaving_a_long_fetch_is_unregistered(
    everyone: LiveServer, topic: str, how: str
) -> None:
    with RawKafka(*everyone.address("kafka")) as admin:
        _create(admin, topic)
        _left_waiting(everyone, admin.frame(1, 4, _long_fetch(topic)), how)


def test_pipelined_request_behind_a_fetch_wait_is_answered(
    everyone: LiveServer, topic: str
) -> None:
    """Watching for a peer leaving reads nothing: a request pipelined behind a long
    poll, its first byte sent with the poll, is answered after it."""
    with RawKafka(*everyone.address("kafka")) as client:
        _create(client, topic)
        fetch = _long_fetch(topic) | {"max_wait": 200}
        metadata = client.frame(3, 4, {"topics": [{"name": topic}]})
        client.send_bytes(client.frame(1, 4, fetch) + metadata[:1])
        client.send_bytes(metadata[1:])
        assert client.response(1, 4).responses[0].partitions[0].error_code is ErrorCode.none
        assert client.response(3, 4).topics[0].name == topic


def test_request_with_unknown_tagged_fields_is_answered(everyone: LiveServer, topic: str) -> None:
    with RawKafka(*everyone.address("kafka")) as client:
        client.send_bytes(_sized(_metadata_with_unknown_tags(topic)))
        answer = client.response(3, 12)
        assert [(t.name, t.error_code) for t in answer.topics] == [(topic, ErrorCode.none)]
        # The connection goes on.
        assert client.request(18, 3, {}).error_code is ErrorCode.none


if __name__ == "__main__":
    count, seed = int(sys.argv[1]), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "checked"
    started = time.monotonic()
    frames = mutations(count, seed)
    found = decode_in_subprocess(frames, mode)
    outcomes: dict[str, int] = {}
    for outcome in found.outcomes.values():
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"{count} mutations (seed {seed}, {mode}) in {time.monotonic() - started:.1f} s")
    print("outcomes:", outcomes)
    for index in found.aborted:
        print("ABORT", frames[index].hex())
