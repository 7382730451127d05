"""The operator API: deferral from any depth, resume, sensors, start/end from trigger."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from deferline.engine import (
    FAIL_METHOD,
    BaseOperator,
    BaseSensorOperator,
    BaseTrigger,
    Context,
    Deferred,
    Failed,
    OperatorImportError,
    OperatorKwargsError,
    OperatorNotAllowed,
    Skipped,
    StartTriggerArgs,
    Succeeded,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskDeferred,
    TriggerEvent,
    deferral_records,
    import_operator,
    load_operator,
    make_context,
    run_operator,
    start_deferral,
)
from deferline.engine.examples import (
    DateTimeSensor,
    MultiWaitOperator,
    StartFromTriggerWaitOperator,
    WaitOperator,
)
from deferline.schemas import ResumeTarget, TaskKey, make_trigger_id

TASK = TaskKey(dag_id="d", task_id="t", run_id="r", try_number=2)
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


class FakeTrigger(BaseTrigger):
    def __init__(self, name: str = "x", when: dt.datetime | None = None) -> None:
        super().__init__()
        self.name = name
        self.when = when

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.engine.test_operator.FakeTrigger", {"name": self.name, "when": self.when})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(self.name)


def _inner(op: BaseOperator, depth: int) -> None:
    if depth == 0:
        op.defer(
            trigger=FakeTrigger("deep"),
            method_name="done",
            kwargs={"depth": 3},
            timeout=dt.timedelta(minutes=5),
        )
    _inner(op, depth - 1)


class NestedOperator(BaseOperator):
    def execute(self, context: Context) -> Any:
        try:
            _inner(self, 3)
        except Exception:  # a broad handler in user code must not swallow the deferral
            return "swallowed"
        return "not deferred"

    def done(self, context: Context, event: Any = None, *, depth: int) -> Any:
        return {"event": event, "depth": depth, "try": context["try_number"]}


def _ctx(op: BaseOperator, **kwargs: Any) -> Context:
    return make_context(op, TASK, **kwargs)


def test_defer_from_nested_calls_raises_task_deferred_past_except_exception() -> None:
    op = NestedOperator(task_id="t")
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Deferred)
    deferral = result.deferral
    assert deferral.method_name == "done"
    assert deferral.kwargs == {"depth": 3}
    assert deferral.timeout == dt.timedelta(minutes=5)
    assert deferral.end_from_trigger is False
    assert isinstance(deferral.trigger, FakeTrigger)


def test_task_deferred_fields_and_numeric_timeout() -> None:
    exc = TaskDeferred(trigger=FakeTrigger(), method_name="m", kwargs=None, timeout=2.5)
    assert exc.timeout == dt.timedelta(seconds=2.5)
    assert exc.kwargs == {}
    assert isinstance(exc, BaseException)
    assert not isinstance(exc, Exception)
    with pytest.raises(TypeError, match="timeout"):
        TaskDeferred(trigger=FakeTrigger(), method_name="m", timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BaseTrigger"):
        TaskDeferred(trigger=object(), method_name="m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method_name"):
        TaskDeferred(trigger=FakeTrigger(), method_name=None)
    ended = TaskDeferred(trigger=FakeTrigger(), method_name=None, end_from_trigger=True)
    assert ended.method_name is None


def test_resume_calls_next_method_on_fresh_instance_with_event_and_kwargs() -> None:
    op = NestedOperator(task_id="t")
    ctx = _ctx(op, trigger_id="tid", defer_seq=0, event={"fired": 1}, event_id="e1")
    result = run_operator(op, ctx, next_method="done", next_kwargs={"depth": 3})
    assert result == Succeeded({"event": {"fired": 1}, "depth": 3, "try": 2})


def test_resume_into_missing_or_private_method_fails() -> None:
    op = NestedOperator(task_id="t")
    missing = run_operator(op, _ctx(op), next_method="nope")
    assert isinstance(missing, Failed)
    assert "no method 'nope'" in missing.error
    private = run_operator(op, _ctx(op), next_method="_inner")
    assert isinstance(private, Failed)
    assert "private" in private.error


def test_fail_method_raises_the_trigger_reason() -> None:
    op = NestedOperator(task_id="t")
    failed = run_operator(
        op,
        _ctx(op),
        next_method=FAIL_METHOD,
        next_kwargs={"error": "Trigger failure: boom", "traceback": "tb", "status": "failed"},
    )
    assert isinstance(failed, Failed)
    assert failed.error_type == TaskDeferralError.__name__
    assert failed.error == "Trigger failure: boom"
    timed_out = run_operator(
        op,
        _ctx(op),
        next_method=FAIL_METHOD,
        next_kwargs={"error": "Trigger/execution timeout", "status": "timed_out"},
    )
    assert isinstance(timed_out, Failed)
    assert timed_out.error_type == TaskDeferralTimeout.__name__


def test_execute_exception_becomes_failed_with_traceback() -> None:
    class Boom(BaseOperator):
        def execute(self, context: Context) -> Any:
            raise KeyError("k")

    op = Boom()
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Failed)
    assert result.error_type == "KeyError"
    assert result.traceback is not None
    assert "KeyError" in result.traceback
    assert result.retryable


def test_context_carries_attempt_params_and_event() -> None:
    op = BaseOperator(task_id="t", params={"a": 1})
    ctx = make_context(op, TASK, trigger_id="tid", defer_seq=1, event="ev", event_id="e")
    assert ctx["ti"] == TASK
    assert ctx["ti_key"] == TASK.ti_key
    assert ctx["try_number"] == 2
    assert ctx["params"] == {"a": 1}
    assert ctx["event"] == "ev"
    assert ctx["defer_seq"] == 1
    assert ctx["task"] is op


def test_multi_wait_redefers_into_execute_then_returns() -> None:
    op = MultiWaitOperator(waits=[1, 2])
    first = run_operator(op, _ctx(op))
    assert isinstance(first, Deferred)
    assert first.deferral.method_name == "execute"
    assert first.deferral.kwargs == {"index": 1}
    again = MultiWaitOperator(waits=[1, 2])
    second = run_operator(again, _ctx(again), next_method="execute", next_kwargs={"index": 1})
    assert isinstance(second, Deferred)
    assert second.deferral.kwargs == {"index": 2}
    last = MultiWaitOperator(waits=[1, 2])
    done = run_operator(last, _ctx(last), next_method="execute", next_kwargs={"index": 2})
    assert done == Succeeded(2)


def test_deferral_records_are_deferred_state_then_request() -> None:
    deferral = TaskDeferred(
        trigger=FakeTrigger("n", NOW),
        method_name="done",
        kwargs={"depth": 3},
        timeout=dt.timedelta(seconds=30),
        end_from_trigger=True,
    )
    target = ResumeTarget(operator="pkg.Op", op_kwargs={"a": 1}, worker_queue="wq", retries=2)
    state, request = deferral_records(
        TASK, deferral, defer_seq=1, resume=target, trigger_queue="tq", now=NOW
    )
    trigger_id = make_trigger_id(TASK, 1)
    assert state.state == "deferred"
    assert state.trigger_id == request.trigger_id == trigger_id
    assert state.defer_seq == request.defer_seq == 1
    assert state.next_method == request.next_method == "done"
    assert state.next_kwargs == request.next_kwargs == {"depth": 3}
    assert state.timeout_at == request.timeout_at == NOW + dt.timedelta(seconds=30)
    assert state.queue == request.queue == "tq"
    assert state.resume == request.resume == target
    assert state.source == "worker"
    assert request.classpath == "tests.engine.test_operator.FakeTrigger"
    assert request.kwargs == {"name": "n", "when": NOW}
    assert request.end_from_trigger is True


def test_deferral_records_wrap_a_broken_serialize() -> None:
    class Broken(FakeTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            raise RuntimeError("no")

    deferral = TaskDeferred(trigger=Broken(), method_name="m")
    with pytest.raises(Exception, match="cannot serialize trigger"):
        deferral_records(TASK, deferral, defer_seq=0, resume=None)


# -- sensors -------------------------------------------------------------------------------


class CountingSensor(BaseSensorOperator):
    """True on the ``succeed_on``-th poke (counted per instance)."""

    def __init__(self, *, succeed_on: int = 3, trigger: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.succeed_on = succeed_on
        self.pokes = 0
        self.with_trigger = trigger

    def poke(self, context: Context) -> bool:
        self.pokes += 1
        return self.pokes >= self.succeed_on

    def make_trigger(self, context: Context) -> BaseTrigger | None:
        return FakeTrigger("sensor") if self.with_trigger else None


def test_poke_mode_sensor_polls_in_the_slot_until_true() -> None:
    op = CountingSensor(succeed_on=3, poke_interval=0)
    assert run_operator(op, _ctx(op)) == Succeeded(None)
    assert op.pokes == 3


def test_poke_mode_sensor_times_out_and_soft_fails() -> None:
    hard = CountingSensor(succeed_on=10**9, poke_interval=0.001, timeout=0.01)
    result = run_operator(hard, _ctx(hard))
    assert isinstance(result, Failed)
    assert result.error_type == "SensorTimeout"
    soft = CountingSensor(succeed_on=10**9, poke_interval=0.001, timeout=0.01, soft_fail=True)
    assert isinstance(run_operator(soft, _ctx(soft)), Skipped)


def test_deferrable_sensor_with_trigger_defers_on_it_with_its_timeout() -> None:
    op = CountingSensor(succeed_on=2, trigger=True, deferrable=True, timeout=60)
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Deferred)
    assert isinstance(result.deferral.trigger, FakeTrigger)
    assert result.deferral.method_name == "execute_complete"
    assert result.deferral.timeout == dt.timedelta(seconds=60)
    assert op.pokes == 1
    fresh = CountingSensor(trigger=True, deferrable=True)
    resumed = run_operator(fresh, _ctx(fresh, event="sensor"), next_method="execute_complete")
    assert resumed == Succeeded(None)


def test_deferrable_sensor_soft_fail_turns_trigger_timeout_into_skip() -> None:
    op = CountingSensor(trigger=True, deferrable=True, soft_fail=True)
    result = run_operator(
        op, _ctx(op), next_method=FAIL_METHOD, next_kwargs={"status": "timed_out", "error": "t"}
    )
    assert isinstance(result, Skipped)


def test_deferrable_sensor_without_trigger_repokes_on_a_timer() -> None:
    op = CountingSensor(succeed_on=3, deferrable=True, poke_interval=5, timeout=60)
    first = run_operator(op, _ctx(op))
    assert isinstance(first, Deferred)
    assert first.deferral.method_name == "resume_poke"
    classpath, _ = first.deferral.trigger.serialize()
    assert classpath == "deferline.engine.triggers.DateTimeTrigger"
    started = first.deferral.kwargs["first_poke_at"]
    # A fresh instance pokes again (pokes reset: 1 < 3) and defers again.
    again = CountingSensor(succeed_on=3, deferrable=True, poke_interval=5, timeout=60)
    second = run_operator(
        again, _ctx(again), next_method="resume_poke", next_kwargs={"first_poke_at": started}
    )
    assert isinstance(second, Deferred)
    assert second.deferral.kwargs == {"first_poke_at": started}
    # Past the timeout, the next failed poke fails the sensor.
    late = CountingSensor(succeed_on=3, deferrable=True, poke_interval=5, timeout=60)
    long_ago = started - dt.timedelta(minutes=5)
    timed_out = run_operator(
        late, _ctx(late), next_method="resume_poke", next_kwargs={"first_poke_at": long_ago}
    )
    assert isinstance(timed_out, Failed)
    assert timed_out.error_type == "SensorTimeout"
    ready = CountingSensor(succeed_on=1, deferrable=True)
    assert run_operator(
        ready, _ctx(ready), next_method="resume_poke", next_kwargs={"first_poke_at": started}
    ) == Succeeded(None)


def test_reschedule_mode_behaves_like_deferrable_without_trigger() -> None:
    op = CountingSensor(succeed_on=5, mode="reschedule", poke_interval=1)
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Deferred)
    assert result.deferral.method_name == "resume_poke"


def test_sensor_rejects_bad_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        CountingSensor(mode="wait")


def test_datetime_sensor_switch() -> None:
    future = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    deferrable = DateTimeSensor(target_time=future, deferrable=True)
    result = run_operator(deferrable, _ctx(deferrable))
    assert isinstance(result, Deferred)
    assert result.deferral.trigger.serialize()[1]["moment"] == future
    past = DateTimeSensor(target_time=future - dt.timedelta(hours=2), deferrable=False)
    assert run_operator(past, _ctx(past)) == Succeeded(None)


# -- start_from_trigger / end_from_trigger -------------------------------------------------


def test_start_from_trigger_defers_without_calling_execute() -> None:
    class Starter(BaseOperator):
        start_from_trigger = True
        start_trigger_args = StartTriggerArgs(
            trigger_cls="deferline.engine.triggers.DateTimeTrigger",
            trigger_kwargs={"moment": NOW},
            next_method="finish",
            next_kwargs={"k": 1},
            timeout=dt.timedelta(seconds=9),
        )

        def execute(self, context: Context) -> Any:
            raise AssertionError("execute must not run")

    op = Starter()
    deferral = start_deferral(op)
    assert deferral is not None
    assert deferral.trigger.serialize() == (
        "deferline.engine.triggers.DateTimeTrigger",
        {"moment": NOW},
    )
    assert deferral.method_name == "finish"
    assert deferral.kwargs == {"k": 1}
    assert deferral.timeout == dt.timedelta(seconds=9)
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Deferred)
    assert result.deferral.method_name == "finish"
    assert start_deferral(BaseOperator()) is None


def test_start_trigger_args_per_instance_does_not_touch_the_class() -> None:
    op = StartFromTriggerWaitOperator(seconds=30)
    assert StartFromTriggerWaitOperator.start_trigger_args is not None
    assert StartFromTriggerWaitOperator.start_trigger_args.trigger_kwargs is None
    assert op.start_trigger_args is not None
    assert "moment" in (op.start_trigger_args.trigger_kwargs or {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.start_trigger_args.next_method = "x"  # type: ignore[misc]


def test_end_from_trigger_is_carried_into_the_request() -> None:
    op = WaitOperator(seconds=1, end_from_trigger=True)
    result = run_operator(op, _ctx(op))
    assert isinstance(result, Deferred)
    assert result.deferral.end_from_trigger is True
    _, request = deferral_records(TASK, result.deferral, defer_seq=0, resume=None)
    assert request.end_from_trigger is True
    assert request.kwargs["end_from_trigger"] is True


# -- loading -------------------------------------------------------------------------------

ALLOWED = ["deferline.engine.examples"]


def test_load_operator_builds_a_fresh_instance_with_task_id() -> None:
    op = load_operator(
        "deferline.engine.examples.WaitOperator",
        {"seconds": 1, "result": "r"},
        task_id="tid",
        allowed_prefixes=ALLOWED,
    )
    assert isinstance(op, WaitOperator)
    assert op.task_id == "tid"
    assert op.result == "r"


def test_load_operator_refuses_outside_prefixes_and_non_operators() -> None:
    with pytest.raises(OperatorNotAllowed):
        import_operator("os.path.join", allowed_prefixes=ALLOWED)
    with pytest.raises(OperatorNotAllowed):
        import_operator("deferline.engine.examplesX.Op", allowed_prefixes=ALLOWED)
    with pytest.raises(OperatorNotAllowed, match="not a BaseOperator"):
        import_operator("deferline.engine.examples.utcnow", allowed_prefixes=ALLOWED)
    with pytest.raises(OperatorImportError):
        import_operator("deferline.engine.examples.Missing", allowed_prefixes=ALLOWED)
    with pytest.raises(OperatorImportError):
        import_operator("nodots", allowed_prefixes=ALLOWED)
    with pytest.raises(OperatorImportError):
        import_operator(
            "deferline.engine.examples_missing.Op", allowed_prefixes=["deferline.engine"]
        )


def test_load_operator_reports_bad_kwargs() -> None:
    with pytest.raises(OperatorKwargsError, match="rejected its kwargs"):
        load_operator(
            "deferline.engine.examples.WaitOperator",
            {"nope": 1},
            task_id="t",
            allowed_prefixes=ALLOWED,
        )
