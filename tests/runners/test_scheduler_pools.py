"""PoolChannel without a broker: routing to owned tables, the ledger owner's takeover, the
records to write, and its metrics."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import LedgerAdmission, PoolEntry, Pools, TaskTable
from deferline.runners.scheduler import PoolChannel, PoolRecord
from deferline.runners.scheduler._metrics import pool_ledger_metrics
from deferline.schemas import PoolGrant, PoolWant, ResumeTarget, TaskKey, TaskStateRecord
from deferline.topics import Settings, partition_for

POOLS = Pools(slots={"p": 1}, default_slots=None)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PARTITIONS = 4


@dataclass
class Message:
    offset: int
    key: bytes | None
    value: bytes | None


class FakeConsumer:
    """The pools partition as a list; reads what was appended since the last read."""

    def __init__(self) -> None:
        self.log: list[tuple[bytes | None, bytes | None]] = []
        self.at = 0

    def append(self, records: list[PoolRecord]) -> None:
        self.log += [(key, value) for _, key, value in records]

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assign(self, tps: list[TopicPartition]) -> None:
        pass

    async def seek_to_beginning(self, tp: TopicPartition) -> None:
        self.at = 0

    async def getmany(self, tp: TopicPartition, **_: Any) -> dict[TopicPartition, list[Message]]:
        batch = [Message(o, *self.log[o]) for o in range(self.at, len(self.log))]
        self.at = len(self.log)
        return {tp: batch}

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.log) for tp in tps}

    async def position(self, tp: TopicPartition) -> int:
        return self.at


def channel(consumer: FakeConsumer) -> PoolChannel:
    settings = Settings(bootstrap_servers="x:1", topic_prefix="p.")
    return PoolChannel(
        settings, pools=POOLS, partitions=PARTITIONS, consumer=cast(AIOKafkaConsumer, consumer)
    )


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
    topic = FakeConsumer()
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
        topic.append(records)
    assert await owner.poll() == {1, 2}
    grants = owner.grant_records()
    assert [(key, value is not None) for _, key, value in grants] == [
        (f"grant/{first.ti_key}".encode(), True)
    ]
    topic.append(grants)
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
    topic = FakeConsumer()
    first = PoolWant(
        pool="p", slots=1, priority_weight=5, scheduled_at=T0, try_number=1, partition=3
    )
    second = first.model_copy(update={"priority_weight": 1})
    grant = PoolGrant(pool="p", slots=1, try_number=1, partition=3)
    topic.append(
        [
            ("", b"want/a/b/c/-1", PoolEntry("want", "a/b/c/-1", first).encode()),
            ("", b"want/d/e/f/-1", PoolEntry("want", "d/e/f/-1", second).encode()),
        ]
    )
    late = channel(topic)
    await late.start()
    await late.poll()
    topic.append([("", b"grant/d/e/f/-1", PoolEntry("grant", "d/e/f/-1", grant).encode())])
    await late.lead()
    assert late.grant_records() == [], "the predecessor's last grant is not read yet"
    await late.catch_up()
    assert late.leading
    assert late.grant_records() == [], "the pool is full: d/e/f holds its slot"
    assert late.usage() == {"p": (1, 1)}


async def test_a_newly_owned_table_gets_the_latest_records_of_its_tasks() -> None:
    topic = FakeConsumer()
    reader = channel(topic)
    await reader.start()
    task = task_on(3)
    grant = PoolGrant(pool="p", slots=1, try_number=1, partition=3)
    topic.append([("", f"grant/{task.ti_key}".encode(), PoolEntry("grant", "x", grant).encode())])
    topic.append([("", b"nonsense", b"{}")])
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
    topic = FakeConsumer()
    ch = channel(topic)
    await ch.start()
    task = task_on(1)
    want = PoolWant(pool="p", slots=1, scheduled_at=T0, try_number=1, partition=1)
    topic.append([("", f"want/{task.ti_key}".encode(), PoolEntry("want", "x", want).encode())])
    end = len(topic.log)  # read by another client, before this channel fetched

    async def busy(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        raise AssertionError("the channel's own connection was asked for the end")

    topic.end_offsets = busy  # type: ignore[method-assign]
    await ch.lead(end)
    before = (ch.position, ch.leading)  # the predecessor's records below the end unread
    await ch.catch_up(end=end)
    assert before == (0, False)
    assert (ch.position, ch.leading) == (end, True)
    topic.append([("", b"grant/later", b"{}")])  # written after the end: not waited for
    await ch.catch_up(end=end)
    assert ch.position == end
