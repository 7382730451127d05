"""The task state machine and dedup fold: transitions, pending events, pools, replay."""

from __future__ import annotations

import datetime as dt
import random
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

from deferline.engine import FAIL_METHOD, Emit, Pools, TaskTable, progress
from deferline.schemas import (
    CancelRequest,
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
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def key(n: int = 1, try_number: int = 1) -> TaskKey:
    return TaskKey(dag_id="dag", task_id=f"t{n}", run_id="r1", try_number=try_number)


def target(**overrides: Any) -> ResumeTarget:
    return ResumeTarget(operator="pkg.mod.Op", op_kwargs={"x": 1}, **overrides)


def scheduled(task: TaskKey, when: float = 0, **overrides: Any) -> TaskStateRecord:
    fields: dict[str, Any] = {"resume": target(), "source": "client", "updated_at": at(when)}
    fields.update(overrides)
    return TaskStateRecord(task=task, state="scheduled", **fields)


def worker(task: TaskKey, state: Any, when: float = 0, **fields: Any) -> TaskStateRecord:
    return TaskStateRecord(task=task, state=state, source="worker", updated_at=at(when), **fields)


def deferred(task: TaskKey, seq: int = 0, when: float = 0, **fields: Any) -> TaskStateRecord:
    values: dict[str, Any] = {
        "trigger_id": make_trigger_id(task, seq),
        "defer_seq": seq,
        "next_method": "execute_complete",
        "next_kwargs": {"step": seq},
        "queue": None,
    }
    values.update(fields)
    return worker(task, "deferred", when, **values)


def event(
    task: TaskKey, seq: int = 0, status: Any = "fired", when: float = 1, **fields: Any
) -> TriggerEventRecord:
    trigger_id = make_trigger_id(task, seq)
    payload = fields.pop("payload", {"seq": seq})
    return TriggerEventRecord(
        event_id=make_event_id(trigger_id, status, payload),
        trigger_id=trigger_id,
        task=task,
        defer_seq=seq,
        status=status,
        payload=payload,
        emitted_at=at(when),
        **fields,
    )


def states(out: list[Emit]) -> list[TaskStateRecord]:
    return [e.record for e in out if isinstance(e.record, TaskStateRecord)]


def runs(out: list[Emit]) -> list[RunTask]:
    return [e.record for e in out if isinstance(e.record, RunTask)]


def feed(table: TaskTable, *records: TaskStateRecord | TriggerEventRecord) -> list[Emit]:
    out: list[Emit] = []
    for record in records:
        table.apply(record)
        out.extend(table.drain())
    return out


def echo(table: TaskTable, out: list[Emit]) -> None:
    """Read back the table's own TaskStateRecords, as the tasks topic would deliver them."""
    for record in states(out):
        assert table.apply(record) == "echo"


def deferred_task(table: TaskTable, task: TaskKey, seq: int = 0, **fields: Any) -> list[Emit]:
    """Bring a task to ``deferred`` through a start, with the table's echoes read back."""
    resume = fields.pop("resume", target())
    out = feed(table, scheduled(task, resume=resume))
    echo(table, out)
    return feed(table, worker(task, "running", 0.5), deferred(task, seq, 0.6, **fields))


# -- transitions ---------------------------------------------------------------------------


def test_scheduled_task_is_queued_with_a_start_runtask() -> None:
    table = TaskTable()
    task = key()
    out = feed(table, scheduled(task, 3))
    [state] = states(out)
    [run] = runs(out)
    assert state.state == "queued"
    assert state.source == "scheduler"
    assert state.resume == target()
    assert run.mode == "start"
    assert run.operator == "pkg.mod.Op"
    assert run.op_kwargs == {"x": 1}
    assert run.task == task
    assert run.worker_queue == "default"
    assert out.index(Emit(state)) < out.index(Emit(run)), "state is published before the run"
    assert table.apply(state) == "echo"
    assert table.get(task.ti_key) == state
    assert table.counters.starts == 1


def test_fired_event_resumes_with_next_method_kwargs_and_event() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    assert table.get(task.ti_key).state == "deferred"  # type: ignore[union-attr]
    ev = event(task, payload={"ok": True}, when=5)
    assert table.apply(ev) == "applied"
    out = table.drain()
    [state] = states(out)
    [run] = runs(out)
    assert state.state == "queued"
    assert state.next_method == "execute_complete"
    assert state.next_kwargs == {"step": 0}
    assert state.event == {"ok": True}
    assert state.event_id == ev.event_id
    assert state.trigger_id == ev.trigger_id
    assert state.updated_at == at(5), "time comes from the event, never the clock"
    assert run.mode == "resume"
    assert run.next_method == "execute_complete"
    assert run.next_kwargs == {"step": 0}
    assert run.event == {"ok": True}
    assert run.trigger_id == ev.trigger_id
    assert run.defer_seq == 0
    assert run.event_id == ev.event_id
    assert table.counters.events_applied == 1
    assert table.counters.resumes == 1


def test_duplicate_event_is_counted_and_never_applied() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    ev = event(task)
    table.apply(ev)
    first = table.drain()
    echo(table, first)
    assert table.apply(ev) == "duplicate"
    assert table.apply(event(task, payload={"other": 1})) == "duplicate"
    assert table.drain() == []
    assert table.counters.events_duplicate == 2
    assert table.counters.events_applied == 1


def _rebuilt_after_a_kill_between_waves(task: TaskKey) -> tuple[TaskTable, TriggerEventRecord]:
    """A new leader's table: the old one wrote ``queued`` for the event, maybe no RunTask."""
    old = TaskTable()
    deferred_task(old, task)
    ev = event(task)
    old.apply(ev)
    queued = states(old.drain())  # the state wave landed; the RunTask wave maybe not
    new = TaskTable()
    deferred_task(new, task)
    for record in queued:
        assert new.apply(record) == "applied"
    assert new.drain() == []
    return new, ev


def test_an_event_reread_after_a_takeover_resends_the_runtask_of_a_task_queued_on_it() -> None:
    task = key()
    table, ev = _rebuilt_after_a_kill_between_waves(task)
    assert table.apply(ev) == "duplicate", "a plain re-read (or a trigger run twice) sends nothing"
    assert table.drain() == []
    before = table.snapshot()
    assert table.apply(ev, resend=True) == "resent"
    out = table.drain()
    assert states(out) == [], "the state is not written again"
    [run] = runs(out)
    original = TaskTable()
    deferred_task(original, task)
    original.apply(ev)
    assert run == runs(original.drain())[0], "the same RunTask the dead leader meant to send"
    assert table.snapshot() == before
    assert table.counters.resends == 1
    assert table.counters.events_duplicate == 1
    assert table.counters.events_applied == 0


def test_no_resend_once_the_worker_moved_on_or_for_another_event() -> None:
    task = key()
    table, ev = _rebuilt_after_a_kill_between_waves(task)
    other = event(task, payload={"other": 1})
    assert table.apply(other, resend=True) == "duplicate", "queued on another event"
    assert table.apply(worker(task, "running", 2, trigger_id=ev.trigger_id)) == "applied"
    assert table.apply(ev, resend=True) == "duplicate", "the RunTask reached a worker"
    assert runs(table.drain()) == []
    assert table.counters.resends == 0


def test_no_resend_for_a_direct_resume() -> None:
    task = key()
    table = TaskTable()
    deferred_task(table, task)
    ev = event(task, resumed_directly=True)
    table.apply(ev)
    assert runs(table.drain()) == [], "the triggerer sent the RunTask itself"
    assert table.apply(ev, resend=True) != "resent"
    assert runs(table.drain()) == []


def test_event_for_a_finished_task_is_a_duplicate() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    table.apply(event(task))
    table.drain()
    feed(table, worker(task, "success", 9))
    assert table.apply(event(task)) == "duplicate"
    assert table.drain() == []


def test_event_with_another_try_or_defer_seq_does_not_apply() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task, seq=1)
    assert table.apply(event(task, seq=0)) == "duplicate"
    assert table.apply(event(key(try_number=0), seq=1)) == "duplicate"
    assert table.get(task.ti_key).state == "deferred"  # type: ignore[union-attr]


def test_event_before_its_deferral_is_held_then_applied() -> None:
    table = TaskTable()
    task = key()
    out = feed(table, scheduled(task))
    echo(table, out)
    ev = event(task)
    assert table.apply(ev, ref=("resume", 0, 7)) == "pending"
    assert table.pending_events == 1
    assert list(table.pending_refs()) == [("resume", 0, 7)]
    assert table.drain() == []
    table.apply(worker(task, "running"))
    table.apply(deferred(task))
    out = table.drain()
    assert [s.state for s in states(out)] == ["queued"]
    assert [r.mode for r in runs(out)] == ["resume"]
    assert table.pending_events == 0
    assert table.counters.events_applied == 1


def test_unknown_task_event_is_pending_until_expired_as_orphan() -> None:
    table = TaskTable()
    task = key()
    assert table.apply(event(task)) == "pending"
    gen = table.mark_generation()
    assert table.apply(event(key(2))) == "pending"
    [(orphan, ref)] = table.expire_pending(gen)
    assert orphan.task == task
    assert ref is None
    assert table.pending_events == 1
    assert table.counters.events_orphaned == 1
    assert table.get(task.ti_key) is None


def test_pending_duplicates_resolve_to_one_application() -> None:
    table = TaskTable()
    task = key()
    table.apply(event(task))
    table.apply(event(task))
    out = deferred_task(table, task)
    assert len(runs(out)) == 1
    assert table.counters.events_applied == 1
    assert table.counters.events_duplicate == 1
    assert table.pending_events == 0


def test_timed_out_event_resumes_into_fail() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    table.apply(event(task, status="timed_out", payload=None))
    out = table.drain()
    [state] = states(out)
    [run] = runs(out)
    assert state.state == "queued"
    assert state.next_method == FAIL_METHOD
    assert run.next_method == FAIL_METHOD
    assert run.next_kwargs is not None
    assert run.next_kwargs["error"] == "Trigger/execution timeout"
    assert run.next_kwargs["status"] == "timed_out"


def test_failed_event_resumes_into_fail_with_the_reason() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    table.apply(event(task, status="failed", payload=None, error="boom", traceback="tb"))
    [run] = runs(table.drain())
    assert run.next_method == FAIL_METHOD
    assert run.next_kwargs == {
        "error": "Trigger failure: boom",
        "traceback": "tb",
        "status": "failed",
    }


def test_task_outcome_ends_the_task_without_a_worker() -> None:
    for outcome in ("success", "failed", "skipped"):
        table = TaskTable()
        task = key()
        deferred_task(table, task)
        table.apply(event(task, task_outcome=outcome, payload={"done": 1}))
        out = table.drain()
        assert runs(out) == []
        [state] = states(out)
        assert state.state == outcome
        assert state.event == {"done": 1}
        assert table.counters.ended_by_trigger == 1
        assert table.pool_usage()["default_pool"] == (0, 128), "the slot is released"


def test_task_outcome_carries_the_event_xcoms_onto_the_terminal_state() -> None:
    for outcome in ("success", "failed", "skipped"):
        table = TaskTable()
        task = key()
        deferred_task(table, task)
        xcoms = {"return_value": {"rows": 3, "at": at(2)}, "extra": [1, 2]}
        table.apply(event(task, task_outcome=outcome, xcoms=xcoms))
        [state] = states(table.drain())
        assert state.state == outcome
        assert state.xcoms == xcoms
        assert decode(encode(state)) == state, "the xcoms survive the wire"


def test_clear_while_deferred_cancels_the_trigger() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task, queue="slow")
    cleared = TaskStateRecord(
        task=task, state="removed", source="client", reason="cleared", updated_at=at(3)
    )
    out = feed(table, cleared)
    cancel, marker = out
    assert isinstance(cancel.record, CancelRequest)
    assert cancel.queue == "slow"
    assert cancel.record.trigger_id == make_trigger_id(task, 0)
    assert cancel.record.reason == "cleared"
    assert isinstance(marker.record, TaskStateRecord), "then the proof that it was sent"
    assert marker.record.state == "removed"
    assert marker.record.source == "scheduler"
    assert marker.record.trigger_id == cancel.record.trigger_id
    assert table.apply(marker.record) == "echo"
    assert table.get(task.ti_key) == cleared
    assert table.pool_usage()["default_pool"][0] == 0
    assert table.apply(event(task, status="cancelled", payload=None)) == "cancelled"
    assert table.apply(event(task)) == "duplicate", "a late fire never resumes a cleared task"
    assert table.drain() == []
    assert table.get(task.ti_key).state == "removed"  # type: ignore[union-attr]
    return_records = [cleared, marker.record]
    # Rebuilt from the topic, the cancel is not sent again; without its proof, it is.
    history = [scheduled(task), worker(task, "running"), deferred(task, queue="slow")]
    rebuilt = TaskTable()
    for record in [*history, *return_records]:
        rebuilt.apply(record)
    assert [e for e in rebuilt.drain() if isinstance(e.record, CancelRequest)] == []
    crashed = TaskTable()
    for record in [*history, cleared]:
        crashed.apply(record)
    assert [type(e.record) for e in crashed.drain()] == [CancelRequest, TaskStateRecord]


def test_cancelled_event_on_a_deferred_task_removes_it() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    table.apply(event(task, status="cancelled", payload=None, error="cancelled by user"))
    [state] = states(table.drain())
    assert state.state == "removed"
    assert state.reason == "cancelled by user"


def test_removal_by_the_scheduler_itself_sends_no_cancel() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    table.apply(event(task, status="cancelled", payload=None))
    out = table.drain()
    assert all(not isinstance(e.record, CancelRequest) for e in out)


def test_deferring_several_times() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task, seq=0)
    for seq in range(3):
        table.apply(event(task, seq=seq, when=10 + seq))
        out = table.drain()
        [run] = runs(out)
        assert run.defer_seq == seq
        assert run.next_kwargs == {"step": seq}
        echo(table, out)
        running = worker(task, "running", 10.5 + seq, trigger_id=run.trigger_id, defer_seq=seq)
        assert table.apply(running) == "applied"
        assert table.apply(deferred(task, seq + 1, 10.6 + seq)) == "applied"
    assert table.apply(event(task, seq=1)) == "duplicate"
    assert table.get(task.ti_key).defer_seq == 3  # type: ignore[union-attr]


def test_retry_schedules_the_next_try_and_admits_it() -> None:
    table = TaskTable()
    task = key()
    out = feed(table, scheduled(task, resume=target(retries=1)))
    echo(table, out)
    out = feed(table, worker(task, "running", 1), worker(task, "up_for_retry", 2, reason="x"))
    retry, queued = states(out)
    assert retry.state == "scheduled"
    assert retry.task.try_number == 2
    assert retry.reason == "retry"
    assert queued.state == "queued"
    assert queued.task.try_number == 2
    [run] = runs(out)
    assert run.task.try_number == 2
    assert run.retries == 1
    assert table.counters.retries == 1


def test_old_try_records_are_stale() -> None:
    table = TaskTable()
    task2 = key(try_number=2)
    feed(table, scheduled(task2), worker(task2, "running", 1))
    assert table.apply(worker(key(try_number=1), "success", 5)) == "stale"
    assert table.get(task2.ti_key).state == "running"  # type: ignore[union-attr]


def test_progress_orders_a_whole_life() -> None:
    task = key()
    trig = make_trigger_id(task, 0)
    life = [
        scheduled(task),
        worker(task, "queued"),
        worker(task, "running"),
        deferred(task, 0),
        worker(task, "scheduled", trigger_id=trig, next_method="m"),
        worker(task, "queued", trigger_id=trig),
        worker(task, "running", trigger_id=trig),
        deferred(task, 1),
        worker(task, "success"),
        worker(task, "removed"),
        scheduled(key(try_number=2)),
    ]
    marks = [progress(r) for r in life]
    assert marks == sorted(marks)
    assert len(set(marks)) == len(marks)


# -- repair --------------------------------------------------------------------------------


def test_stale_last_record_is_repaired_by_republishing_the_state() -> None:
    """Direct resume: the scheduler's "queued" lands after the worker already finished."""
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    ev = event(task, resumed_directly=True)
    table.apply(ev)
    out = table.drain()
    assert runs(out) == [], "the triggerer already enqueued the run"
    [queued] = states(out)
    trig = ev.trigger_id
    done = worker(task, "success", 3, trigger_id=trig)
    assert table.apply(worker(task, "running", 2, trigger_id=trig)) == "applied"
    assert table.apply(done) == "applied"
    assert table.drain() == []
    assert table.apply(queued) == "stale", "own write read back after the worker's"
    assert [e.record for e in table.drain()] == [done]
    assert table.apply(done) == "echo"
    assert table.drain() == []
    assert table.counters.repairs == 1


def test_no_repair_while_own_write_is_in_flight() -> None:
    table = TaskTable()
    task = key()
    out = feed(table, scheduled(task))
    [queued] = states(out)
    assert table.apply(scheduled(task)) == "stale", "a second submit of the same task"
    assert table.drain() == [], "our queued record is still on its way and fixes the topic"
    assert table.apply(queued) == "echo"
    assert table.drain() == []


def test_events_seen_after_a_direct_resume_are_direct_then_duplicates() -> None:
    table = TaskTable()
    task = key()
    deferred_task(table, task)
    trig = make_trigger_id(task, 0)
    table.apply(worker(task, "running", 2, trigger_id=trig))
    assert table.apply(event(task, resumed_directly=True)) == "direct"
    assert table.apply(event(task, resumed_directly=True)) == "duplicate"
    assert table.drain() == []


def test_task_without_resume_target_is_scheduled_with_next_method() -> None:
    table = TaskTable()
    task = key()
    table.apply(deferred(task))
    table.apply(event(task))
    out = table.drain()
    [state] = states(out)
    assert runs(out) == []
    assert state.state == "scheduled"
    assert state.next_method == "execute_complete"


# -- pools -----------------------------------------------------------------------------------


def test_pool_admits_by_priority_weight_then_submit_time() -> None:
    table = TaskTable(pools=Pools(slots={"p": 2}))
    tasks = [key(n) for n in range(5)]
    weights = [1, 5, 1, 5, 3]
    for n, (t, w) in enumerate(zip(tasks, weights, strict=True)):
        table.apply(scheduled(t, when=n, resume=target(pool="p", priority_weight=w)))
    assert [r.task.task_id for r in runs(table.drain())] == ["t1", "t3"]
    assert table.pool_usage()["p"] == (2, 2)
    # t1 finishes: the next by weight (t4, weight 3) goes, then t0 (older than t2).
    feed(table, worker(tasks[1], "running", 9))
    out = feed(table, worker(tasks[1], "success", 10))
    assert [r.task.task_id for r in runs(out)] == ["t4"]
    out = feed(table, worker(tasks[3], "success", 11))
    assert [r.task.task_id for r in runs(out)] == ["t0"]


def test_deferred_tasks_keep_their_slot_and_resumes_bypass_a_full_pool() -> None:
    table = TaskTable(pools=Pools(slots={"p": 2}))
    a, b = key(1), key(2)
    for t in (a, b):
        deferred_task(table, t, resume=target(pool="p"))
    for t in (a, b):
        # The first scheduled record carried the target; it is kept across worker records.
        assert table.get(t.ti_key).state == "deferred"  # type: ignore[union-attr]
    new = [key(10 + n) for n in range(20)]
    out = feed(table, *(scheduled(t, when=2, resume=target(pool="p")) for t in new))
    assert runs(out) == [], "the pool is held by the deferred tasks"
    assert table.pool_usage()["p"] == (2, 2)
    table.apply(event(a, when=3))
    out = table.drain()
    assert [(r.mode, r.task.task_id) for r in runs(out)] == [("resume", "t1")]
    assert table.pool_usage()["p"] == (2, 2), "the resumed task still holds its slot"
    feed(table, worker(a, "running", 4, trigger_id=make_trigger_id(a, 0)))
    out = feed(table, worker(a, "success", 5))
    assert [(r.mode, r.task.task_id) for r in runs(out)] == [("start", "t10")]


def test_bigger_task_that_does_not_fit_lets_smaller_ones_go() -> None:
    table = TaskTable(pools=Pools(slots={"p": 3}))
    table.apply(scheduled(key(1), 0, resume=target(pool="p", pool_slots=2, priority_weight=9)))
    table.apply(scheduled(key(2), 1, resume=target(pool="p", pool_slots=2, priority_weight=5)))
    table.apply(scheduled(key(3), 2, resume=target(pool="p", pool_slots=1)))
    assert [r.task.task_id for r in runs(table.drain())] == ["t1", "t3"]
    assert table.pool_usage()["p"] == (3, 3)


def test_unlimited_pools() -> None:
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    out = feed(table, *(scheduled(key(n)) for n in range(300)))
    assert len(runs(out)) == 300
    assert table.pool_usage()["default_pool"] == (300, None)


# -- determinism and replay ------------------------------------------------------------------


def test_the_current_state_is_given_back_equal_to_the_record_folded() -> None:
    table = TaskTable()
    task = key()
    record = deferred(task, resume=target(), timeout_at=at(60), xcoms={"a": [1, 2]})
    table.apply(record)
    assert table.get(task.ti_key) == record
    assert table.snapshot() == {task.ti_key: record}


def test_equal_resume_targets_are_kept_once() -> None:
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    plain = ResumeTarget(operator="pkg.mod.Op", worker_queue="gpu")
    a, b = key(1), key(2)
    table.apply(scheduled(a, resume=plain))
    table.apply(scheduled(b, resume=ResumeTarget(operator="pkg.mod.Op", worker_queue="gpu")))
    first, second = table.get(a.ti_key), table.get(b.ti_key)
    assert first is not None
    assert second is not None
    assert first.resume is second.resume, "one object for equal targets, not one per task"
    other = key(3)
    table.apply(scheduled(other, resume=ResumeTarget(operator="pkg.mod.Op")))
    third = table.get(other.ti_key)
    assert third is not None
    assert third.resume is not first.resume


def test_state_kept_per_deferred_task_is_small() -> None:
    n = 2000
    records = [
        TaskStateRecord(
            task=TaskKey(dag_id="dag", task_id="wait", run_id=f"run-{i}"),
            state="deferred",
            source="worker",
            trigger_id=make_trigger_id(TaskKey(dag_id="dag", task_id="wait", run_id=f"run-{i}"), 0),
            next_method="execute_complete",
            resume=ResumeTarget(operator="pkg.mod.Op"),
            updated_at=T0,
        )
        for i in range(n)
    ]
    wire = [encode(record) for record in records]
    del records
    table = TaskTable()
    tracemalloc.start()
    try:
        for value in wire:
            record = decode(value)
            assert isinstance(record, TaskStateRecord)
            table.apply(record)
        del record
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(table) == n
    assert kept / n < 1536, f"{kept / n:.0f} bytes per deferred task"


def test_same_input_gives_byte_identical_output() -> None:
    def run() -> list[bytes]:
        table = TaskTable(pools=Pools(slots={"default_pool": 3}))
        tasks = [key(n) for n in range(6)]
        out = feed(table, *(scheduled(t, when=n) for n, t in enumerate(tasks)))
        echo(table, out)
        for t in tasks[:3]:
            out += feed(table, worker(t, "running", 7), deferred(t, 0, 8))
        out += feed(table, event(tasks[0], when=9), event(tasks[1], status="timed_out", when=9))
        out += feed(table, event(tasks[2], task_outcome="success", when=10))
        return [encode(e.record) for e in out]

    assert run() == run()


@dataclass
class _World:
    """A tiny simulated deployment around one TaskTable, to record real histories."""

    rng: random.Random
    scripts: dict[str, list[str]]
    dups: int
    pools: Pools
    table: TaskTable = field(init=False)
    tasks_log: list[TaskStateRecord] = field(default_factory=list)
    events_log: list[TriggerEventRecord] = field(default_factory=list)
    causes: list[int] = field(default_factory=list)  # tasks records an event must follow
    runs: list[RunTask] = field(default_factory=list)
    triggers: dict[str, TaskStateRecord] = field(default_factory=dict)
    clearing: dict[str, TaskStateRecord] = field(default_factory=dict)
    handled: set[tuple[str, int, int, str]] = field(default_factory=set)
    step: dict[str, int] = field(default_factory=dict)
    tick: int = 0
    t_read: int = 0
    e_read: int = 0
    timeouts: bool = False  # deferrals with a timeout a few ticks on

    def __post_init__(self) -> None:
        self.table = TaskTable(pools=self.pools)

    def now(self) -> dt.datetime:
        self.tick += 1
        return at(self.tick)

    def publish(self, out: list[Emit]) -> None:
        for emit in out:
            record = emit.record
            if isinstance(record, TaskStateRecord):
                self.tasks_log.append(record)
            elif isinstance(record, RunTask):
                self.runs.append(record)
            else:
                deferral = self.clearing.pop(record.trigger_id, None)
                deferral = deferral or self.triggers.pop(record.trigger_id, None)
                if deferral is not None:
                    self.emit_event(deferral, "cancelled", None)

    def emit_event(self, deferral: TaskStateRecord, status: Any, outcome: Any) -> None:
        assert deferral.trigger_id is not None
        payload = {"n": deferral.defer_seq} if status == "fired" else None
        for _ in range(1 + self.dups):
            # A cancel is caused by a "removed" record the scheduler read; a fire only by the
            # deferral, which the fold waits for itself (pending), so it may come first.
            self.causes.append(len(self.tasks_log) if status == "cancelled" else 0)
            self.events_log.append(
                TriggerEventRecord(
                    event_id=make_event_id(deferral.trigger_id, status, payload),
                    trigger_id=deferral.trigger_id,
                    task=deferral.task,
                    defer_seq=deferral.defer_seq,
                    status=status,
                    payload=payload,
                    task_outcome=outcome,
                    emitted_at=self.now(),
                )
            )

    def actions(self) -> list[str]:
        acts = []
        if self.t_read < len(self.tasks_log):
            acts.append("read_task")
        if self.e_read < len(self.events_log):
            acts.append("read_event")
        if self.runs:
            acts.append("work")
        if self.triggers:
            acts.append("fire")
        return acts

    def work(self) -> None:
        run = self.runs.pop(0)
        task = run.task
        mark = (task.ti_key, task.try_number, run.defer_seq, run.mode)
        if mark in self.handled:
            return
        self.handled.add(mark)
        trig = run.trigger_id if run.mode == "resume" else None
        self.tasks_log.append(
            worker(task, "running", self.tick, trigger_id=trig, defer_seq=run.defer_seq)
        )
        if run.next_method == FAIL_METHOD:
            final = "up_for_retry" if task.try_number <= run.retries else "failed"
            self.tasks_log.append(worker(task, final, self.tick))
            return
        n = self.step.get(task.ti_key, 0)
        script = self.scripts[task.ti_key]
        if n < len(script):
            seq = n
            self.step[task.ti_key] = n + 1
            fields = {"timeout_at": at(self.tick + self.rng.randint(0, 9))} if self.timeouts else {}
            record = deferred(task, seq, self.tick, **fields)
            self.tasks_log.append(record)
            self.triggers[record.trigger_id or ""] = record
        else:
            self.tasks_log.append(worker(task, "success", self.tick))

    def fire(self) -> None:
        trig = self.rng.choice(sorted(self.triggers))
        deferral = self.triggers.pop(trig)
        kind = self.scripts[deferral.task.ti_key][deferral.defer_seq]
        if kind == "clear":
            self.tasks_log.append(
                TaskStateRecord(
                    task=deferral.task, state="removed", source="client", updated_at=self.now()
                )
            )
            self.clearing[trig] = deferral  # cancelled through the CancelRequest
        elif kind.startswith("end_"):
            self.emit_event(deferral, "fired", kind.removeprefix("end_"))
        else:
            self.emit_event(deferral, kind, None)

    def run(self) -> None:
        for ti_key in self.scripts:
            dag, task_id, run_id, _ = ti_key.split("/")
            task = TaskKey(dag_id=dag, task_id=task_id, run_id=run_id)
            self.tasks_log.append(scheduled(task, self.tick, resume=target(retries=1)))
        while self.step_once():
            pass

    def step_once(self) -> bool:
        """One random action (reads drain the table); False when nothing is left to do."""
        acts = self.actions()
        if acts:
            act = self.rng.choice(acts)
            if act == "read_task":
                self.table.apply(self.tasks_log[self.t_read])
                self.t_read += 1
            elif act == "read_event":
                self.table.apply(self.events_log[self.e_read])
                self.e_read += 1
            elif act == "work":
                self.work()
            else:
                self.fire()
            if act.startswith("read"):
                self.publish(self.table.drain())
        return bool(acts)


_KINDS = st.sampled_from(
    ["fired", "fired", "failed", "timed_out", "end_success", "end_failed", "end_skipped", "clear"]
)


@settings(max_examples=60, deadline=None)
@given(
    scripts=st.lists(st.lists(_KINDS, max_size=3), min_size=1, max_size=6),
    dups=st.integers(0, 2),
    slots=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    merges=st.lists(st.lists(st.booleans(), max_size=400), min_size=1, max_size=3),
)
def test_replaying_any_interleaving_of_the_topics_gives_the_same_state(
    scripts: list[list[str]], dups: int, slots: int, seed: int, merges: list[list[bool]]
) -> None:
    """Rebuild from the tasks and resume topics in any interleaving that keeps each topic's
    order (and reads a "cancelled" event after the clear that caused it): the same state,
    record for record, whatever was held pending."""
    world = _World(
        rng=random.Random(seed),
        scripts={key(n).ti_key: script for n, script in enumerate(scripts)},
        dups=dups,
        pools=Pools(slots={"default_pool": slots}),
    )
    world.run()
    live = world.table.snapshot()
    assert all(r.state in {"success", "failed", "skipped", "removed"} for r in live.values())
    assert world.table.counters.events_applied + world.table.counters.events_cancelled <= len(
        world.events_log
    )
    assert world.table.pending_events == 0

    for bits in merges:
        replay = TaskTable(pools=world.pools)
        ti, ei, choice = 0, 0, iter(bits)
        while ti < len(world.tasks_log) or ei < len(world.events_log):
            take_task = next(choice, True)
            if ei < len(world.events_log) and world.causes[ei] > ti:
                take_task = True
            if ti < len(world.tasks_log) and (take_task or ei >= len(world.events_log)):
                replay.apply(world.tasks_log[ti])
                ti += 1
            else:
                replay.apply(world.events_log[ei])
                ei += 1
        assert replay.snapshot() == live
        assert replay.pending_events == 0
        assert replay.counters.events_applied <= world.table.counters.events_applied


def test_overdue_deferrals_are_deferred_tasks_past_their_timeout():
    table = TaskTable()
    table.apply(deferred(key(1), timeout_at=at(60)))
    table.apply(deferred(key(2), timeout_at=at(600)))
    table.apply(deferred(key(3)))  # no timeout
    table.apply(worker(key(4), "success", timeout_at=at(10)))
    assert table.overdue_deferrals(at(30)) == 0
    assert table.overdue_deferrals(at(61)) == 1
    assert table.overdue_deferrals(at(601)) == 2
