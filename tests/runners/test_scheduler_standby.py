"""Standby without a broker: each followed partition folded into a table of its own, handed
over with the offset its tail starts at, records of a taken partition still on their way
ignored, a partition let go folded again from its start."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import cast

from aiokafka import AIOKafkaConsumer
from deferline.engine import Pools
from deferline.runners.scheduler.testing import Standby
from deferline.schemas import ResumeTarget, TaskKey, TaskStateRecord, encode
from deferline.topics import partition_for

from tests.fakes import FakeConsumer, FakeKafka

TOPIC = "tasks"
PARTITIONS = 3
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def tasks_topic() -> FakeConsumer:
    """The standby's reader over a broker holding the tasks topic (``read_committed``)."""
    kafka = FakeKafka()
    kafka.create_topic(TOPIC, PARTITIONS)
    return FakeConsumer(kafka)


def task_on(partition: int, n: int) -> TaskKey:
    """The ``n``-th task key that hashes to ``partition``."""
    found = 0
    for i in range(10_000):
        key = TaskKey(dag_id="d", task_id=f"t{i}", run_id="r", try_number=1)
        if partition_for(key.ti_key.encode(), PARTITIONS) == partition:
            if found == n:
                return key
            found += 1
    raise AssertionError("no such key")


def write(consumer: FakeConsumer, task: TaskKey, state: str = "scheduled") -> None:
    """Write ``task``'s state to the tasks topic ``consumer`` reads (in its partition)."""
    record = TaskStateRecord(
        task=task,
        state=state,
        source="client",
        resume=ResumeTarget(operator="pkg.Op"),
        updated_at=T0,
    )
    key = task.ti_key.encode()
    consumer.kafka.append(TOPIC, key, encode(record), partition=partition_for(key, PARTITIONS))


def standby(consumer: FakeConsumer) -> Standby:
    return Standby(
        lambda: cast(AIOKafkaConsumer, consumer),
        topic=TOPIC,
        pools=Pools(),
        ledger=None,
        max_records=100,
        finished_retention=3600.0,
    )


async def test_each_partition_is_handed_over_with_its_table_and_where_its_tail_starts() -> None:
    consumer = tasks_topic()
    for n in range(3):
        write(consumer, task_on(0, n))
    write(consumer, task_on(1, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS))
    assert s.partitions == [0, 1, 2]
    assert s.records == 4
    warm = s.take([0, 2])
    assert set(warm) == {0}, "a partition with nothing folded has nothing to hand over"
    table, start = warm[0]
    assert start == 3
    assert sorted(table) == sorted(task_on(0, n).ti_key for n in range(3))
    assert s.partitions == [1]
    assert s.handed == 1


async def test_records_of_a_partition_taken_while_a_fetch_was_on_its_way_are_not_folded() -> None:
    consumer = tasks_topic()
    write(consumer, task_on(0, 0))
    write(consumer, task_on(1, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS))
    write(consumer, task_on(0, 1))
    write(consumer, task_on(1, 1))
    consumer.fetch_gate = asyncio.Event()
    fetching = asyncio.create_task(s._fetch(timeout_ms=0))  # on its way when 0 is taken
    await asyncio.sleep(0)
    table, _ = s.take([0])[0]
    consumer.fetch_gate.set()
    await fetching
    assert list(table) == [task_on(0, 0).ti_key], "the table handed over did not move"
    assert s.records == 3, "partition 1's record was folded, partition 0's was not"
    assert s.partitions == [1, 2]
    await s._fetch(timeout_ms=0)
    assert {tp.partition for tp in consumer.assignment()} == {1, 2}, "the consumer dropped 0"
    table1, start1 = s.take([1])[1]
    assert start1 == 2
    assert sorted(table1) == sorted(task_on(1, n).ti_key for n in range(2))


async def test_a_partition_let_go_is_folded_again_from_its_start() -> None:
    consumer = tasks_topic()
    write(consumer, task_on(2, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS))
    s.take([2])
    write(consumer, task_on(2, 1))  # written by this scheduler while it owned 2
    s.follow([2])
    await s._fetch(timeout_ms=0)
    table, start = s.take([2])[2]
    assert start == 2
    assert sorted(table) == sorted(task_on(2, n).ti_key for n in range(2))


async def test_a_followed_partition_keeps_its_position_when_another_is_added() -> None:
    consumer = tasks_topic()
    write(consumer, task_on(0, 0))
    s = standby(consumer)
    await s.warm([0])
    s.follow([1])
    write(consumer, task_on(0, 1))
    write(consumer, task_on(1, 0))
    await s._fetch(timeout_ms=0)
    assert s.records == 3, "partition 0 was not read again from its start"
    assert len(s.take([0])[0][0]) == 2


async def test_a_partition_taken_and_let_go_during_a_fetch_is_folded_from_its_start() -> None:
    consumer = tasks_topic()
    write(consumer, task_on(0, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS))
    write(consumer, task_on(0, 1))
    consumer.fetch_gate = asyncio.Event()
    fetching = asyncio.create_task(s._fetch(timeout_ms=0))  # waits with offset 1 in hand
    await asyncio.sleep(0)
    s.take([0])
    s.follow([0])  # an acquisition abandoned at once
    consumer.fetch_gate.set()
    await fetching
    assert s.records == 1, "the answer to the old table's fetch was not folded into the new"
    await s._fetch(timeout_ms=0)
    table, start = s.take([0])[0]
    assert start == 2
    assert sorted(table) == sorted(task_on(0, n).ti_key for n in range(2))


async def test_with_every_partition_taken_the_consumer_fetches_nothing() -> None:
    consumer = tasks_topic()
    write(consumer, task_on(0, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS))
    s.take(range(PARTITIONS))
    await s._fetch(timeout_ms=0)
    assert consumer.paused() == consumer.assignment(), "paused, not assigned nothing"
    write(consumer, task_on(0, 1))
    await s._fetch(timeout_ms=0)
    assert s.records == 1


async def test_partitions_left_for_later_are_followed_once_joined_unless_owned() -> None:
    consumer = tasks_topic()
    for p in range(PARTITIONS):
        write(consumer, task_on(p, 0))
    s = standby(consumer)
    await s.warm(range(PARTITIONS), later=[1, 2])
    assert s.partitions == [0]
    assert s.records == 1, "partitions left for later were not folded before joining"
    s.joined(owned=[2])
    assert s.partitions == [0, 1], "the owned partition is not followed"
    await s._fetch(timeout_ms=0)
    table, start = s.take([1])[1]
    assert (list(table), start) == ([task_on(1, 0).ti_key], 1)


async def test_a_partition_left_for_later_and_taken_before_joining_is_not_followed() -> None:
    consumer = tasks_topic()
    s = standby(consumer)
    await s.warm(range(PARTITIONS), later=range(PARTITIONS))
    assert s.partitions == []
    assert s.take([0, 1]) == {}, "nothing folded, nothing handed over"
    s.joined(owned=[])
    assert s.partitions == [2]
