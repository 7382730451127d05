"""The scheduler runner without a broker: routing, publish order, commits, bad input, CLI."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner
from deferline.engine import Emit, Pools
from deferline.runners import scheduler as scheduler_module
from deferline.runners.scheduler import Scheduler, scheduler_command
from deferline.schemas import (
    CancelRequest,
    DeadLetter,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.topics import Settings
from prometheus_client import generate_latest

TASK = TaskKey(dag_id="d", task_id="t", run_id="r")
TPS = TopicPartition("p.resume", 0)


class FakeProducer:
    """Records sends and acks in one log; acks land one loop turn after the send."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, bytes | None]] = []

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None
    ) -> asyncio.Future[None]:
        self.log.append(("send", topic, key))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ack() -> None:
            self.log.append(("ack", topic, key))
            future.set_result(None)

        asyncio.get_running_loop().call_soon(ack)
        return future


@pytest.fixture
def sched(monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    ensured: list[Any] = []

    async def fake_ensure(settings: Settings, specs: Any) -> None:
        ensured.append([spec.name for spec in specs])

    monkeypatch.setattr(scheduler_module, "ensure_topics", fake_ensure)
    scheduler = Scheduler(Settings(topic_prefix="p."), pools=Pools(slots={"default_pool": 1}))
    scheduler._producer = FakeProducer()
    scheduler.ensured = ensured  # type: ignore[attr-defined]
    return scheduler


def state(record_state: Any = "scheduled", **fields: Any) -> TaskStateRecord:
    fields.setdefault("resume", ResumeTarget(operator="x.Op", worker_queue="gpu"))
    fields.setdefault("source", "client")
    return TaskStateRecord(task=TASK, state=record_state, **fields)


def fired(**fields: Any) -> TriggerEventRecord:
    trigger_id = make_trigger_id(TASK, 0)
    return TriggerEventRecord(
        event_id=make_event_id(trigger_id, "fired", None),
        trigger_id=trigger_id,
        task=TASK,
        status="fired",
        **fields,
    )


async def test_publish_routes_each_record_and_acks_states_before_runs(sched: Scheduler) -> None:
    cancel = CancelRequest(trigger_id="tid", task=TASK)
    start = RunTask(task=TASK, mode="start", operator="x.Op", worker_queue="gpu")
    resume = RunTask(task=TASK, mode="resume", operator="x.Op")
    letter = DeadLetter(topic="p.tasks", partition=0, offset=3, error="bad", error_type="E")
    await sched._publish(
        [Emit(state("queued")), Emit(start), Emit(resume), Emit(cancel, queue="slow")], [letter]
    )
    log = sched._producer.log  # type: ignore[union-attr]
    ti = TASK.ti_key.encode()
    assert log[:2] == [("send", "p.defer.slow", b"tid"), ("ack", "p.defer.slow", b"tid")]
    assert log[2:6] == [
        ("send", "p.tasks", ti),
        ("send", "p.dead", None),
        ("ack", "p.tasks", ti),
        ("ack", "p.dead", None),
    ], "task states (and dead letters) are acknowledged before any run is sent"
    assert [entry for entry in log[6:] if entry[0] == "send"] == [
        ("send", "p.queue.gpu", ti),
        ("send", "p.queue.resumes", ti),
    ]
    assert sched.published == 5
    await sched._publish([Emit(start)])
    ensured = [name for names in sched.ensured for name in names]  # type: ignore[attr-defined]
    assert ensured.count("p.queue.gpu") == 1, "a new worker queue's topics are created once"


async def test_decisions_of_a_folded_record_are_published(sched: Scheduler) -> None:
    assert sched._fold_task(TASK.ti_key.encode(), encode(state()), live=True) is None
    await sched._publish(sched.table.drain())
    log = sched._producer.log  # type: ignore[union-attr]
    sends = [(topic, key) for kind, topic, key in log if kind == "send"]
    assert sends == [("p.tasks", TASK.ti_key.encode()), ("p.queue.gpu", TASK.ti_key.encode())]


def test_bad_task_records_are_dead_lettered_only_when_read_live(sched: Scheduler) -> None:
    assert sched._fold_task(b"k", b"{not json", live=True) is not None
    assert sched._fold_task(b"k", b"{not json", live=False) is None
    wrong_kind = encode(fired())
    error = sched._fold_task(b"k", wrong_kind, live=True)
    assert error is not None
    assert "task_state" in error
    assert sched.bad_records == 3
    assert len(sched.table) == 0


def test_bad_events_are_reported_and_never_folded(sched: Scheduler) -> None:
    assert sched._fold_event(encode(state()), ref=(TPS, 0)) is not None
    assert sched._fold_event(b"[]", ref=(TPS, 1)) is not None
    assert sched._fold_event(None, ref=(TPS, 2)) is None
    assert sched.table.pending_events == 0


def test_tombstone_forgets_the_task_and_frees_its_slot(sched: Scheduler) -> None:
    sched._fold_task(b"k", encode(state()), live=False)
    sched.table.drain()
    assert sched.table.pool_usage()["default_pool"] == (1, 1)
    sched._fold_task(TASK.ti_key.encode(), None, live=False)
    assert TASK.ti_key not in sched.table
    assert sched.table.pool_usage()["default_pool"] == (0, 1)


def test_commits_stop_at_the_first_pending_event(sched: Scheduler) -> None:
    other = TopicPartition("p.resume", 1)
    sched._events_done = {TPS: 10, other: 4}
    sched._fold_event(encode(fired()), ref=(TPS, 6))
    assert sched.table.pending_events == 1
    assert sched._committable() == {TPS: 6, other: 4}
    sched._committed.update(sched._committable())
    assert sched._committable() == {}, "nothing moved since"
    # The deferral arrives: the event applies and the partition can commit past it.
    deferred = state(
        "deferred", trigger_id=make_trigger_id(TASK, 0), next_method="done", source="worker"
    )
    sched._fold_task(b"k", encode(deferred), live=True)
    assert sched.table.pending_events == 0
    assert sched._committable() == {TPS: 10}


def test_metrics_are_read_from_the_table(sched: Scheduler) -> None:
    sched._fold_task(b"k", encode(state()), live=True)
    sched.table.drain()
    sched.lag["events"] = 7
    text = generate_latest(sched.registry).decode()
    assert 'deferline_scheduler_runs_enqueued_total{mode="start"} 1.0' in text
    assert 'deferline_scheduler_pool_slots_used{pool="default_pool"} 1.0' in text
    assert 'deferline_scheduler_pool_slots{pool="default_pool"} 1.0' in text
    assert 'deferline_scheduler_tasks{state="queued"} 1.0' in text
    assert 'deferline_scheduler_lag{input="events"} 7.0' in text
    assert "deferline_scheduler_duplicates_dropped_total 0.0" in text


def test_scheduler_decodes_what_it_encodes() -> None:
    record = state("queued")
    assert decode(encode(record)) == record


def test_command_line() -> None:
    runner = CliRunner()
    result = runner.invoke(scheduler_command, ["--help"])
    assert result.exit_code == 0
    assert "--pool NAME=SLOTS" in result.output
    result = runner.invoke(scheduler_command, ["--pool", "gpu"])
    assert result.exit_code == 2
    assert "expected NAME=SLOTS" in result.output
    result = runner.invoke(scheduler_command, ["--default-pool-slots", "lots"])
    assert result.exit_code == 2
    assert "'unlimited'" in result.output
    assert scheduler_module._parse_pools(["a=1", "b=20"]) == {"a": 1, "b": 20}
