"""The supervisor's rules for coroutine triggers: events, failures, cleanup, cancellation."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from deferline.engine import (
    BaseTrigger,
    SupervisorError,
    TaskSuccessEvent,
    TriggerEvent,
    TriggerSupervisor,
)
from deferline.engine.triggers import DateTimeTrigger
from deferline.schemas import make_event_id

from tests._until import until

from ._support import (
    EmptyTrigger,
    GateTrigger,
    MultiTrigger,
    RaisingTrigger,
    Sink,
    _TestTrigger,
)


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
async def sup(sink: Sink) -> AsyncIterator[TriggerSupervisor]:
    supervisor = TriggerSupervisor(
        capacity=100, on_event=sink, cleanup_timeout=0.2, block_threshold=None
    )
    async with supervisor:
        yield supervisor


async def test_event_becomes_final_fired_outcome_with_deterministic_id(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = GateTrigger({"rows": 3})
    ctx = object()
    assert sup.add("t1", trigger, context=ctx)
    await trigger.started.wait()
    assert trigger.trigger_id == "t1"  # set before run(), as Airflow does
    assert "t1" in sup
    assert sup.running == 1
    assert sink.outcomes == []
    trigger.gate.set()
    await until(lambda: "t1" not in sup)
    out = sink.one("t1")
    assert out.status == "fired"
    assert out.final
    assert out.payload == {"rows": 3}
    assert out.event_id == make_event_id("t1", "fired", {"rows": 3})
    assert out.context is ctx
    assert out.fired_at is not None
    assert out.due_at is None
    assert trigger.cleaned.is_set()
    assert sup.running == 0
    assert sup.metrics.fired == 1


async def test_exception_becomes_failed_outcome_with_traceback(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = RaisingTrigger()
    sup.add("boom", trigger)
    await until(lambda: "boom" not in sup)
    out = sink.one("boom")
    assert out.status == "failed"
    assert out.final
    assert out.error == "RuntimeError: sensor exploded"
    assert out.traceback is not None
    assert 'raise RuntimeError("sensor exploded")' in out.traceback
    assert out.event_id == make_event_id("boom", "failed", None)
    assert trigger.cleaned
    assert sup.metrics.failed == 1


async def test_run_returning_without_an_event_is_a_failure(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    sup.add("empty", EmptyTrigger())
    await until(lambda: "empty" not in sup)
    out = sink.one("empty")
    assert out.status == "failed"
    assert out.final
    assert out.error is not None
    assert "returned without yielding an event" in out.error
    assert "EmptyTrigger" in out.error


class CoroutineRun(_TestTrigger):
    async def run(self) -> None:  # type: ignore[override]  # the mistake under test
        return None


class YieldsNonEvent(_TestTrigger):
    async def run(self) -> AsyncIterator[Any]:
        yield {"not": "an event"}


class YieldsUnserializable(_TestTrigger):
    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(object())


@pytest.mark.parametrize(
    ("trigger_cls", "message"),
    [
        (CoroutineRun, "must be an async generator"),
        (YieldsNonEvent, "yielded dict, not a TriggerEvent"),
        (YieldsUnserializable, "cannot be serialized"),
    ],
)
async def test_contract_violations_fail_with_a_clear_error(
    sup: TriggerSupervisor, sink: Sink, trigger_cls: type[BaseTrigger], message: str
) -> None:
    sup.add("bad", trigger_cls())
    await until(lambda: "bad" not in sup)
    out = sink.one("bad")
    assert out.status == "failed"
    assert out.error is not None
    assert message in out.error


async def test_end_from_trigger_event_carries_task_outcome_and_xcoms(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    class Ends(_TestTrigger):
        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TaskSuccessEvent(xcoms={"return_value": 42})

    sup.add("end", Ends())
    await until(lambda: "end" not in sup)
    out = sink.one("end")
    assert out.status == "fired"
    assert out.task_outcome == "success"
    assert out.payload == "success"
    assert out.xcoms == {"return_value": 42}


async def test_default_stops_after_first_event_and_closes_the_generator(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = MultiTrigger(0, loop_forever=True)  # relies on being stopped, as in Airflow
    sup.add("once", trigger)
    await until(lambda: "once" not in sup)
    assert [(o.payload, o.final) for o in sink.of("once")] == [({"n": 0}, True)]
    assert trigger.closed
    assert trigger.cleaned


async def test_max_events_stops_after_that_many(sup: TriggerSupervisor, sink: Sink) -> None:
    trigger = MultiTrigger(0, loop_forever=True)
    sup.add("two", trigger, max_events=2)
    await until(lambda: "two" not in sup)
    assert [(o.payload, o.final) for o in sink.of("two")] == [({"n": 0}, False), ({"n": 1}, True)]
    assert trigger.closed
    assert trigger.cleaned


async def test_multi_event_trigger_each_event_has_its_own_id_and_last_is_final(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = MultiTrigger(3)
    sup.add("multi", trigger, max_events=None)
    await until(lambda: "multi" not in sup)
    outs = sink.of("multi")
    assert [o.payload for o in outs] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [o.final for o in outs] == [False, False, True]
    assert len({o.event_id for o in outs}) == 3
    assert outs[1].event_id == make_event_id("multi", "fired", {"n": 1})
    assert trigger.cleaned
    assert sup.metrics.fired == 3


async def test_multi_event_trigger_that_returns_later_emits_nothing_more(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = MultiTrigger(2, pause_at_end=True)
    sup.add("later", trigger, max_events=None)
    await until(lambda: len(sink.of("later")) == 2)
    assert [o.final for o in sink.of("later")] == [False, False]
    trigger.end_gate.set()
    await until(lambda: "later" not in sup)
    assert len(sink.of("later")) == 2
    assert trigger.cleaned


async def test_failure_after_events_is_final(sup: TriggerSupervisor, sink: Sink) -> None:
    class FailsSecond(_TestTrigger):
        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TriggerEvent(1)
            await asyncio.sleep(0.001)
            raise ValueError("second poll failed")

    sup.add("fs", FailsSecond(), max_events=None)
    await until(lambda: "fs" not in sup)
    assert [(o.status, o.final) for o in sink.of("fs")] == [("fired", False), ("failed", True)]


async def test_cancel_stops_runs_cleanup_and_emits_nothing(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = GateTrigger()
    sup.add("c", trigger)
    await trigger.started.wait()
    assert await sup.cancel("c") is True
    assert trigger.cleaned.is_set()  # awaited before cancel() returned
    assert "c" not in sup
    assert sup.running == 0
    assert sink.outcomes == []
    assert sup.metrics.cancelled == 1
    assert await sup.cancel("c") is False
    assert await sup.cancel("never-added") is False


class IgnoresCancellation(_TestTrigger):
    """Swallows cancellation until released (a badly written trigger)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.cleaned = False

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.started.set()
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        yield TriggerEvent("late")

    async def cleanup(self) -> None:
        self.cleaned = True


async def test_trigger_ignoring_cancellation_is_bounded_and_abandoned(
    sup: TriggerSupervisor, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    trigger = IgnoresCancellation()
    sup.add("stubborn", trigger)
    await trigger.started.wait()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await sup.cancel("stubborn")
    assert loop.time() - started < 2.0  # bounded by cleanup_timeout (0.2 s), not forever
    assert "stubborn" not in sup
    assert sup.running == 0
    assert trigger.cleaned  # cleanup still awaited
    assert sup.metrics.abandoned == 1
    assert any("ignored cancellation" in r.getMessage() for r in caplog.records)
    trigger.release.set()  # the zombie now yields: nothing may be emitted
    await until(lambda: not sup._runner._abandoned)
    assert sink.outcomes == []


class HangingCleanup(_TestTrigger):
    def __init__(self, *, swallow_cancel: bool) -> None:
        super().__init__()
        self.swallow_cancel = swallow_cancel
        self.forever = asyncio.Event()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("done")

    async def cleanup(self) -> None:
        while True:
            try:
                await self.forever.wait()
                return
            except asyncio.CancelledError:
                if not self.swallow_cancel:
                    raise


@pytest.mark.parametrize("swallow_cancel", [False, True])
async def test_hanging_cleanup_is_abandoned_after_cleanup_timeout(
    sup: TriggerSupervisor, sink: Sink, caplog: pytest.LogCaptureFixture, swallow_cancel: bool
) -> None:
    trigger = HangingCleanup(swallow_cancel=swallow_cancel)
    sup.add("hang", trigger)
    await until(lambda: "hang" not in sup, within=3.0)
    assert sink.one("hang").status == "fired"  # the event went out before cleanup
    assert sup.metrics.abandoned == 1
    assert sup.running == 0
    assert any(
        "cleanup()" in r.getMessage() and "abandoned" in r.getMessage() for r in caplog.records
    )
    trigger.forever.set()
    await until(lambda: not sup._runner._abandoned)


async def test_cleanup_that_raises_is_logged_not_fatal(
    sup: TriggerSupervisor, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    class BadCleanup(_TestTrigger):
        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TriggerEvent("x")

        async def cleanup(self) -> None:
            raise OSError("socket already closed")

    sup.add("bc", BadCleanup())
    await until(lambda: "bc" not in sup)
    assert sink.one("bc").status == "fired"
    assert any("cleanup() of" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_timeout_gives_timed_out_outcome_and_cleans_up(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = GateTrigger()
    timeout_at = _utcnow_plus(0.05)
    sup.add("slow", trigger, timeout_at=timeout_at)
    await until(lambda: "slow" not in sup)
    out = sink.one("slow")
    assert out.status == "timed_out"
    assert out.final
    assert out.payload is None
    assert out.due_at == timeout_at
    assert out.fired_at is not None
    assert out.fired_at >= timeout_at
    assert out.event_id == make_event_id("slow", "timed_out", None)
    assert trigger.cleaned.is_set()
    assert sup.metrics.timed_out == 1
    assert sup.metrics.fire_lag.count == 1


async def test_timeout_in_the_past_times_out_without_running(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = GateTrigger()
    sup.add("late", trigger, timeout_at=_utcnow_plus(-5))
    await until(lambda: "late" not in sup)
    assert sink.one("late").status == "timed_out"
    assert not trigger.started.is_set()


async def test_trigger_that_fires_before_its_timeout_does_not_time_out(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = GateTrigger()
    sup.add("quick", trigger, timeout_at=_utcnow_plus(0.1))
    trigger.gate.set()
    await until(lambda: "quick" not in sup)
    await until(
        lambda: sup._deadlines.first() is None
    )  # the stale timeout entry came due and was dropped
    assert [o.status for o in sink.of("quick")] == ["fired"]


async def test_capacity_queues_triggers_in_order(sink: Sink) -> None:
    order: list[str] = []
    async with TriggerSupervisor(capacity=2, on_event=sink, block_threshold=None) as sup:
        triggers = {name: GateTrigger(name, log=order) for name in "abcde"}
        for name, trigger in triggers.items():
            sup.add(name, trigger)
        await until(lambda: len(order) == 2)
        assert (sup.running, sup.pending, sup.capacity_left) == (2, 3, 0)
        assert sup.metrics.pending == 3
        assert sup.metrics.capacity_left == 0
        for name in "abcde":
            triggers[name].gate.set()
            await until(lambda name=name: name not in sup)  # type: ignore[misc]
        assert order == [f"start:{n}" for n in "abcde"]
        assert [o.trigger_id for o in sink.outcomes] == list("abcde")
        assert (sup.running, sup.pending, sup.capacity_left) == (0, 0, 2)


async def test_pending_triggers_can_be_cancelled_and_time_out(sink: Sink) -> None:
    async with TriggerSupervisor(capacity=1, on_event=sink, block_threshold=None) as sup:
        first = GateTrigger("first")
        sup.add("first", first)
        waiting, doomed = GateTrigger("waiting"), GateTrigger("doomed")
        sup.add("waiting", waiting)
        sup.add("doomed", doomed, timeout_at=_utcnow_plus(0.03))
        assert sup.pending == 2
        assert await sup.cancel("waiting")
        await until(lambda: "doomed" not in sup)
        assert sink.one("doomed").status == "timed_out"
        assert sup.pending == 0
        assert sup.metrics.cancelled == 1
        first.gate.set()
        await until(lambda: "first" not in sup)
        assert not waiting.started.is_set()
        assert not doomed.started.is_set()


async def test_cancel_many_drops_timers_and_pending_and_stops_runs_without_emitting(
    sink: Sink,
) -> None:
    async with TriggerSupervisor(capacity=3, on_event=sink, block_threshold=None) as sup:
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        sup.add("t1", DateTimeTrigger(later))
        sup.add("t2", DateTimeTrigger(later))
        run = GateTrigger("run")
        sup.add("run", run)
        pending = GateTrigger("pending")
        sup.add("pending", pending)
        await run.started.wait()
        assert (sup.waiting_timers, sup.pending) == (2, 1)
        count = await sup.cancel_many(["t1", "run", "unknown", "pending", "t2"])
        assert count == 4
        assert run.cleaned.is_set()  # awaited before cancel_many() returned
        assert len(sup) == 0
        assert (sup.running, sup.waiting_timers, sup.pending) == (0, 0, 0)
        assert not pending.started.is_set()
        assert sup.metrics.cancelled == 4
        assert sink.outcomes == []


async def test_add_rules(sup: TriggerSupervisor) -> None:
    trigger = GateTrigger()
    assert sup.add("dup", trigger) is True
    assert sup.add("dup", GateTrigger()) is False
    with pytest.raises(TypeError):
        sup.add("x", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timezone-aware"):
        sup.add("y", GateTrigger(), timeout_at=_utcnow_plus(1).replace(tzinfo=None))
    with pytest.raises(ValueError, match="max_events"):
        sup.add("z", GateTrigger(), max_events=0)


async def test_lifecycle_errors_and_idempotent_stop(sink: Sink) -> None:
    sup = TriggerSupervisor(capacity=1, on_event=sink)
    with pytest.raises(SupervisorError):
        sup.add("early", GateTrigger())
    await sup.start()
    with pytest.raises(SupervisorError):
        await sup.start()
    await sup.stop()
    await sup.stop()
    with pytest.raises(SupervisorError):
        sup.add("late", GateTrigger())
    with pytest.raises(ValueError, match="capacity"):
        TriggerSupervisor(capacity=0, on_event=sink)


async def test_stop_cancels_and_cleans_up_everything_without_emitting(sink: Sink) -> None:
    sup = TriggerSupervisor(capacity=2, on_event=sink, cleanup_timeout=0.2)
    await sup.start()
    running = [GateTrigger(), GateTrigger()]
    for i, trigger in enumerate(running):
        sup.add(f"r{i}", trigger)
    sup.add("pending", GateTrigger())
    await asyncio.gather(*(t.started.wait() for t in running))
    await sup.stop()
    assert all(t.cleaned.is_set() for t in running)
    assert sink.outcomes == []
    assert len(sup) == 0


async def test_on_event_errors_are_counted_not_propagated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    def flaky(outcome: Any) -> None:
        calls.append(outcome.trigger_id)
        if outcome.trigger_id == "a":
            raise RuntimeError("producer buffer full")

    async with TriggerSupervisor(capacity=5, on_event=flaky, block_threshold=None) as sup:
        a, b = GateTrigger(), GateTrigger()
        sup.add("a", a)
        sup.add("b", b)
        a.gate.set()
        b.gate.set()
        await until(lambda: len(sup) == 0)
        assert sorted(calls) == ["a", "b"]
        assert sup.metrics.callback_errors == 1


@dataclass
class RunnerContext:
    task: str
    partition: int
    member: str


async def test_log_lines_carry_trigger_task_partition_and_member(
    sup: TriggerSupervisor, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deferline.engine")
    sup.add("ctx", RaisingTrigger(), context=RunnerContext("dag/task/run/-1#1", 7, "m-1"))
    await until(lambda: "ctx" not in sup)
    record = next(r for r in caplog.records if "trigger failed" in r.getMessage())
    assert record.__dict__["trigger_id"] == "ctx"
    assert record.__dict__["task"] == "dag/task/run/-1#1"
    assert record.__dict__["partition"] == 7
    assert record.__dict__["member"] == "m-1"


async def test_reject_emits_a_failed_outcome(sup: TriggerSupervisor, sink: Sink) -> None:
    sup.reject("r", ValueError("kwargs undecryptable"), context="ctx")
    out = sink.one("r")
    assert out.status == "failed"
    assert out.final
    assert out.context == "ctx"
    assert out.error == "ValueError: kwargs undecryptable"
    assert out.event_id == make_event_id("r", "failed", None)


def _utcnow_plus(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


class HangsWhenClosed(_TestTrigger):
    """Its finally block waits forever when the supervisor closes run() after the event."""

    def __init__(self) -> None:
        super().__init__()
        self.forever = asyncio.Event()
        self.cleaned = False

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            yield TriggerEvent("x")
        finally:
            await self.forever.wait()

    async def cleanup(self) -> None:
        self.cleaned = True


async def test_closing_a_run_that_hangs_in_finally_is_bounded(
    sup: TriggerSupervisor, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    trigger = HangsWhenClosed()
    sup.add("close", trigger)
    await until(lambda: "close" not in sup, within=3.0)
    assert [(o.status, o.final) for o in sink.of("close")] == [("fired", True)]
    assert trigger.cleaned
    assert sup.running == 0
    assert any("closing run() of" in r.getMessage() for r in caplog.records)


async def test_a_compaction_while_a_run_closes_keeps_its_close_bound(sink: Sink) -> None:
    """A mass cancel rebuilds the timer heap; the close bound of a run still closing after
    its last event is live and survives the rebuild, so a hanging ``finally`` is abandoned
    after ``cleanup_timeout`` and gives its slot back."""
    far = _utcnow_plus(3600)
    count = 10_001  # more stale entries than the heap tolerates before it is rebuilt
    async with TriggerSupervisor(
        capacity=count + 1, on_event=sink, cleanup_timeout=0.2, block_threshold=None
    ) as sup:
        trigger = HangsWhenClosed()
        sup.add("close", trigger)
        await until(lambda: bool(sink.of("close")))  # fired: now closing run()
        ids = [f"t{i}" for i in range(count)]
        for tid in ids:
            sup.add(tid, DateTimeTrigger(far))
        assert await sup.cancel_many(ids) == count
        await until(lambda: "close" not in sup, within=3.0)
        assert sup.running == 0
        assert trigger.cleaned
        assert [(o.status, o.final) for o in sink.outcomes] == [("fired", True)]
