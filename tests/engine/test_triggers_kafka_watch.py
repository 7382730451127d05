"""KafkaWatchTrigger: its kwargs, and the read loop against an in-memory fake broker.

The real-broker tests: tests/integration/test_watches.py (a deferline triggerer) and
tests/integration/test_airflow_event_triggers.py (an Airflow deployment's asset watcher).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition
from deferline.engine import SourcedEvent, SourcePosition, TriggerEvent
from deferline.engine.triggers import KafkaWatchTrigger

from tests._until import until
from tests.fakes import FakeConsumer, FakeKafka


class FakeWatch(KafkaWatchTrigger):
    fake: FakeConsumer

    def _make_consumer(self) -> Any:
        return self.fake


def watch(kafka: FakeKafka, **kwargs: Any) -> FakeWatch:
    trigger = FakeWatch("orders", "orders-watch", poll_timeout=0.01, **kwargs)
    trigger.fake = FakeConsumer(kafka, group_id="orders-watch")
    return trigger


async def events_of(trigger: KafkaWatchTrigger, wanted: int) -> list[TriggerEvent]:
    found: list[TriggerEvent] = []

    async def read() -> None:
        run = trigger.run()
        assert isinstance(run, AsyncGenerator)
        async with contextlib.aclosing(run) as events:
            async for event in events:
                found.append(event)
                if len(found) == wanted:
                    return

    await asyncio.wait_for(read(), 5)
    return found


def put(kafka: FakeKafka, partition: int, value: Any, key: bytes | None = None) -> None:
    kafka.append("orders", key, orjson.dumps(value), partition=partition, timestamp_ms=1000)


async def test_every_matching_message_is_an_event_named_after_its_record() -> None:
    kafka = FakeKafka()
    kafka.create_topic("orders", 2)
    put(kafka, 0, {"kind": "order", "n": 1})
    put(kafka, 0, {"kind": "noise"})
    put(kafka, 1, {"kind": "order", "n": 2}, key=b"k")
    trigger = watch(kafka, match={"kind": "order"})
    events = await events_of(trigger, 2)
    assert all(isinstance(e, SourcedEvent) for e in events)
    assert [e.source for e in events if isinstance(e, SourcedEvent)] == [
        SourcePosition("orders-watch", "orders", 0, 0),
        SourcePosition("orders-watch", "orders", 1, 0),
    ]
    assert events[1].payload == {
        "topic": "orders",
        "partition": 1,
        "offset": 0,
        "timestamp": "1970-01-01T00:00:01+00:00",
        "key": "k",
        "value": {"kind": "order", "n": 2},
    }
    assert kafka.offset_commits("orders-watch") == [], "the publisher commits, not the trigger"
    assert trigger.fake.stopped


async def test_a_run_starts_at_the_groups_committed_offsets() -> None:
    kafka = FakeKafka()
    kafka.create_topic("orders", 1)
    for n in range(3):
        put(kafka, 0, {"n": n})
    kafka.commit("orders-watch", {TopicPartition("orders", 0): 2})
    [event] = await events_of(watch(kafka), 1)
    assert event.payload["value"] == {"n": 2}


async def test_where_no_publisher_commits_the_trigger_commits_each_event() -> None:
    kafka = FakeKafka()
    kafka.create_topic("orders", 1)
    trigger = watch(kafka)
    trigger.commits_offsets = True
    reading = asyncio.create_task(events_of(trigger, 2))
    await until(lambda: trigger.fake.fetches >= 1)
    put(kafka, 0, {"n": 0})
    put(kafka, 0, {"n": 1})
    await reading
    assert kafka.committed_offsets("orders-watch") == {TopicPartition("orders", 0): 1}


def test_it_serializes_to_what_builds_it_again() -> None:
    trigger = KafkaWatchTrigger("orders", "g", {"kind": "order"}, key="k", start="latest")
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferline.engine.triggers.KafkaWatchTrigger"
    assert KafkaWatchTrigger(**kwargs).serialize() == (classpath, kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topic": "bad topic!", "group": "g"}, "not a legal Kafka topic"),
        ({"topic": "t", "group": ""}, "group"),
        ({"topic": "t", "group": "g", "start": "middle"}, "start must be"),
        ({"topic": "t", "group": "g", "value_regex": "("}, "not a valid regular expression"),
        ({"topic": "t", "group": "g", "consumer_config": {"group_id": "x"}}, "must not set"),
    ],
)
def test_bad_kwargs_say_what_is_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        KafkaWatchTrigger(**kwargs)
