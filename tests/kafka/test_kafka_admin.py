"""Topic, config, record and group administration through confluent-kafka's and
kafka-python's admin clients."""

from __future__ import annotations

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import AlterConfigOpType, ConfigEntry, ConfigResource
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewPartitions, NewTopic
from kafka.admin import KafkaAdminClient
from kafka.admin import NewTopic as KNewTopic

from polymq.storage.model import TopicConfig
from tests.kafka.clients import confluent_consume, confluent_consumer, confluent_producer
from tests.live_server import LiveServer


@pytest.fixture
def admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def test_create_describe_grow_and_delete_topics(
    server: LiveServer, admin: AdminClient, topic: str
) -> None:
    admin.create_topics([NewTopic(topic, 3, config={"retention.ms": "3600000"})])[topic].result(10)
    with pytest.raises(KafkaException, match="TOPIC_ALREADY_EXISTS"):
        admin.create_topics([NewTopic(topic, 3)])[topic].result(10)
    metadata = admin.list_topics(topic, timeout=10)
    assert sorted(metadata.topics[topic].partitions) == [0, 1, 2]
    admin.create_partitions([NewPartitions(topic, 5)])[topic].result(10)
    assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 5
    with pytest.raises(KafkaException, match="INVALID_PARTITIONS"):
        admin.create_partitions([NewPartitions(topic, 2)])[topic].result(10)
    info = server.call(lambda: server.gateway.storage.describe_topic("default", topic))
    assert info.config == TopicConfig(queue_count=5, retention_ms=3600000)
    admin.delete_topics([topic])[topic].result(10)
    with pytest.raises(KafkaException, match="UNKNOWN_TOPIC"):
        admin.delete_topics([topic])[topic].result(10)


def test_describe_and_alter_configs(admin: AdminClient, topic: str) -> None:
    admin.create_topics([NewTopic(topic, 1)])[topic].result(10)
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(10)
    assert configs["retention.ms"].value == "604800000"
    assert configs["retention.ms"].is_default
    change = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET),
            ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET),
        ],
    )
    admin.incremental_alter_configs([change])[change].result(10)
    configs = admin.describe_configs([resource])[resource].result(10)
    assert configs["retention.ms"].value == "1000"
    assert configs["cleanup.policy"].value == "compact"
    bad = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry("retention.ms", "-5", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    with pytest.raises(KafkaException, match="INVALID_CONFIG"):
        admin.incremental_alter_configs([bad])[bad].result(10)


def test_delete_records_moves_the_low_watermark(
    bootstrap: str, admin: AdminClient, topic: str
) -> None:
    producer = confluent_producer(bootstrap)
    for i in range(10):
        producer.produce(topic, value=b"%d" % i)
    assert producer.flush(30) == 0
    deleted = admin.delete_records([TopicPartition(topic, 0, 4)])
    result = next(iter(deleted.values())).result(10)
    assert result.low_watermark == 4
    consumer = confluent_consumer(bootstrap, f"g-{topic}")
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (low, high) == (4, 10)
        consumer.subscribe([topic])
        assert confluent_consume(consumer, 6)[0].value() == b"4"
    finally:
        consumer.close()


def test_list_describe_and_delete_groups(bootstrap: str, admin: AdminClient, topic: str) -> None:
    producer = confluent_producer(bootstrap)
    producer.produce(topic, value=b"x")
    assert producer.flush(30) == 0
    group = f"g-{topic}"
    consumer = confluent_consumer(bootstrap, group)
    consumer.subscribe([topic])
    confluent_consume(consumer, 1)
    consumer.commit(asynchronous=False)
    described = admin.describe_consumer_groups([group])[group].result(10)
    assert described.state.name == "STABLE" and len(described.members) == 1
    listed = admin.list_consumer_groups().result(10)
    assert group in {g.group_id for g in listed.valid}
    with pytest.raises(KafkaException, match="NON_EMPTY_GROUP"):
        admin.delete_consumer_groups([group])[group].result(10)
    consumer.close()
    offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
    assert [tp.offset for tp in offsets[group].result(10).topic_partitions] == [1]
    admin.delete_consumer_groups([group])[group].result(10)
    offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
    assert offsets[group].result(10).topic_partitions == []


def test_kafka_python_admin(bootstrap: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([KNewTopic(topic, 2, 1)])
        assert topic in admin.list_topics()
        admin.delete_topics([topic])
        assert topic not in admin.list_topics()
    finally:
        admin.close()
