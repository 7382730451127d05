"""Faults under a running triggerer: a topic deleted from under it."""

from __future__ import annotations

import logging

import pytest
from deferline.runners.triggerer import (
    TopicDeletedError,
    Triggerer,
    TriggererError,
    TriggererOptions,
)
from deferline.topics import Settings, TopicNames, make_admin

from tests._until import until

from ._triggerer_help import TopicReader, defer_request, produce_requests
from ._util import KafkaClients

pytestmark = pytest.mark.integration


@pytest.mark.brokers_differ("brokers answer fetches of a deleted topic differently")
async def test_a_defer_topic_deleted_under_a_running_triggerer_stops_it_naming_the_topic(
    settings: Settings, kafka_clients: KafkaClients, caplog: pytest.LogCaptureFixture
) -> None:
    """One ERROR line naming the topic, the member stops as failed (exit 1 from the CLI), and
    no commit is retried against the deleted topic meanwhile."""
    names = TopicNames(settings.topic_prefix)
    options = TriggererOptions(session_timeout_ms=6000, checkpoint_interval=0.5)
    producer = await kafka_clients.producer()
    requests = [defer_request(i) for i in range(8)]
    async with (
        TopicReader(settings, names.resume()) as reader,
        Triggerer(settings, options) as running,
    ):
        await produce_requests(producer, settings, requests)
        await until(
            lambda: len(reader.events()) >= len(requests), within=60, interval=0.05, what="fired"
        )
        caplog.clear()
        with caplog.at_level(logging.INFO):
            admin = make_admin(settings)
            await admin.start()
            try:
                await admin.delete_topics([names.defer()])
            finally:
                await admin.close()
            await until(
                lambda: running._fatal is not None,
                within=60,
                interval=0.05,
                what="the member stops",
            )
            with pytest.raises(TriggererError, match="deleted"):
                await running.wait()  # the stop is requested, and why
        assert isinstance(running._fatal, TopicDeletedError)
        assert names.defer() in str(running._fatal)
    named = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and getattr(r, "topic", None) == names.defer()
    ]
    assert len(named) == 1, [r.getMessage() for r in named]
    assert "deleted" in named[0].getMessage()
    retried = [r for r in caplog.records if "OffsetCommit failed" in r.getMessage()]
    assert len(retried) <= 2, f"{len(retried)} commits retried against the deleted topic"
