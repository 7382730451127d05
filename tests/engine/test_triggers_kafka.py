"""KafkaMessageTrigger: matching rules, kwargs, and the read loop against an in-memory fake.

The real-broker test lives in tests/integration/test_kafka_message_trigger.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition
from deferline.engine.triggers import KafkaMessageTrigger
from deferline.engine.triggers.testing import decode_value, json_contains

from tests._until import until
from tests.fakes import FakeConsumer, FakeKafka

from ._support import first_event

SINCE = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
MS = int(SINCE.timestamp() * 1000)


def test_json_contains() -> None:
    doc = {"status": "done", "meta": {"rows": 3, "tags": ["a"]}, "ok": True}
    assert json_contains(doc, {})
    assert json_contains(doc, {"status": "done"})
    assert json_contains(doc, {"meta": {"rows": 3}})
    assert json_contains(doc, {"meta": {"tags": ["a"]}})
    assert not json_contains(doc, {"meta": {"rows": 4}})
    assert not json_contains(doc, {"missing": None})
    assert not json_contains(doc, {"ok": 1})  # JSON true is not 1
    assert json_contains(doc, {"ok": True})
    assert not json_contains([1], {"a": 1})


def test_decode_value() -> None:
    assert decode_value(b'{"a": 1}') == {"a": 1}
    assert decode_value(b"plain text") == "plain text"
    assert decode_value(b"\xff\xfe") == b"\xff\xfe"
    assert decode_value(None) is None


def test_matches_combines_every_condition() -> None:
    trigger = KafkaMessageTrigger(
        "orders", {"state": "paid"}, key="o-1", value_regex=r"EUR|USD", since=SINCE
    )
    good = orjson.dumps({"state": "paid", "currency": "EUR"})
    assert trigger.matches(b"o-1", good, MS)
    assert not trigger.matches(b"o-2", good, MS)
    assert not trigger.matches(None, good, MS)
    assert not trigger.matches(b"o-1", orjson.dumps({"state": "paid", "currency": "GBP"}), MS)
    assert not trigger.matches(b"o-1", orjson.dumps({"state": "new", "currency": "EUR"}), MS)
    assert not trigger.matches(b"o-1", b"paid EUR (not json)", MS)
    assert not trigger.matches(b"o-1", good, MS - 1)  # before `since`
    assert KafkaMessageTrigger("orders", since=SINCE).matches(None, None, MS)


def test_since_defaults_to_creation_time_and_is_serialized() -> None:
    before = dt.datetime.now(dt.UTC)
    trigger = KafkaMessageTrigger("events")
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferline.engine.triggers.KafkaMessageTrigger"
    assert before <= kwargs["since"] <= dt.datetime.now(dt.UTC)
    assert KafkaMessageTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert KafkaMessageTrigger("events", since="earliest").since == "earliest"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"topic": ""}, ValueError, "topic must not be empty"),
        ({"topic": "bad topic!"}, ValueError, "not a legal Kafka topic"),
        ({"topic": "t", "match": ["x"]}, TypeError, "match must be a JSON object"),
        ({"topic": "t", "value_regex": "("}, ValueError, "not a valid regular expression"),
        ({"topic": "t", "since": "yesterday"}, ValueError, "ISO-8601"),
        ({"topic": "t", "since": dt.datetime(2030, 1, 1)}, ValueError, "timezone-aware"),
        ({"topic": "t", "bootstrap_servers": ""}, TypeError, "bootstrap_servers"),
        ({"topic": "t", "consumer_config": {"group_id": "g"}}, ValueError, "must not set group_id"),
        ({"topic": "t", "poll_timeout": 0}, ValueError, "poll_timeout"),
    ],
)
def test_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        KafkaMessageTrigger(**kwargs)


class FakeKafkaTrigger(KafkaMessageTrigger):
    fake: FakeConsumer

    def _make_consumer(self) -> Any:
        return self.fake


def _trigger(fake: FakeConsumer, topic: str, **kwargs: Any) -> FakeKafkaTrigger:
    trigger = FakeKafkaTrigger(topic, **kwargs)
    trigger.fake = fake
    return trigger


def put(
    kafka: FakeKafka, topic: str, partition: int, key: bytes | None, value: Any, ts: int
) -> None:
    """Write a record (``value`` as JSON unless bytes) with the time ``ts`` (ms)."""
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    kafka.append(topic, key, raw, partition=partition, timestamp_ms=ts)


async def test_first_matching_message_since_the_start_fires() -> None:
    kafka = FakeKafka()
    kafka.create_topic("orders", 2)
    fake = FakeConsumer(kafka)
    put(kafka, "orders", 0, b"o-1", {"state": "paid"}, MS - 10)  # before `since`: ignored
    put(kafka, "orders", 1, b"o-1", {"state": "new"}, MS + 1)
    trigger = _trigger(fake, "orders", match={"state": "paid"}, since=SINCE, poll_timeout=0.01)
    pending = asyncio.create_task(first_event(trigger))
    await until(lambda: fake.fetches >= 2)
    assert not pending.done()
    assert fake.assignment() == {TopicPartition("orders", 0), TopicPartition("orders", 1)}
    put(kafka, "orders", 1, b"o-1", {"state": "paid", "amount": 5}, MS + 2)
    event = await asyncio.wait_for(pending, 5)
    assert event.payload == {
        "topic": "orders",
        "partition": 1,
        "offset": 1,
        "timestamp": dt.datetime.fromtimestamp((MS + 2) / 1000, dt.UTC),
        "key": "o-1",
        "value": {"state": "paid", "amount": 5},
    }
    assert fake.started
    assert fake.stopped


async def test_earliest_reads_from_the_beginning_and_waits_for_the_topic() -> None:
    kafka = FakeKafka()
    fake = FakeConsumer(kafka)
    trigger = _trigger(
        fake, "late-topic", value_regex="world", since="earliest", poll_timeout=0.001
    )

    async def run() -> list[Any]:
        return [event async for event in trigger.run()]

    running = asyncio.create_task(run())
    await until(lambda: fake.client.metadata_requests >= 2)
    assert not running.done(), "no topic yet"
    put(kafka, "late-topic", 0, None, b"hello world", 5)  # the topic is created with it
    events = await asyncio.wait_for(running, 5)
    assert [e.payload["value"] for e in events] == ["hello world"]
    assert fake.client.metadata_requests >= 2
    assert fake.stopped


async def test_latest_skips_what_is_already_there() -> None:
    kafka = FakeKafka()
    fake = FakeConsumer(kafka)
    put(kafka, "t", 0, None, {"n": 1}, 5)
    trigger = _trigger(fake, "t", since="latest", poll_timeout=0.001)
    pending = asyncio.create_task(first_event(trigger))
    await until(lambda: fake.fetches >= 2)
    put(kafka, "t", 0, None, {"n": 2}, 6)
    event = await asyncio.wait_for(pending, 5)
    assert event.payload["value"] == {"n": 2}
