"""KafkaMessageTrigger: matching rules, kwargs, and the read loop against an in-memory fake.

The real-broker test lives in tests/integration/test_kafka_message_trigger.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition
from deferline.engine.triggers import KafkaMessageTrigger
from deferline.engine.triggers._kafka import decode_value, json_contains

from ._support import first_event, wait_until

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


@dataclass
class Msg:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


@dataclass
class FakeConsumer:
    """The slice of AIOKafkaConsumer the trigger uses, over an in-memory log."""

    log: dict[int, list[Msg]]
    topic: str
    visible_after: int = 0  # metadata calls before the topic "exists"
    started: bool = False
    stopped: bool = False
    positions: dict[int, int] = field(default_factory=dict)
    metadata_calls: int = 0
    polls: int = 0

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return None  # like aiokafka: no metadata for topics it does not track

    @property
    def _client(self) -> FakeConsumer:
        return self

    async def fetch_all_metadata(self) -> Any:
        self.metadata_calls += 1
        visible = self.metadata_calls > self.visible_after
        partitions = set(self.log) if visible else None
        return type("Cluster", (), {"partitions_for_topic": lambda _, topic: partitions})()

    def assign(self, tps: list[TopicPartition]) -> None:
        assert [tp.partition for tp in tps] == sorted(self.log)

    async def seek_to_beginning(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self.positions[tp.partition] = 0

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.log[tp.partition]) for tp in tps}

    async def offsets_for_times(
        self, query: dict[TopicPartition, int]
    ) -> dict[TopicPartition, Any]:
        out: dict[TopicPartition, Any] = {}
        for tp, ts in query.items():
            hit = next((m for m in self.log[tp.partition] if m.timestamp >= ts), None)
            out[tp] = None if hit is None else type("OT", (), {"offset": hit.offset})()
        return out

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp.partition] = offset

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Msg]]:
        await asyncio.sleep(0)
        self.polls += 1
        out: dict[TopicPartition, list[Msg]] = {}
        for p, pos in self.positions.items():
            batch = self.log[p][pos : pos + max_records]
            if batch:
                out[TopicPartition(self.topic, p)] = batch
                self.positions[p] = pos + len(batch)
        return out

    def append(self, partition: int, key: bytes | None, value: Any, timestamp: int) -> None:
        part = self.log[partition]
        raw = value if isinstance(value, bytes) else orjson.dumps(value)
        part.append(Msg(self.topic, partition, len(part), key, raw, timestamp))


class FakeKafkaTrigger(KafkaMessageTrigger):
    fake: FakeConsumer

    def _make_consumer(self) -> Any:
        return self.fake


def _trigger(fake: FakeConsumer, **kwargs: Any) -> FakeKafkaTrigger:
    trigger = FakeKafkaTrigger(fake.topic, **kwargs)
    trigger.fake = fake
    return trigger


async def test_first_matching_message_since_the_start_fires() -> None:
    fake = FakeConsumer({0: [], 1: []}, "orders")
    fake.append(0, b"o-1", {"state": "paid"}, MS - 10)  # before `since`: ignored
    fake.append(1, b"o-1", {"state": "new"}, MS + 1)
    trigger = _trigger(fake, match={"state": "paid"}, since=SINCE, poll_timeout=0.01)
    pending = asyncio.create_task(first_event(trigger))
    await wait_until(lambda: fake.polls >= 2)
    assert not pending.done()
    fake.append(1, b"o-1", {"state": "paid", "amount": 5}, MS + 2)
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
    fake = FakeConsumer({0: []}, "late-topic", visible_after=2)
    fake.append(0, None, b"hello world", 5)
    trigger = _trigger(fake, value_regex="world", since="earliest", poll_timeout=0.001)
    events = [event async for event in trigger.run()]
    assert [e.payload["value"] for e in events] == ["hello world"]
    assert fake.metadata_calls >= 2
    assert fake.stopped


async def test_latest_skips_what_is_already_there() -> None:
    fake = FakeConsumer({0: []}, "t")
    fake.append(0, None, {"n": 1}, 5)
    trigger = _trigger(fake, since="latest", poll_timeout=0.001)
    pending = asyncio.create_task(first_event(trigger))
    await wait_until(lambda: fake.polls >= 2)
    fake.append(0, None, {"n": 2}, 6)
    event = await asyncio.wait_for(pending, 5)
    assert event.payload["value"] == {"n": 2}
