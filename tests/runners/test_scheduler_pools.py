"""PoolChannel without a broker: routing to owned tables, the ledger owner's takeover, the
records to write, and its metrics."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import LedgerAdmission, PoolEntry, Pools, TaskTable
from deferline.runners.scheduler import PoolChannel, PoolRecord
from deferline.runners.scheduler.testing import pool_ledger_metrics
from deferline.schemas import PoolGrant, PoolWant, ResumeTarget, TaskKey, TaskStateRecord
from deferline.topics import Settings, partition_for

from tests.fakes import FakeConsumer, FakeKafka

POOLS = Pools(slots={"p": 1}, default_slots=None)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PARTITIONS = 4


SETTINGS = Settings(bootstrap_servers="x:1", topic_prefix="p.")
POOLS_TP = TopicPartition("p.scheduler.pools", 0)


def pools_topic() -> FakeConsumer:
    """A channel's reader of the pools topic (``read_committed``, as the channel's own)."""
    return FakeConsumer(FakeKafka())


def write(consumer: FakeConsumer, records: list[PoolRecord]) -> None:
    """Write ``records`` to the pools topic ``consumer`` reads (its one partition)."""
    for _, key, value in records:
        consumer.kafka.append(POOLS_TP.topic, key, value, partition=POOLS_TP.partition)


def channel(consumer: FakeConsumer) -> PoolChannel:
    made = PoolChannel(
        SETTINGS, pools=POOLS, partitions=PARTITIONS, consumer=cast(AIOKafkaConsumer, consumer)
    )
    assert made.tp == POOLS_TP
    return made


def task_on(partition: int, skip: int = 0) -> TaskKey:
    n = 0
    while True:
        task = TaskKey(dag_id="dag", task_id=f"t{n}", run_id="r1")
        if partition_for(task.ti_key.encode(), PARTITIONS) == partition:
            if skip == 0:
                return task
            skip -= 1
        n += 1


def table_for(ch: PoolChannel) -> TaskTable:
    return TaskTable(pools=POOLS, ledger=LedgerAdmission(partition_of=ch.partition_of))


def scheduled(task: TaskKey, when: int = 0) -> TaskStateRecord:
    return TaskStateRecord(
        task=task,
        state="scheduled",
        source="client",
        updated_at=T0 + dt.timedelta(seconds=when),
        resume=ResumeTarget(operator="pkg.mod.Op", pool="p"),
    )


async def test_wants_of_two_partitions_are_granted_one_at_a_time_by_the_owner() -> None:
    topic = pools_topic()
    owner = channel(topic)
    await owner.start()
    first, second = task_on(1), task_on(2)
    tables = {1: table_for(owner), 2: table_for(owner)}
    owner.own(1, tables[1])
    owner.own(2, tables[2])
    assert owner.grant_records() == [], "not the ledger owner"
    await owner.lead()
    assert owner.leading
    for part, task in ((1, first), (2, second)):
        tables[part].apply(scheduled(task, part))
        assert tables[part].drain() == []
        records = owner.want_records(tables[part].take_pool_writes())
        assert [key for _, key, _ in records] == [f"want/{task.ti_key}".encode()]
        write(topic, records)
    assert await owner.poll() == {1, 2}
    grants = owner.grant_records()
    assert [(key, value is not None) for _, key, value in grants] == [
        (f"grant/{first.ti_key}".encode(), True)
    ]
    write(topic, grants)
    assert await owner.poll() == {1}
    assert [e.record.kind for e in tables[1].drain()] == ["task_state", "run_task"]
    assert owner.usage() == {"p": (1, 1)}
    assert owner.waiting() == {"p": 1}
    metrics = {m.name: m.samples for m in pool_ledger_metrics(owner)}
    assert metrics["deferline_scheduler_pool_ledger_slots_used"][0].value == 1
    assert metrics["deferline_scheduler_pool_ledger_slots"][0].value == 1
    assert metrics["deferline_scheduler_pool_wants_waiting"][0].labels == {"pool": "p"}
    assert metrics["deferline_scheduler_pool_wants_waiting"][0].value == 1
    assert metrics["deferline_scheduler_pool_ledger_owner"][0].value == 1


async def test_a_new_owner_decides_only_once_read_to_the_end_of_the_topic() -> None:
    """The predecessor granted d's want; a ledger deciding before reading that grant would
    also grant a's: two holders in a pool of one."""
    topic = pools_topic()
    first = PoolWant(
        pool="p", slots=1, priority_weight=5, scheduled_at=T0, try_number=1, partition=3
    )
    second = first.model_copy(update={"priority_weight": 1})
    grant = PoolGrant(pool="p", slots=1, try_number=1, partition=3)
    write(
        topic,
        [
            ("", b"want/a/b/c/-1", PoolEntry("want", "a/b/c/-1", first).encode()),
            ("", b"want/d/e/f/-1", PoolEntry("want", "d/e/f/-1", second).encode()),
        ],
    )
    late = channel(topic)
    await late.start()
    await late.poll()
    write(topic, [("", b"grant/d/e/f/-1", PoolEntry("grant", "d/e/f/-1", grant).encode())])
    await late.lead()
    assert late.grant_records() == [], "the predecessor's last grant is not read yet"
    await late.catch_up()
    assert late.leading
    assert late.grant_records() == [], "the pool is full: d/e/f holds its slot"
    assert late.usage() == {"p": (1, 1)}


async def test_a_newly_owned_table_gets_the_latest_records_of_its_tasks() -> None:
    topic = pools_topic()
    reader = channel(topic)
    await reader.start()
    task = task_on(3)
    grant = PoolGrant(pool="p", slots=1, try_number=1, partition=3)
    write(topic, [("", f"grant/{task.ti_key}".encode(), PoolEntry("grant", "x", grant).encode())])
    write(topic, [("", b"nonsense", b"{}")])
    assert await reader.poll() == set()
    assert reader.bad_records == 1
    table = table_for(reader)
    reader.own(3, table)
    table.apply(scheduled(task))
    assert [e.record.kind for e in table.drain()] == ["task_state", "run_task"]
    reader.disown(3)
    assert reader.owned == set()
    with pytest.raises(ValueError, match="LedgerAdmission"):
        reader.own(0, TaskTable(pools=POOLS))
    assert {m.name for m in pool_ledger_metrics(reader)} >= {
        "deferline_scheduler_pool_ledger_owner",
        "deferline_scheduler_pool_wants_waiting",
    }


async def test_an_end_read_by_the_caller_is_read_up_to_without_asking_the_channels_consumer() -> (
    None
):
    topic = pools_topic()
    ch = channel(topic)
    await ch.start()
    task = task_on(1)
    want = PoolWant(pool="p", slots=1, scheduled_at=T0, try_number=1, partition=1)
    write(topic, [("", f"want/{task.ti_key}".encode(), PoolEntry("want", "x", want).encode())])
    other = FakeConsumer(topic.kafka)  # another client, asked before this channel fetched
    end = (await other.end_offsets([POOLS_TP]))[POOLS_TP]
    assert end == 1

    async def busy(partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        raise AssertionError("the channel's own connection was asked for the end")

    topic.end_offsets = busy  # type: ignore[method-assign]
    await ch.lead(end)
    before = (ch.position, ch.leading)  # the predecessor's records below the end unread
    await ch.catch_up(end=end)
    assert before == (0, False)
    assert (ch.position, ch.leading) == (end, True)
    write(topic, [("", b"grant/later", b"{}")])  # written after the end: not waited for
    await ch.catch_up(end=end)
    assert ch.position == end
