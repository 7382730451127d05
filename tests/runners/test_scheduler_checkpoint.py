"""The scheduler's checkpoints and options without a broker: atomic rows and header, one
database per tasks partition each held by one process, a default directory per scheduler
group, a table cut by partition and restored whole."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner
from deferline.engine import Emit, TaskTable
from deferline.runners.member import (
    ROW_PREFIX,
    CheckpointUnusable,
    MemberCheckpoint,
    RocksPartitionDatabase,
)
from deferline.runners.scheduler import Scheduler, scheduler_command
from deferline.runners.scheduler.testing import Checkpoints
from deferline.runners.testing import CheckpointError, CheckpointInUse
from deferline.schemas import ResumeTarget, TaskKey, TaskStateRecord
from deferline.topics import LogIdentity, Settings, TopicIdentity

IDENTITY = LogIdentity(
    cluster_id="c1",
    topics=(TopicIdentity("p.tasks", "0193e0a4-0000-7000-8000-000000000001", 2),),
    prefix="p.",
    group="p.scheduler",
)


def _table(n: int) -> TaskTable:
    table = TaskTable()
    table.track_changes()
    for i in range(n):
        task = TaskKey(dag_id="d", task_id=f"t{i}", run_id="r")
        record = TaskStateRecord(
            task=task, state="scheduled", source="client", resume=ResumeTarget(operator="p.Op")
        )
        table.apply(record)
    return table


def _checkpoint(path: Path, partition: int = 0) -> MemberCheckpoint:
    db = RocksPartitionDatabase(path)
    return MemberCheckpoint(db, topic="p.tasks", partition=partition)


def _write(store: MemberCheckpoint, position: int, table: TaskTable) -> None:
    rows = table.export_changes().encode()
    changes = [*((key, None) for key in rows.deletes), *rows.rows]
    store.write(changes, position=position, payload={"state": rows.state}, identity=IDENTITY)


def test_rows_and_positions_are_stored_together_and_restored(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path / "ckpt")
    table = _table(3)
    _write(store, 5, table)
    table.forget("d/t1/r/-1")
    _write(store, 6, table)
    store.close()
    store = _checkpoint(tmp_path / "ckpt")
    saved = store.header(IDENTITY)
    assert saved is not None
    assert (saved.topic, saved.partition, saved.position, saved.identity) == (
        "p.tasks",
        0,
        6,
        IDENTITY,
    )
    restored = TaskTable()
    assert restored.restore_rows(store.rows(), saved.payload["state"], skip=len(ROW_PREFIX)) == 2
    assert restored.snapshot() == table.snapshot()
    store.discard()
    assert store.header() is None
    assert list(store.rows()) == []
    store.close()


def test_a_checkpoint_of_another_format_is_refused(tmp_path: Path) -> None:
    older = RocksPartitionDatabase(tmp_path / "ckpt")
    older.write([], {"format": 3, "topic": "p.tasks", "positions": {"0": 4}, "state": {}})
    older.close()
    store = _checkpoint(tmp_path / "ckpt")
    try:
        with pytest.raises(CheckpointUnusable, match="of format 3, this version reads 4"):
            store.header()
    finally:
        store.close()


def test_a_partition_held_by_another_process_is_left_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = Checkpoints(tmp_path, interval=1.0, max_age=3600.0)
    first.open("p.tasks", [0], total=2)
    second = Checkpoints(tmp_path, interval=1.0, max_age=3600.0)
    try:
        with pytest.raises(CheckpointInUse, match="in use by another process"):
            RocksPartitionDatabase(first.path("p.tasks", 0))
        with caplog.at_level(logging.INFO):
            second.open("p.tasks", [0, 1], total=2)
        assert sorted(second._stores) == [1], "partition 0 is the first one's"
        assert "tasks partition 0 folds from the topic" in caplog.text
        first.close()
        third = Checkpoints(tmp_path, interval=1.0, max_age=3600.0)
        third.open("p.tasks", [0, 1], total=2)
        assert sorted(third._stores) == [0], "released by the first, partition 1 still held"
        third.close()
    finally:
        first.close()
        second.close()


def test_command_line_state_dir_per_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made: list[dict[str, Any]] = []

    class Recorded:
        def __init__(self, settings: Settings, **options: Any) -> None:
            made.append(options)

    async def serve(build: Callable[[], object], *served: object) -> None:
        build()  # the process builds its scheduler (again after a lost cluster)

    # The command imports Scheduler from its module when run, and serves through _serve.
    monkeypatch.setattr("deferline.runners.scheduler._scheduler.Scheduler", Recorded)
    monkeypatch.setattr("deferline.runners.scheduler._cli._serve", serve)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    runner = CliRunner()
    for args in ([], ["--group-id", "g2"], ["--no-checkpoint"], ["--state-dir", "elsewhere"]):
        result = runner.invoke(scheduler_command, [*args, "--topic-prefix", "x."])
        assert result.exit_code == 0, result.output
    assert [m["state_dir"] for m in made] == [
        tmp_path / "deferline" / "scheduler" / "x.scheduler",
        tmp_path / "deferline" / "scheduler" / "g2",
        None,
        Path("elsewhere"),
    ]


class FlakyStore:
    """A checkpoint store whose writes fail until told otherwise."""

    def __init__(self) -> None:
        self.fail = True
        self.written: list[tuple[dict[int, int], int]] = []

    def write(
        self,
        changes: Iterable[tuple[bytes, bytes | None]],
        *,
        position: int,
        payload: Mapping[str, Any],
        identity: LogIdentity | None,
    ) -> None:
        if self.fail:
            raise CheckpointError("disk full")
        self.written.append(({0: position}, sum(value is not None for _, value in changes)))


class StillReader:
    """A tasks reader waiting between two fetches at position 3 of partition 0."""

    tps = [TopicPartition("p.tasks", 0)]
    idle = True

    def partition_positions(self) -> dict[int, int]:
        return {0: 3}


def _scheduler_between_fetches(tmp_path: Path) -> tuple[Scheduler, FlakyStore, Any]:
    sched = Scheduler(
        Settings(bootstrap_servers="127.0.0.1:1"), state_dir=tmp_path, checkpoint_interval=0.0
    )
    store = FlakyStore()
    assert sched.checkpoints is not None
    sched.checkpoints._stores = {0: store}  # type: ignore[dict-item]
    sched.checkpoints._topic, sched.checkpoints._partitions = "p.tasks", 1
    sched.fold.table = _table(2)
    sched.router.partitions = 1
    sched.writers.add(0)
    sched.ownership.assign({0})
    sched.ownership.acquired(0)
    return sched, store, StillReader()


def test_a_failed_write_is_retried_with_the_next_checkpoint(tmp_path: Path) -> None:
    sched, store, reader = _scheduler_between_fetches(tmp_path)
    asyncio.run(sched.checkpointer.maybe(reader))
    assert store.written == []
    store.fail = False
    asyncio.run(sched.checkpointer.maybe(reader))
    assert store.written == [({0: 3}, 2)], "the failed write's tasks go with the next one"
    asyncio.run(sched.checkpointer.maybe(reader))
    assert len(store.written) == 1, "nothing changed, nothing written"


def test_no_checkpoint_while_decisions_are_unsent_or_after_a_failed_publish(
    tmp_path: Path,
) -> None:
    sched, store, reader = _scheduler_between_fetches(tmp_path)
    checkpoints = sched.checkpoints
    assert checkpoints is not None
    store.fail = False
    sched.table._outbox.append(Emit(state_record()))
    assert sched.checkpointer.capture(reader) is None, "decided, not yet published"
    sched.table._outbox.clear()
    sched.writers[0].held.out.append(Emit(state_record()))
    assert sched.checkpointer.capture(reader) is None, (
        "decided, held while the partition is quiesced"
    )
    sched.writers[0].held.out.clear()

    async def while_publishing() -> object:
        async with sched.writers.lock:
            return sched.checkpointer.capture(reader)

    assert asyncio.run(while_publishing()) is None, "a batch is being published"

    async def while_sending(outcome: BaseException | None) -> tuple[object, object]:
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def send() -> None:
            await sent

        sched.writers[0].chain.in_flight = in_flight = asyncio.create_task(send())
        on_its_way = sched.checkpointer.capture(reader)
        if outcome is None:
            sent.set_result(None)
        else:
            sent.set_exception(outcome)
        await asyncio.wait({in_flight})
        return on_its_way, sched.checkpointer.capture(reader)

    on_its_way, acked = asyncio.run(while_sending(None))
    assert on_its_way is None, "a batch handed to the producer is not acknowledged yet"
    assert acked is not None, "acknowledged: the table is of its positions again"
    checkpoints._saved = {}  # capture again from scratch
    on_its_way, failed = asyncio.run(while_sending(OSError("broker gone")))
    assert on_its_way is None
    assert failed is None, "a batch that failed may have left the table ahead of the topic"
    sched.writers[0].chain.in_flight = None
    checkpoints.off = True
    assert sched.checkpointer.capture(reader) is None
    checkpoints.off = False
    assert sched.checkpointer.capture(reader) is not None


def state_record() -> TaskStateRecord:
    return TaskStateRecord(task=TaskKey(dag_id="d", task_id="t0", run_id="r"), state="queued")


def test_an_attempt_that_finds_no_consistent_point_waits_a_whole_interval(
    tmp_path: Path,
) -> None:
    sched, store, reader = _scheduler_between_fetches(tmp_path)
    checkpoints = sched.checkpoints
    assert checkpoints is not None
    store.fail = False
    checkpoints.interval = 60.0
    sched.table._outbox.append(Emit(state_record()))  # decided, not yet published
    assert checkpoints.due()
    asyncio.run(sched.checkpointer.maybe(reader))
    assert store.written == []
    assert not checkpoints.due(), "not tried again at every fetch until the next interval"
