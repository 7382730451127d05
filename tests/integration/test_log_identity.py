"""What each broker names a log by (read_log_identity over a real socket): the cluster id,
a topic id per topic incarnation, the partition counts."""

from __future__ import annotations

import pytest
from deferline.topics import (
    LogIdentity,
    Settings,
    TopicNames,
    ensure_topics,
    make_consumer,
    read_log_identity,
    stop_client,
    topic_specs,
)

from ._clusters import delete_topic

pytestmark = pytest.mark.integration


async def _identity(settings: Settings, topics: list[str]) -> LogIdentity:
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        return await read_log_identity(
            consumer._client, topics, prefix=settings.topic_prefix, group="g"
        )
    finally:
        await stop_client(consumer, grace=10.0, name="test consumer")


@pytest.mark.brokers_differ(
    "Tansu reports one cluster id everywhere; topic ids tell its logs apart"
)
async def test_topic_ids_name_each_incarnation_of_a_topic(
    settings: Settings, broker_backend: str
) -> None:
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    topics = [names.defer(), names.resume()]
    first = await _identity(settings, topics)
    assert first.cluster_id
    if broker_backend == "tansu":
        assert first.cluster_id == "tansu_cluster"
    ids = [t.topic_id for t in first.topics]
    assert None not in ids
    assert len(set(ids)) == 2
    assert [t.partitions for t in first.topics] == [4, 4]
    assert await _identity(settings, topics) == first
    await delete_topic(settings, names.defer())
    await ensure_topics(settings, topic_specs(settings))
    again = await _identity(settings, topics)
    assert again.topics[0].topic_id not in ids
    assert again.topics[1] == first.topics[1]
