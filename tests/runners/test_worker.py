"""The worker runtime without a broker: TaskRunner over an in-memory sink, and its bookkeeping."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest
from deferline.engine import BaseOperator, Context
from deferline.engine.triggers import TimeDeltaTrigger
from deferline.runners.worker import TaskRunner
from deferline.runners.worker.testing import AttemptProgress, OffsetTracker, SlotPool, run_progress
from deferline.schemas import (
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    decode,
    make_trigger_id,
    open_kwargs,
)
from deferline.topics import Settings, TopicNames

PREFIX = "unit."
NAMES = TopicNames(PREFIX)
OPS = "tests.runners.test_worker"
TASK = TaskKey(dag_id="dag", task_id="t1", run_id="r1")


# -- operators run by these tests ------------------------------------------------------------

CALLS: list[dict[str, Any]] = []


class DeferTwiceOperator(BaseOperator):
    """Defers on a timer, re-defers once from its resume method, then returns the events."""

    def __init__(self, *, trigger_queue: str | None = None, **kwargs: Any) -> None:
        super().__init__(trigger_queue=trigger_queue, **kwargs)

    def execute(self, context: Context) -> Any:
        CALLS.append({"method": "execute", "try": context["try_number"]})
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=60)),
            method_name="step",
            kwargs={"n": 1, "secret": "s3cr3t"},
            timeout=dt.timedelta(seconds=120),
        )

    def step(self, context: Context, event: Any = None, *, n: int, secret: str) -> Any:
        CALLS.append({"method": "step", "n": n, "event": event, "seq": context["defer_seq"]})
        if n < 2:
            self.defer(
                trigger=TimeDeltaTrigger(dt.timedelta(seconds=60)),
                method_name="step",
                kwargs={"n": n + 1, "secret": secret},
            )
        return {"n": n, "event": event}


class UnencodableDefer(BaseOperator):
    def execute(self, context: Context) -> Any:
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)),
            method_name="execute",
            kwargs={"handle": threading.Lock()},
        )


class Returns(BaseOperator):
    """Returns ``value`` from execute, or an unencodable lock when ``value`` is "lock"."""

    def __init__(self, *, value: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value

    def execute(self, context: Context) -> Any:
        return threading.Lock() if self.value == "lock" else self.value


class AlwaysFails(BaseOperator):
    def execute(self, context: Context) -> Any:
        raise RuntimeError(f"boom on try {context['try_number']}")


class Blocking(BaseOperator):
    """Holds its slot until the test releases it."""

    gate = threading.Event()
    entered = threading.Event()

    def execute(self, context: Context) -> Any:
        type(self).entered.set()
        assert type(self).gate.wait(10)
        return "done"


# -- fakes -----------------------------------------------------------------------------------


class FakeSink:
    """Records every send in order; acks immediately (or raises when told to)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes | None]] = []

    async def send(self, topic: str, key: bytes | None, value: bytes | None) -> Awaitable[Any]:
        self.sent.append((topic, key, value))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def records(self, topic: str | None = None) -> list[Any]:
        return [decode(v) for t, _, v in self.sent if v is not None and topic in (None, t)]

    def states(self) -> list[str]:
        return [r.state for r in self.records(NAMES.tasks)]


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


def make_runner(
    executor: concurrent.futures.Executor, *, keys: list[str] | None = None, **kw: Any
) -> tuple[TaskRunner, FakeSink, AttemptProgress]:
    settings = Settings(
        topic_prefix=PREFIX,
        allowed_operator_prefixes=[OPS, "deferline.engine.examples"],
        kwargs_keys=keys or [],
    )
    sink = FakeSink()
    progress = AttemptProgress()
    runner = TaskRunner(settings, sink=sink, progress=progress, executor=executor, **kw)
    return runner, sink, progress


def start(operator: str, *, task: TaskKey = TASK, retries: int = 0, **op_kwargs: Any) -> RunTask:
    return RunTask(
        task=task,
        mode="start",
        operator=f"{OPS}.{operator}",
        op_kwargs=op_kwargs,
        worker_queue="default",
        retries=retries,
    )


def resume_of(request: DeferRequest, run: RunTask, *, event: Any, **changes: Any) -> RunTask:
    fields: dict[str, Any] = {
        "task": request.task,
        "mode": "resume",
        "operator": run.operator,
        "op_kwargs": run.op_kwargs,
        "next_method": request.next_method,
        "next_kwargs": request.next_kwargs,
        "event": event,
        "event_id": f"ev-{request.defer_seq}",
        "trigger_id": request.trigger_id,
        "defer_seq": request.defer_seq,
        "retries": run.retries,
    }
    fields.update(changes)
    return RunTask(**fields)


@pytest.fixture(autouse=True)
def _reset_calls() -> Iterator[None]:
    CALLS.clear()
    yield
    CALLS.clear()


# -- TaskRunner ------------------------------------------------------------------------------


async def test_defer_writes_running_then_deferred_state_then_request(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    assert await runner.handle(run) is True

    topics = [topic for topic, _, _ in sink.sent]
    assert topics == [NAMES.tasks, NAMES.tasks, NAMES.defer()]
    running, deferred, request = (decode(v) for _, _, v in sink.sent if v is not None)
    assert isinstance(running, TaskStateRecord)
    assert running.state == "running"
    assert running.source == "worker"
    assert isinstance(deferred, TaskStateRecord)
    assert deferred.state == "deferred"
    assert isinstance(request, DeferRequest)
    trigger_id = make_trigger_id(TASK, 0)
    assert deferred.trigger_id == request.trigger_id == trigger_id
    assert deferred.defer_seq == request.defer_seq == 0
    assert request.next_method == "step"
    assert request.next_kwargs == {"n": 1, "secret": "s3cr3t"}
    assert request.classpath == "deferline.engine.triggers.DateTimeTrigger"
    assert request.timeout_at is not None
    assert request.resume == ResumeTarget(operator=run.operator, op_kwargs={}, retries=0)
    # Keys: the task state under the task instance, the request under its trigger id.
    assert sink.sent[0][1] == sink.sent[1][1] == TASK.ti_key.encode()
    assert sink.sent[2][1] == trigger_id.encode()
    assert runner.metrics.deferred == 1
    assert runner.metrics.started == 1
    assert runner.metrics.slot_seconds > 0


async def test_resume_calls_next_method_with_event_and_redefers_with_next_seq(
    executor: Any,
) -> None:
    runner, sink, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    await runner.handle(run)
    first = sink.records(NAMES.defer())[-1]

    await runner.handle(resume_of(first, run, event={"fired": 1}))
    assert CALLS[-1] == {"method": "step", "n": 1, "event": {"fired": 1}, "seq": 0}
    second = sink.records(NAMES.defer())[-1]
    assert second.defer_seq == 1
    assert second.trigger_id == make_trigger_id(TASK, 1)
    assert second.next_kwargs == {"n": 2, "secret": "s3cr3t"}
    resumed_running = [r for r in sink.records(NAMES.tasks) if r.state == "running"][-1]
    assert resumed_running.trigger_id == first.trigger_id
    assert resumed_running.defer_seq == 0

    await runner.handle(resume_of(second, run, event="second"))
    assert sink.states() == ["running", "deferred", "running", "deferred", "running", "success"]
    assert CALLS[-1]["event"] == "second"
    assert runner.metrics.resumed == 2
    assert runner.metrics.succeeded == 1
    final = sink.records(NAMES.tasks)[-1]
    assert final.xcoms == {"return_value": {"n": 2, "event": "second"}}, "resume return stored"


async def test_duplicate_runtasks_are_ignored(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    await runner.handle(run)
    sent = len(sink.sent)
    assert await runner.handle(run) is False  # the start again, after it deferred
    request = sink.records(NAMES.defer())[-1]
    resume = resume_of(request, run, event=1)
    assert await runner.handle(resume) is True
    assert await runner.handle(resume) is False  # the same resume again (direct + scheduler)
    assert await runner.handle(run) is False
    assert runner.metrics.duplicates == 3
    assert len([c for c in CALLS if c["method"] == "execute"]) == 1
    assert len(sink.sent) == sent + 3  # running, deferred, request of the one real resume


async def test_a_resume_resent_after_a_scheduler_takeover_runs_once(executor: Any) -> None:
    """A scheduler that took over without transactions may send a resume RunTask again (the
    dead leader's copy may or may not have gone out): the worker runs the resume once, and a
    copy is ignored whether the task then re-deferred or finished."""
    runner, sink, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    await runner.handle(run)
    resume = resume_of(sink.records(NAMES.defer())[-1], run, event=1)
    resent = resume.model_copy()
    assert await runner.handle(resume) is True
    assert await runner.handle(resent) is False, "the task re-deferred past it"
    final = resume_of(sink.records(NAMES.defer())[-1], run, event=2)
    assert await runner.handle(final) is True
    assert sink.states()[-1] == "success"
    assert await runner.handle(final.model_copy()) is False, "the task finished"
    assert runner.metrics.resumed == 2
    assert runner.metrics.duplicates == 2


async def test_concurrent_duplicates_run_once(executor: Any) -> None:
    runner, _, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    results = await asyncio.gather(runner.handle(run), runner.handle(run))
    assert sorted(results) == [False, True]
    assert len(CALLS) == 1
    assert not runner._locks  # per-task locks do not accumulate


async def test_dedup_from_tasks_topic_records_of_other_writers(executor: Any) -> None:
    """A restarted worker knows only the topic: a deferred state there makes the start a dup."""
    runner, sink, progress = make_runner(executor)
    progress.observe(
        TaskStateRecord(
            task=TASK, state="deferred", trigger_id=make_trigger_id(TASK, 0), source="worker"
        )
    )
    assert await runner.handle(start("DeferTwiceOperator")) is False
    assert sink.sent == []


async def test_redelivered_run_whose_worker_died_runs_again(executor: Any) -> None:
    runner, sink, progress = make_runner(executor)
    progress.observe(TaskStateRecord(task=TASK, state="running", source="worker"))
    assert await runner.handle(start("DeferTwiceOperator")) is True
    assert sink.states() == ["running", "deferred"]


async def test_fail_resume_fails_with_the_trigger_reason(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    run = start("DeferTwiceOperator")
    await runner.handle(run)
    request = sink.records(NAMES.defer())[-1]
    fail = resume_of(
        request,
        run,
        event=None,
        next_method="__fail__",
        next_kwargs={"error": "Trigger/execution timeout", "status": "timed_out"},
    )
    await runner.handle(fail)
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "failed"
    assert final.reason == "TaskDeferralTimeout: Trigger/execution timeout"
    assert not [c for c in CALLS if c["method"] == "step"]


async def test_failure_with_retries_is_up_for_retry_until_the_last_try(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    await runner.handle(start("AlwaysFails", retries=1))
    assert sink.records(NAMES.tasks)[-1].state == "up_for_retry"
    assert "boom on try 1" in (sink.records(NAMES.tasks)[-1].reason or "")
    second = TASK.model_copy(update={"try_number": 2})
    await runner.handle(start("AlwaysFails", task=second, retries=1))
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "failed"
    assert final.task.try_number == 2
    assert runner.metrics.retried == 1
    assert runner.metrics.failed == 1
    # the first try is over: its RunTask again is a duplicate
    assert await runner.handle(start("AlwaysFails", retries=1)) is False


async def test_operator_outside_allowed_prefixes_fails_without_retry(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    run = start("AlwaysFails", retries=3).model_copy(update={"operator": "os.system"})
    await runner.handle(run)
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "failed"
    assert final.reason is not None
    assert "OperatorNotAllowed" in final.reason


async def test_bad_op_kwargs_fail_clearly(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    await runner.handle(start("AlwaysFails", unexpected=1))
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "failed"
    assert "rejected its kwargs" in (final.reason or "")


async def test_a_deferral_that_cannot_be_encoded_fails_the_task_only(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    await runner.handle(start("UnencodableDefer"))
    assert sink.states() == ["running", "failed"]
    assert "cannot defer" in (sink.records(NAMES.tasks)[-1].reason or "")
    assert sink.records(NAMES.defer()) == []
    other = TASK.model_copy(update={"task_id": "next"})
    assert await runner.handle(start("DeferTwiceOperator", task=other)) is True


async def test_execute_return_value_is_stored_as_the_return_value_xcom(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    value = {"rows": 3, "when": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "ids": (1, 2)}
    await runner.handle(start("Returns", value=value))
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "success"
    assert final.xcoms == {"return_value": value}
    assert final.reason is None


async def test_none_return_value_stores_no_xcoms(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    await runner.handle(start("Returns"))
    final = sink.records(NAMES.tasks)[-1]
    assert final.state == "success"
    assert final.xcoms is None


async def test_unencodable_return_value_still_succeeds_and_says_why(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    await runner.handle(start("Returns", value="lock"))
    assert sink.states() == ["running", "success"]
    final = sink.records(NAMES.tasks)[-1]
    assert final.xcoms is None
    assert (final.reason or "").startswith("return value not stored: ")
    assert "lock" in (final.reason or "")
    assert runner.metrics.succeeded == 1


async def test_kwargs_are_sealed_when_keys_are_configured(executor: Any) -> None:
    key = KwargsCipher.generate_key()
    runner, sink, _ = make_runner(executor, keys=[key])
    await runner.handle(start("DeferTwiceOperator"))
    request = sink.records(NAMES.defer())[-1]
    assert request.kwargs == {}
    assert request.kwargs_token is not None
    raw = next(v for t, _, v in sink.sent if t == NAMES.defer())
    assert raw is not None
    assert b"moment" not in raw
    assert "moment" in open_kwargs(request, KwargsCipher([key]))


async def test_trigger_queue_is_ensured_once_and_used_as_topic(executor: Any) -> None:
    ensured: list[str] = []

    async def ensure(queue: str) -> None:
        ensured.append(queue)

    runner, sink, _ = make_runner(executor, ensure_trigger_queue=ensure)
    run = start("DeferTwiceOperator", trigger_queue="gpu")
    await runner.handle(run)
    other = TASK.model_copy(update={"task_id": "t2"})
    await runner.handle(start("DeferTwiceOperator", task=other, trigger_queue="gpu"))
    assert ensured == ["gpu"]
    assert [t for t, _, _ in sink.sent].count(NAMES.defer("gpu")) == 2
    request = sink.records(NAMES.defer("gpu"))[-1]
    assert request.queue == "gpu"


async def test_example_end_from_trigger_and_start_from_trigger_operators(executor: Any) -> None:
    runner, sink, _ = make_runner(executor)
    run = RunTask(
        task=TASK,
        mode="start",
        operator="deferline.engine.examples.WaitOperator",
        op_kwargs={"seconds": 1, "end_from_trigger": True},
    )
    await runner.handle(run)
    assert sink.records(NAMES.defer())[-1].end_from_trigger is True
    starter = RunTask(
        task=TASK.model_copy(update={"task_id": "starter"}),
        mode="start",
        operator="deferline.engine.examples.StartFromTriggerWaitOperator",
        op_kwargs={"seconds": 1},
    )
    await runner.handle(starter)
    request = sink.records(NAMES.defer())[-1]
    assert request.classpath == "deferline.engine.triggers.DateTimeTrigger"
    assert request.next_method == "execute_complete"


async def test_slot_seconds_cover_the_running_operator(executor: Any) -> None:
    Blocking.gate.clear()
    Blocking.entered.clear()
    runner, _, _ = make_runner(executor)
    task = asyncio.create_task(runner.handle(start("Blocking")))
    assert await asyncio.to_thread(Blocking.entered.wait, 10)
    await asyncio.sleep(0.2)  # the slot is held while the operator runs: that is the measure
    Blocking.gate.set()
    assert await task is True
    assert runner.metrics.slot_seconds >= 0.2


# -- bookkeeping -----------------------------------------------------------------------------


def _state(state: str, *, try_number: int = 1, seq: int = 0, trigger: bool = False) -> Any:
    task = TASK.model_copy(update={"try_number": try_number})
    return TaskStateRecord(
        task=task,
        state=state,
        defer_seq=seq,
        trigger_id=make_trigger_id(task, seq) if trigger else None,
    )


def test_attempt_progress_rules() -> None:
    progress = AttemptProgress()
    begin = start("X")
    assert not progress.is_duplicate(begin)
    progress.observe(_state("queued"))
    assert not progress.is_duplicate(begin)
    progress.observe(_state("running"))
    assert not progress.is_duplicate(begin)  # redelivery after a crash runs again
    progress.observe(_state("deferred", seq=0, trigger=True))
    assert progress.is_duplicate(begin)
    resume0 = RunTask(task=TASK, mode="resume", operator="x", defer_seq=0, trigger_id="t")
    assert not progress.is_duplicate(resume0)
    progress.observe(_state("queued", seq=0, trigger=True))
    assert not progress.is_duplicate(resume0)
    progress.observe(_state("deferred", seq=1, trigger=True))
    assert progress.is_duplicate(resume0)
    # a stale record never moves progress back
    progress.observe(_state("running"))
    assert progress.is_duplicate(resume0)
    progress.observe(_state("success"))
    resume1 = resume0.model_copy(update={"defer_seq": 1})
    assert progress.is_duplicate(resume1)
    # the next try starts over
    retry = begin.model_copy(update={"task": TASK.model_copy(update={"try_number": 2})})
    assert not progress.is_duplicate(retry)
    progress.observe(_state("scheduled", try_number=2))
    assert not progress.is_duplicate(retry)
    assert progress.is_duplicate(begin)
    progress.observe(_state("removed", try_number=2))
    assert progress.is_duplicate(retry)
    progress.forget(TASK.ti_key)
    assert not progress.is_duplicate(retry)
    assert run_progress(resume1) > run_progress(resume0) > run_progress(begin)


def test_offset_tracker_commits_only_below_the_lowest_unfinished() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.started("p0", offset)
    tracker.finished("p0", 11)
    assert tracker.committable() == {"p0": 10}  # 10 is still running
    tracker.committed({"p0": 10})
    assert tracker.committable() == {}
    tracker.finished("p0", 10)
    assert tracker.committable() == {"p0": 12}
    tracker.finished("p0", 12)
    assert tracker.committable() == {"p0": 13}
    tracker.committed({"p0": 13})
    assert tracker.committable() == {}
    assert tracker.in_flight("p0") == 0
    tracker.started("p1", 0)
    assert tracker.in_flight("p1") == 1
    tracker.drop(["p1"])
    assert tracker.in_flight("p1") == 0
    assert "p1" not in tracker.committable()


async def test_slot_pool_waits_for_a_release() -> None:
    pool = SlotPool(2)
    pool.take(2)
    assert pool.free == 0
    assert pool.busy_peak == 2
    with pytest.raises(ValueError, match="slot"):
        pool.take()
    waiter = asyncio.create_task(pool.wait_free())
    await asyncio.sleep(0)
    assert not waiter.done()
    pool.give_back()
    assert await asyncio.wait_for(waiter, 1) == 1
    pool.give_back()
    with pytest.raises(ValueError, match="no slot"):
        pool.give_back()
    with pytest.raises(ValueError, match="at least one"):
        SlotPool(0)
