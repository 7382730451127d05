"""The pool ledger over a real broker: two schedulers' channels, one of them the ledger owner,
share a pool of 2 slots between tasks of partitions each of them owns."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from aiokafka import AIOKafkaProducer
from deferline.engine import HOLDING_STATES, LedgerAdmission, Pools, TaskTable
from deferline.runners.scheduler import PoolChannel, PoolRecord
from deferline.schemas import ResumeTarget, RunTask, TaskKey, TaskStateRecord
from deferline.topics import Settings, ensure_topics, partition_for, topic_specs

from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.tansu_first]

POOLS = Pools(slots={"p": 2}, default_slots=None)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def tasks_on(partition: int, count: int, partitions: int) -> list[TaskKey]:
    """``count`` task keys whose ti_key hashes to ``partition``."""
    found: list[TaskKey] = []
    n = 0
    while len(found) < count:
        task = TaskKey(dag_id="dag", task_id=f"t{n}", run_id="r1")
        if partition_for(task.ti_key.encode(), partitions) == partition:
            found.append(task)
        n += 1
    return found


async def send(producer: AIOKafkaProducer, records: list[PoolRecord]) -> None:
    for topic, key, value in records:
        await producer.send_and_wait(topic, value, key=key, partition=0)


async def test_two_channels_keep_a_pool_of_two_exact(
    settings: Settings, kafka_clients: KafkaClients
) -> None:
    await ensure_topics(settings, topic_specs(settings))
    n = settings.partitions
    producer = await kafka_clients.producer()
    owner = PoolChannel(settings, pools=POOLS, partitions=n)
    other = PoolChannel(settings, pools=POOLS, partitions=n)
    tables = {
        part: TaskTable(pools=POOLS, ledger=LedgerAdmission(partition_of=owner.partition_of))
        for part in (0, 1)
    }
    channel_of = {0: owner, 1: other}
    async with owner, other:
        owner.own(0, tables[0])
        other.own(1, tables[1])
        await owner.lead()  # no predecessor to fence: nothing was written yet
        await owner.catch_up()
        await other.catch_up()
        assert owner.leading
        assert not other.leading

        mine = tasks_on(0, 3, n)
        theirs = tasks_on(1, 2, n)
        target = ResumeTarget(operator="pkg.mod.Op", pool="p")
        for when, task in enumerate([*mine, *theirs]):
            table = tables[0] if task in mine else tables[1]
            table.apply(
                TaskStateRecord(
                    task=task,
                    state="scheduled",
                    source="client",
                    updated_at=T0 + dt.timedelta(seconds=when),
                    resume=target,
                )
            )

        started: list[str] = []
        finished: set[str] = set()
        most_held = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while len(finished) < 5:
            assert loop.time() < deadline, f"started {started}, finished {sorted(finished)}"
            for part, table in tables.items():
                for emit in table.drain():
                    record = emit.record
                    if isinstance(record, RunTask):
                        started.append(record.task.ti_key)
                    elif isinstance(record, TaskStateRecord):
                        table.apply(emit.written)  # as the tasks topic would give it back
                await send(producer, channel_of[part].want_records(table.take_pool_writes()))
            await send(producer, owner.grant_records())
            for channel in (owner, other):
                await channel.poll(timeout_ms=50)
                used, size = channel.usage()["p"]
                assert size == 2
                assert used <= 2, f"{used} slots granted in a pool of 2"
            holders = [
                key
                for table in tables.values()
                for key in table
                if (state := table.get(key)) is not None and state.state in HOLDING_STATES
            ]
            assert len(holders) <= 2, holders
            most_held = max(most_held, len(holders))
            if len(holders) == 2 or (holders and len(started) == 5):
                done = holders[0]  # its worker finishes: the want is tombstoned, slot freed
                table = next(t for t in tables.values() if done in t)
                current = table.get(done)
                assert current is not None
                table.apply(
                    TaskStateRecord(
                        task=current.task,
                        state="success",
                        source="worker",
                        updated_at=T0 + dt.timedelta(minutes=len(finished) + 1),
                    )
                )
                finished.add(done)

        assert sorted(started) == sorted(t.ti_key for t in [*mine, *theirs]), "each started once"
        assert most_held == 2, "the pool was full while others waited"

        async def freed() -> bool:
            for part, table in tables.items():
                table.drain()
                await send(producer, channel_of[part].want_records(table.take_pool_writes()))
            await send(producer, owner.grant_records())
            await owner.poll(timeout_ms=50)
            await other.poll(timeout_ms=50)
            return owner.usage()["p"][0] == 0 and other.usage()["p"][0] == 0

        while not await freed():
            assert loop.time() < deadline, "slots of finished tasks are freed"
        assert other.waiting() == {}
