"""Standby tables (``Scheduler(standby=True)``, ``deferline scheduler --standby``) on a real
broker: a scheduler folds the partitions it does not own as they are written; one it acquires
(at its start, at a join, at another's leave) folds only the tail since, into the same table
a fold from the topic's start builds, and every task is resumed exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from deferline.runners.scheduler import Scheduler
from deferline.runners.scheduler.testing import TaskFold, TasksReader
from deferline.schemas import TaskKey, TaskStateRecord
from deferline.topics import Settings, TopicNames, make_consumer, partition_for, stop_client

from tests._until import until

from ._taskflow import TaskFlow, task_key
from .test_scheduler import FAST

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


async def _cold_fold(settings: Settings) -> dict[str, TaskStateRecord]:
    """Every task as a fold of the whole tasks topic, from its start, builds it."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        fold = TaskFold()
        reader = TasksReader(consumer, fold, max_records=10_000, dead=_no_dead_letter)
        await reader.recover(
            TopicNames(settings.topic_prefix).tasks,
            set(range(settings.partitions)),
            None,
            prefix=settings.topic_prefix,
            group="test",
            total=settings.partitions,
        )
        return fold.table.snapshot()
    finally:
        await stop_client(consumer, grace=10.0, name="test consumer")


def _no_dead_letter(message: object, error: str) -> Any:
    raise AssertionError(f"unreadable record {message}: {error}")


async def _settled(*schedulers: Scheduler) -> None:
    """Each scheduler has read back every record on its tasks partitions as of now."""
    for scheduler in schedulers:
        reader = scheduler.clients.reader
        assert reader is not None
        await reader.caught_up()


async def _records_on(settings: Settings, partitions: set[int]) -> int:
    """Records on ``partitions`` of the tasks topic (the end offset, minus its start, is at
    least that: transaction markers take offsets too)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        topic = TopicNames(settings.topic_prefix).tasks
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        return sum(ends[tp] - starts[tp] for tp in tps)
    finally:
        await stop_client(consumer, grace=10.0, name="test consumer")


def _tasks_on_every_partition(settings: Settings, each: int) -> list[TaskKey]:
    """``each`` tasks on every tasks partition: every acquisition takes only standby tables
    (none folds a partition from the beginning), so the takeover reader is handed
    partitions at their end, with nothing to fetch."""
    found: dict[int, list[TaskKey]] = {p: [] for p in range(settings.partitions)}
    n = 0
    while any(len(keys) < each for keys in found.values()):
        task = task_key(f"t{n}")
        keys = found[partition_for(task.ti_key.encode(), settings.partitions)]
        if len(keys) < each:
            keys.append(task)
        n += 1
    return [task for keys in found.values() for task in keys]


def _partitions_of(settings: Settings, tasks: list[TaskKey]) -> set[int]:
    return {partition_for(t.ti_key.encode(), settings.partitions) for t in tasks}


async def test_takeovers_from_standby_fold_the_tail_into_the_table_a_full_fold_builds(
    settings: Settings, tmp_path: Path
) -> None:
    tasks = _tasks_on_every_partition(settings, 60 // settings.partitions)
    holding = _partitions_of(settings, tasks)
    assert holding == set(range(settings.partitions))
    options: dict[str, Any] = {"standby": True, "checkpoint_interval": 0.2, **FAST}
    async with TaskFlow(settings) as flow:
        for task in tasks:  # on the topic before any scheduler starts
            await flow.submit(task)
        a = Scheduler(settings, state_dir=tmp_path / "a", **options)
        await a.start()
        b: Scheduler | None = None
        try:
            await a.wait_owning(settings.partitions)
            assert a.standby is not None
            # Folded before joining: every partition holding a record came from the standby.
            assert a.standby.handed == len(holding)
            assert a.recovered_records == 0
            await flow.wait_for(lambda: all(flow.runs_of(t, "start") for t in tasks))
            for task in tasks:
                await flow.worker_state(task, "running")
                await flow.defer(task)
            for task in tasks[:20]:
                await flow.fire(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in tasks[:20]))

            b = Scheduler(settings, state_dir=tmp_path / "b", **options)
            await b.start()
            await until(
                lambda: b is not None and b.ready and b.owned and not set(a.owned) & set(b.owned),
                within=60,
                interval=0.02,
            )
            await until(
                lambda: len(a.owned) + len(b.owned) == settings.partitions, within=60, interval=0.02
            )
            assert b.standby is not None
            taken = set(b.owned)
            assert b.standby.handed == len(taken & holding)
            written = await _records_on(settings, taken)
            assert b.recovered_records < written / 4, "only the tail was folded"
            assert set(b.standby.partitions) == set(range(settings.partitions)) - taken
            assert set(a.standby.partitions) == taken, "a released partition is followed again"

            for task in tasks[20:40]:
                await flow.fire(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in tasks[:40]))
            await _settled(a, b)
            assert {**a.table.snapshot(), **b.table.snapshot()} == await _cold_fold(settings)

            # a leaves: b takes its partitions over from its standby tables.
            handed = b.standby.handed
            folded = b.recovered_records
            await a.stop()
            await until(
                lambda: b is not None and len(b.owned) == settings.partitions,
                within=60,
                interval=0.02,
            )
            assert b.standby.handed - handed == len(
                (set(range(settings.partitions)) - taken) & holding
            )
            assert (
                b.recovered_records - folded
                < (await _records_on(settings, set(range(settings.partitions)) - taken)) / 4
            )
            assert b.standby.partitions == []
            for task in tasks[40:50]:
                await flow.fire(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in tasks[:50]))

            # c comes and goes: b lets a share go and takes it back (its third acquisition,
            # with the same takeover reader).
            c = Scheduler(settings, state_dir=tmp_path / "c", **options)
            await c.start()
            try:
                await until(
                    lambda: c.ready and c.owned and not set(b.owned) & set(c.owned),
                    within=60,
                    interval=0.02,
                )
            finally:
                await c.stop()
            await until(
                lambda: b is not None and len(b.owned) == settings.partitions,
                within=60,
                interval=0.02,
            )
            for task in tasks[50:]:
                await flow.fire(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in tasks))
            await _settled(b)
            assert b.table.snapshot() == await _cold_fold(settings)
            for task in tasks:
                assert len(flow.runs_of(task, "start")) == 1, task
                assert len(flow.runs_of(task, "resume")) == 1, task
        finally:
            await a.stop()
            if b is not None:
                await b.stop()
