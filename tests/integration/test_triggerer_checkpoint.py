"""The triggerer's partition checkpoints are trusted only for the log they were read from:
a checkpoint of another cluster with the same topic names, or of a topic deleted and created
again, is discarded (one line, counted) even where its offsets fall inside the new range."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from deferline.runners.triggerer import Triggerer
from deferline.runners.triggerer.testing import RocksCheckpointStore
from deferline.schemas import DeferRequest
from deferline.topics import (
    Settings,
    TopicNames,
    ensure_topics,
    make_producer,
    stop_client,
    topic_specs,
)

from tests._until import until
from tests.integration._clusters import another_cluster, delete_topic, end_offsets
from tests.integration._triggerer_help import TopicReader, defer_request, produce_requests
from tests.integration.test_triggerer import bootstrapped, options, running, sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


async def _checkpoint_waiting_triggers(settings: Settings, tmp_path: Path) -> dict[int, int]:
    """Run a member whose 40 triggers wait for an hour, stop it; the defer offsets it saved."""
    waiting = [defer_request(i, due_in=3600, run="a") for i in range(40)]
    await ensure_topics(settings, topic_specs(settings))
    await _produce(settings, waiting)
    async with Triggerer(settings, options(tmp_path)) as triggerer:
        await until(lambda: triggerer.supervisor.running == 40, within=30, interval=0.05)
    store = RocksCheckpointStore(tmp_path / "solo")
    try:
        defer = TopicNames(settings.topic_prefix).defer()
        saved = {p: store.load(defer, p) for p in range(settings.partitions)}
    finally:
        store.close()
    return {p: c.defer_offset for p, c in saved.items() if c is not None}


async def _fire_all_past(
    settings: Settings, tmp_path: Path, saved: dict[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    """On a log that is not the checkpoints', every defer partition longer than the saved
    offsets: the checkpoints are discarded in one line and every new trigger fires."""
    names = TopicNames(settings.topic_prefix)
    requests = [defer_request(i, due_in=4, run="b") for i in range(120)]
    await ensure_topics(settings, topic_specs(settings))
    await _produce(settings, requests)
    ends = await end_offsets(settings, names.defer())
    assert saved, "the first run wrote checkpoints"
    assert all(ends[p] > offset for p, offset in saved.items()), (ends, saved)
    with caplog.at_level(logging.WARNING):
        async with (
            Triggerer(settings, options(tmp_path)) as triggerer,
            TopicReader(settings, names.resume()) as events,
        ):
            await until(lambda: bootstrapped(triggerer), within=30, interval=0.05)
            assert not any(
                running(triggerer, r.trigger_id)
                for r in (defer_request(i, run="a") for i in range(40))
            ), "no trigger of the other log runs"
            await until(lambda: len(events.distinct_triggers()) == 120, within=60, interval=0.05)
            discarded = sample(triggerer, "deferline_triggerer_checkpoint_mismatches_total")
    assert events.distinct_triggers() == {r.trigger_id for r in requests}
    assert discarded == len(saved)
    lines = [r.getMessage() for r in caplog.records if "read from another log" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "topic id of" in lines[0] or "cluster id" in lines[0]


async def _produce(settings: Settings, requests: list[DeferRequest]) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        await produce_requests(producer, settings, requests)
    finally:
        await stop_client(producer, grace=10.0, name="test producer")


@pytest.mark.brokers_differ(
    "checkpoints are told apart by cluster id on Kafka, by topic id on Tansu"
)
async def test_checkpoints_of_another_cluster_with_the_same_names_are_discarded(
    settings: Settings, broker_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = await _checkpoint_waiting_triggers(settings, tmp_path)
    async with another_cluster(broker_backend, settings) as cluster_b:
        await _fire_all_past(cluster_b, tmp_path, saved, caplog)


async def test_checkpoints_of_a_recreated_topic_longer_than_them_are_discarded(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = await _checkpoint_waiting_triggers(settings, tmp_path)
    await delete_topic(settings, TopicNames(settings.topic_prefix).defer())
    await _fire_all_past(settings, tmp_path, saved, caplog)
