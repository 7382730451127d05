"""The scheduler's local checkpoint on a real broker: a restart folds only the tasks topic's
tail and resumes every task exactly once; a checkpoint of another log (a recreated topic, a
recreated cluster with the same topic names) is discarded, even where its positions fall
inside the new topic's range."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from deferline.runners.member import MemberCheckpoint, RocksPartitionDatabase
from deferline.runners.scheduler import Scheduler
from deferline.topics import Settings, TopicNames, make_consumer, partition_for, stop_client

from tests._until import until

from ._clusters import another_cluster, delete_topic, end_offsets
from ._taskflow import TaskFlow, task_key
from .test_scheduler import FAST, barrier

pytestmark = pytest.mark.integration


def _saved_positions(settings: Settings, path: Path) -> dict[int, int]:
    """The positions of every tasks partition's checkpoint under ``path``."""
    topic = TopicNames(settings.topic_prefix).tasks
    positions: dict[int, int] = {}
    for partition in range(settings.partitions):
        db = RocksPartitionDatabase(path / topic / str(partition))
        store = MemberCheckpoint(db, topic=topic, partition=partition)
        try:
            saved = store.header()
            assert saved is not None, f"no checkpoint was written for partition {partition}"
            positions[partition] = saved.position
        finally:
            store.close()
    return positions


async def _records_after(settings: Settings, positions: dict[int, int]) -> int:
    """Records on the tasks topic from ``positions`` to its end (transaction markers take
    offsets but are no records, so offsets alone do not count them)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        topic = TopicNames(settings.topic_prefix).tasks
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, positions[tp.partition])
        ends = await consumer.end_offsets(tps)
        count = 0
        while True:
            positions = {tp: await consumer.position(tp) for tp in tps}
            if all(positions[tp] >= ends[tp] for tp in tps):
                return count
            batches = await consumer.getmany(timeout_ms=200)
            count += sum(len(messages) for messages in batches.values())
    finally:
        await stop_client(consumer, grace=10.0, name="test consumer")


@pytest.mark.parametrize("standby", [False, True], ids=["plain", "standby"])
async def test_restart_from_a_checkpoint_reads_only_the_tail(
    settings: Settings, tmp_path: Path, standby: bool
) -> None:
    """With a standby too: it does not fold the partitions this host holds a checkpoint of
    before joining, and a lone scheduler restores them all, as it does without one."""
    state: dict[str, Any] = {"state_dir": tmp_path / "state", "checkpoint_interval": 0.2}
    old = [task_key(f"old{n}") for n in range(12)]
    new = [task_key(f"new{n}") for n in range(3)]
    async with TaskFlow(settings) as flow:
        async with Scheduler(settings, **state, **FAST) as first:
            await first.wait_active()
            for task in old:
                await flow.submit(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "start") for t in old))
            for task in old:
                await flow.worker_state(task, "running")
                await flow.defer(task)
            for task in old[:6]:
                await flow.fire(task)
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in old[:6]))
            await until(
                lambda: sum(r.state == "deferred" for r in first.table.snapshot().values()) == 6,
                within=20,
                interval=0.02,
            )
            # A checkpoint is written only at a consistent point (nothing folded and unsent):
            # wait for one holding every task, since a busy stop keeps the last periodic one.
            await until(lambda: _checkpointed_at_reader(first), within=30, interval=0.02)
        # Stopped cleanly: the last checkpoint holds the fold up to these positions.
        saved = _saved_positions(settings, state["state_dir"])
        for task in new:  # written while no scheduler runs
            await flow.submit(task)
        for task in old[6:]:
            await flow.fire(task)
        tail = await _records_after(settings, saved)
        assert tail >= len(new)
        async with Scheduler(settings, **state, standby=standby, **FAST) as second:
            await second.wait_active()
            assert second.restored_tasks == len(old)
            assert second.recovered_records == tail
            if second.standby is not None:
                assert second.standby.records == 0, "nothing folded from the start"
                assert second.standby.handed == 0
                assert second.standby.partitions == [], "it owns every partition"
            await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in old))
            await flow.wait_for(lambda: all(flow.runs_of(t, "start") for t in new))
            await barrier(flow, second)
            for task in old:
                assert len(flow.runs_of(task, "start")) == 1, task
                assert len(flow.runs_of(task, "resume")) == 1, task
            for task in new:
                assert len(flow.runs_of(task, "start")) == 1, task
            assert {r.state for k, r in second.table.snapshot().items() if "old" in k} == {"queued"}


async def test_a_checkpoint_of_a_recreated_topic_is_discarded(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state: dict[str, Any] = {"state_dir": tmp_path / "state", "checkpoint_interval": 0.2}
    names = TopicNames(settings.topic_prefix)
    assert sum((await _checkpoint_deferred_tasks(settings, state)).values()) >= 4 * 6
    await delete_topic(settings, names.tasks)
    x = task_key("x")
    async with TaskFlow(settings) as flow:  # creates the tasks topic again
        await flow.submit(x)
        with caplog.at_level(logging.WARNING):
            async with Scheduler(settings, **state, **FAST) as second:
                await second.wait_active()
                assert second.restored_tasks == 0
                assert second.recovered_records == 1
                assert list(second.table) == [x.ti_key]
                await flow.wait_for(lambda: flow.runs_of(x, "start"))
                # Stop only once the resume topics are read: a stop while the takeover is
                # still starting that consumer can leave its bootstrap connection open.
                await barrier(flow, second)
        assert any("checkpoint discarded" in r.getMessage() for r in caplog.records)


async def _checkpoint_deferred_tasks(settings: Settings, state: dict[str, Any]) -> dict[int, int]:
    """Run a scheduler that sees 6 tasks deferred, stop it; the positions it saved."""
    old = [task_key(f"a{n}") for n in range(6)]
    async with TaskFlow(settings) as flow, Scheduler(settings, **state, **FAST) as first:
        await first.wait_active()
        for task in old:
            await flow.submit(task)
        await flow.wait_for(lambda: all(flow.runs_of(t, "start") for t in old))
        for task in old:
            await flow.worker_state(task, "running")
            await flow.defer(task)
        await until(
            lambda: all(getattr(first.table.get(t.ti_key), "state", "") == "deferred" for t in old),
            within=20,
            interval=0.02,
        )
    return _saved_positions(settings, state["state_dir"])


async def _resume_all_past(
    settings: Settings,
    state: dict[str, Any],
    saved: dict[int, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a log that is not the checkpoint's, with every tasks partition longer than the
    saved positions: the checkpoint is discarded (one line naming the mismatch) and all the
    new log's deferred tasks resume."""
    tasks = [task_key(f"b{n}") for n in range(60)]
    async with TaskFlow(settings) as flow:
        for task in tasks:
            await flow.submit(task)
            await flow.worker_state(task, "running")
            await flow.defer(task)
        ends = await end_offsets(settings, flow.names.tasks)
        assert all(ends[p] > offset for p, offset in saved.items()), (ends, saved)
        with caplog.at_level(logging.WARNING):
            async with Scheduler(settings, **state, **FAST) as second:
                await second.wait_active()
                assert second.restored_tasks == 0
                assert second.checkpoint_mismatches == len(saved), "one per partition"
                for task in tasks:
                    await flow.fire(task)
                await flow.wait_for(lambda: all(flow.runs_of(t, "resume") for t in tasks))
                await barrier(flow, second)
                assert second.table.counters.events_orphaned == 0
        lines = [
            r.getMessage() for r in caplog.records if "read from another log" in r.getMessage()
        ]
        assert len(lines) == 1, lines
        assert "topic id of" in lines[0] or "cluster id" in lines[0]


@pytest.mark.brokers_differ(
    "checkpoints are told apart by cluster id on Kafka, by topic id on Tansu"
)
async def test_a_checkpoint_of_another_cluster_with_the_same_names_is_discarded(
    settings: Settings, broker_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state: dict[str, Any] = {"state_dir": tmp_path / "state", "checkpoint_interval": 0.2}
    saved = await _checkpoint_deferred_tasks(settings, state)
    async with another_cluster(broker_backend, settings) as cluster_b:
        await _resume_all_past(cluster_b, state, saved, caplog)


async def test_a_checkpoint_of_a_recreated_topic_longer_than_it_is_discarded(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state: dict[str, Any] = {"state_dir": tmp_path / "state", "checkpoint_interval": 0.2}
    saved = await _checkpoint_deferred_tasks(settings, state)
    await delete_topic(settings, TopicNames(settings.topic_prefix).tasks)
    await _resume_all_past(settings, state, saved, caplog)


async def test_two_schedulers_share_one_state_directory(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two schedulers of one group on one host, one state directory (as the default gives
    them): the second takes half the partitions, each partition's database used by the
    process that holds it (one still held by the first while it lets go is folded from the
    topic), and the second takes every partition over when the first stops."""
    state: dict[str, Any] = {"state_dir": tmp_path / "state", "checkpoint_interval": 0.2}
    a, b = task_key("a"), task_key("b")
    everything = set(range(settings.partitions))
    async with TaskFlow(settings) as flow, Scheduler(settings, **state, **FAST) as first:
        await first.wait_active()
        await flow.submit(a)
        await flow.wait_for(lambda: flow.runs_of(a, "start"))
        with caplog.at_level(logging.INFO):
            second = Scheduler(settings, **state, **FAST)
            async with second:
                await until(
                    lambda: (
                        second.ready
                        and len(first.owned) + len(second.owned) == len(everything)
                        and set(first.owned) | set(second.owned) == everything
                        and len(second.owned) == len(everything) // 2
                    ),
                    within=20,
                    interval=0.02,
                )
                held = {
                    r.args[0]  # type: ignore[index]
                    for r in caplog.records
                    if "folds from the topic" in r.getMessage() and r.args
                }
                checkpoints = second.checkpoints
                assert checkpoints is not None
                assert set(second.owned) <= set(checkpoints._stores) | held
                assert not set(first.owned) & set(checkpoints._stores), "none of the first's"
                owner = (
                    first
                    if partition_for(a.ti_key.encode(), settings.partitions) in (first.owned)
                    else second
                )
                assert owner.table.get(a.ti_key) is not None
                other = second if owner is first else first
                assert other.table.get(a.ti_key) is None, "each folds only its partitions"
                await first.stop()
                await until(lambda: set(second.owned) == everything, within=20, interval=0.02)
                await flow.submit(b)
                await flow.wait_for(lambda: flow.runs_of(b, "start"))
                await barrier(flow, second)
                assert len(flow.runs_of(a, "start")) == 1
                assert second.table.get(a.ti_key) is not None


def _checkpointed_at_reader(scheduler: Scheduler) -> bool:
    """Has a checkpoint been written at the tasks reader's current positions?"""
    reader, checkpoints = scheduler.clients.reader, scheduler.checkpoints
    return (
        reader is not None
        and checkpoints is not None
        and checkpoints._saved == reader.partition_positions()
    )
