"""ensure_topics, describe_topics and the partitioner against a real broker."""

import asyncio

import pytest
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from deferline.topics import (
    Settings,
    TopicLayoutError,
    TopicNames,
    describe_topics,
    ensure_topics,
    partition_for,
    topic_specs,
)

from tests._until import until

pytestmark = pytest.mark.integration


async def _partitions(settings: Settings) -> dict[str, int]:
    return {t.name: t.partitions for t in await describe_topics(settings, configs=False)}


async def test_ensure_topics_creates_the_layout_and_is_idempotent(settings):
    specs = topic_specs(settings, queues=["fast"], worker_queues=["gpu"])
    await ensure_topics(settings, specs)
    first = await _partitions(settings)
    assert first == {spec.name: spec.partitions for spec in specs}
    others = dict(first)
    assert others.pop(f"{settings.topic_prefix}scheduler.pools") == 1, "the pool ledger: one"
    assert set(others.values()) == {4}, "every other topic has the configured partitions"

    await ensure_topics(settings, specs)  # again: nothing changes, nothing fails
    await asyncio.gather(ensure_topics(settings, specs), ensure_topics(settings, specs))
    assert await _partitions(settings) == first


@pytest.mark.tansu_first
async def test_ensure_topics_adds_missing_topics_next_to_existing_ones(settings):
    await ensure_topics(settings, topic_specs(settings))
    more = topic_specs(settings, queues=["late"])
    await ensure_topics(settings, more)
    names = TopicNames(settings.topic_prefix)
    found = await _partitions(settings)
    assert found[names.defer("late")] == found[names.resume("late")] == 4


@pytest.mark.tansu_first
async def test_missing_partner_is_created_with_the_existing_partition_count(
    settings, kafka_clients
):
    names = TopicNames(settings.topic_prefix)
    admin = await kafka_clients.admin()
    await admin.create_topics([NewTopic(names.defer(), 3, 1)])
    await ensure_topics(settings, topic_specs(settings))  # spec says 4
    found = await _partitions(settings)
    assert found[names.defer()] == found[names.resume()] == 3
    assert found[names.tasks] == 4


@pytest.mark.tansu_first
async def test_mismatched_pair_raises_and_creates_nothing(settings, kafka_clients):
    names = TopicNames(settings.topic_prefix)
    admin = await kafka_clients.admin()
    await admin.create_topics([NewTopic(names.defer(), 4, 1), NewTopic(names.resume(), 2, 1)])
    with pytest.raises(TopicLayoutError) as info:
        await ensure_topics(settings, topic_specs(settings))
    message = str(info.value)
    assert f"{names.defer()} has 4 partitions but {names.resume()} has 2" in message
    assert "co-partitioned" in message
    assert set(await _partitions(settings)) == {names.defer(), names.resume()}


@pytest.mark.tansu_first
async def test_produced_records_land_on_partition_for(settings, kafka_clients):
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    producer = await kafka_clients.producer()
    keys = [f"trigger-{i}".encode() for i in range(40)]
    sent = await asyncio.gather(*[producer.send_and_wait(names.defer(), b"v", key=k) for k in keys])
    assert [m.partition for m in sent] == [partition_for(k, 4) for k in keys]
    assert len({m.partition for m in sent}) == 4  # the keys spread over all partitions

    # And a reader sees each key on that partition.
    consumer = await kafka_clients.consumer(names.defer())
    seen: dict[bytes, int] = {}
    while len(seen) < len(keys):
        batch = await consumer.getmany(timeout_ms=1000)
        assert batch, f"only {len(seen)} of {len(keys)} records came back"
        for tp, records in batch.items():
            seen.update({r.key: tp.partition for r in records})
    assert seen == {k: partition_for(k, 4) for k in keys}


@pytest.mark.kafka_only
async def test_defer_and_tasks_are_compacted_on_kafka(settings, kafka_clients):
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    admin = await kafka_clients.admin()
    (response,) = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, names.defer())]
    )
    (resource,) = response.to_object()["resources"]
    config = {e["config_names"]: e["config_value"] for e in resource["config_entries"]}
    assert config["cleanup.policy"] == "compact"
    assert config["min.compaction.lag.ms"] == "3600000"

    described = {t.name: t.config for t in await describe_topics(settings)}
    assert described[names.tasks]["cleanup.policy"] == "compact"
    assert described[names.resume()]["cleanup.policy"] == "delete"
    assert described[names.dead]["retention.ms"] == str(30 * 24 * 3_600_000)


@pytest.mark.kafka_only
async def test_the_local_kafka_broker_takes_sessions_down_to_a_second(settings, kafka_clients):
    # Apache Kafka's default group.min.session.timeout.ms is 6 s: a member asking less is
    # refused (INVALID_SESSION_TIMEOUT). The local brokers allow 1 s, so a failover waits less.
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    consumer = await kafka_clients.consumer(
        names.defer(),
        group_id=f"{settings.topic_prefix}short-session",
        session_timeout_ms=1500,
        heartbeat_interval_ms=300,
    )

    async def joined() -> object:
        await consumer.getmany(timeout_ms=100)
        return consumer.assignment()

    await until(joined, within=30, interval=0.05, what="the member joined its group")
