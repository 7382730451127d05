"""The timer fast path: pure-deadline triggers live in one shared heap, not a coroutine each."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from deferline.engine import (
    BaseTrigger,
    TaskSkippedEvent,
    TimerSpec,
    TriggerEvent,
    TriggerSupervisor,
)
from deferline.engine.testing import AT_DEADLINE, Timer
from deferline.engine.triggers import DateTimeTrigger, TimeDeltaTrigger
from deferline.schemas import make_event_id

from tests._until import until

from ._support import GateTrigger, Sink


def _in(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
async def sup(sink: Sink) -> AsyncIterator[TriggerSupervisor]:
    async with TriggerSupervisor(capacity=1000, on_event=sink, block_threshold=None) as s:
        yield s


async def test_timers_of_a_burst_share_their_due_time_each_with_its_own_event_id(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    """The due time and its canonical JSON are computed once per deadline; every timer
    still gets the id of its own trigger id and the payload of its own moment."""
    first, second = _in(0.05), _in(0.08)
    for i in range(3):
        sup.add(f"a{i}", DateTimeTrigger(first))
    sup.add("b", DateTimeTrigger(second))
    await until(lambda: sup.running == 0)
    for tid, moment in [("a0", first), ("a1", first), ("a2", first), ("b", second)]:
        out = sink.one(tid)
        assert out.payload == moment
        assert out.due_at == moment
        assert out.event_id == make_event_id(tid, "fired", moment)
    assert len({sink.one(t).event_id for t in ("a0", "a1", "a2", "b")}) == 4


async def test_a_timer_keeps_its_moment_where_the_epoch_float_cannot_hold_it(
    sup: TriggerSupervisor,
) -> None:
    """A waiting timer rebuilds its payload from the epoch float only where that gives the
    moment back to the microsecond (up to the year 2106); later moments are kept as given."""
    near = dt.datetime(2105, 6, 1, 12, 0, 0, 123457, tzinfo=dt.UTC)
    far = dt.datetime(9000, 1, 1, 0, 0, 0, 1, tzinfo=dt.UTC)
    assert dt.datetime.fromtimestamp(far.timestamp(), dt.UTC) != far
    sup.add("near", DateTimeTrigger(near))
    sup.add("far", DateTimeTrigger(far))
    waiting = sup._slots.entries["near"], sup._slots.entries["far"]
    assert isinstance(waiting[0], Timer)
    assert isinstance(waiting[1], Timer)
    assert waiting[0].payload is AT_DEADLINE  # rebuilt from the deadline when it fires
    assert dt.datetime.fromtimestamp(waiting[0].deadline, dt.UTC) == near
    assert waiting[1].payload is far


async def test_datetime_trigger_waits_in_the_heap_and_fires_at_its_moment(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    moment = _in(0.05)
    sup.add("dt", DateTimeTrigger(moment), context="ctx")
    assert sup.waiting_timers == 1
    assert sup.running == 1
    assert not any(t.get_name().startswith("deferline-trigger") for t in asyncio.all_tasks())
    await until(lambda: "dt" not in sup)
    out = sink.one("dt")
    assert out.status == "fired"
    assert out.final
    assert out.context == "ctx"
    assert out.payload == moment
    assert out.due_at == moment
    assert out.fired_at is not None
    assert out.fired_at >= moment
    assert out.event_id == make_event_id("dt", "fired", moment)
    assert sup.waiting_timers == 0
    assert sup.running == 0
    assert sup.metrics.fired == 1
    assert sup.metrics.fire_lag.count == 1


async def test_timedelta_and_end_from_trigger(sup: TriggerSupervisor, sink: Sink) -> None:
    sup.add("td", TimeDeltaTrigger(dt.timedelta(milliseconds=10), end_from_trigger=True))
    assert sup.waiting_timers == 1
    await until(lambda: "td" not in sup)
    out = sink.one("td")
    assert (out.status, out.payload, out.task_outcome, out.xcoms) == (
        "fired",
        "success",
        "success",
        None,
    )


async def test_timers_fire_in_due_order(sup: TriggerSupervisor, sink: Sink) -> None:
    base = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=10)
    for i in (3, 1, 4, 0, 2):
        sup.add(f"t{i}", DateTimeTrigger(base + dt.timedelta(seconds=i)))
    await until(lambda: len(sup) == 0)
    assert [o.trigger_id for o in sink.outcomes] == ["t0", "t1", "t2", "t3", "t4"]


async def test_timeout_before_the_moment_times_out(sup: TriggerSupervisor, sink: Sink) -> None:
    timeout_at = _in(0.02)
    sup.add("t", DateTimeTrigger(_in(3600)), timeout_at=timeout_at)
    assert sup.waiting_timers == 1
    await until(lambda: "t" not in sup)
    out = sink.one("t")
    assert out.status == "timed_out"
    assert out.due_at == timeout_at


async def test_timeout_after_the_moment_does_not_matter(sup: TriggerSupervisor, sink: Sink) -> None:
    sup.add("t", DateTimeTrigger(_in(0.01)), timeout_at=_in(0.02))
    await until(lambda: "t" not in sup)
    await until(lambda: sup._deadlines.first() is None)
    assert [o.status for o in sink.outcomes] == ["fired"]


async def test_cancelled_timer_never_fires_and_frees_capacity(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    sup.add("t", DateTimeTrigger(_in(0.02)))
    assert await sup.cancel("t") is True
    assert sup.running == 0
    assert sup.waiting_timers == 0
    assert sup.metrics.cancelled == 1
    await until(lambda: sup._deadlines.first() is None)
    assert sink.outcomes == []
    # The same id may be added again (e.g. after a rebalance) and then fires once.
    sup.add("t", DateTimeTrigger(_in(0.0)))
    await until(lambda: "t" not in sup)
    assert len(sink.of("t")) == 1


async def test_timers_count_toward_capacity(sink: Sink) -> None:
    async with TriggerSupervisor(capacity=1, on_event=sink, block_threshold=None) as sup:
        sup.add("timer", DateTimeTrigger(_in(0.03)))
        gate = GateTrigger()
        sup.add("coro", gate)
        assert sup.pending == 1
        assert sup.capacity_left == 0
        await gate.started.wait()  # admitted once the timer fired
        assert sink.one("timer").status == "fired"
        gate.gate.set()
        await until(lambda: len(sup) == 0)


async def test_pending_timer_is_admitted_into_the_heap(sink: Sink) -> None:
    async with TriggerSupervisor(capacity=1, on_event=sink, block_threshold=None) as sup:
        gate = GateTrigger()
        sup.add("coro", gate)
        sup.add("timer", DateTimeTrigger(_in(-1)), timeout_at=_in(3600))
        assert sup.pending == 1
        gate.gate.set()
        await until(lambda: len(sup) == 0)
        assert [o.trigger_id for o in sink.outcomes] == ["coro", "timer"]
        assert sink.one("timer").status == "fired"


class Deadline(BaseTrigger):
    """A custom trigger declaring a pure deadline through the documented hook."""

    def __init__(self, at: dt.datetime, payload: Any) -> None:
        super().__init__()
        self.at = at
        self.payload = payload
        self.ran = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.engine.test_timers.Deadline", {"at": self.at, "payload": self.payload})

    def as_timer(self) -> TimerSpec:
        return TimerSpec(
            self.at, TaskSkippedEvent() if self.payload is None else TriggerEvent(self.payload)
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.ran = True
        yield TriggerEvent(self.payload)


async def test_custom_trigger_declaring_a_deadline_uses_the_fast_path(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    trigger = Deadline(_in(0.01), {"batch": 7})
    sup.add("custom", trigger)
    skip = Deadline(_in(0.01), None)
    sup.add("skip", skip)
    assert sup.waiting_timers == 2
    await until(lambda: len(sup) == 0)
    assert sink.one("custom").payload == {"batch": 7}
    assert sink.one("skip").task_outcome == "skipped"
    assert not trigger.ran
    assert not skip.ran


async def test_subclass_overriding_run_is_not_treated_as_a_timer(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    class Custom(DateTimeTrigger):
        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TriggerEvent("custom run")

    class CustomCleanup(DateTimeTrigger):
        cleaned = False

        async def cleanup(self) -> None:
            CustomCleanup.cleaned = True

    sup.add("c", Custom(_in(3600)))
    sup.add("cc", CustomCleanup(_in(-1)))
    assert sup.waiting_timers == 0
    await until(lambda: len(sup) == 0)
    assert sink.one("c").payload == "custom run"
    assert sink.one("cc").status == "fired"
    assert CustomCleanup.cleaned


async def test_as_timer_that_fails_falls_back_to_running(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    class Broken(Deadline):
        def as_timer(self) -> TimerSpec:
            raise RuntimeError("no deadline today")

    class Naive(Deadline):
        def as_timer(self) -> TimerSpec:
            return TimerSpec(dt.datetime(2020, 1, 1), TriggerEvent(1))

    sup.add("broken", Broken(_in(0), "ran"))
    sup.add("naive", Naive(_in(0), "ran too"))
    assert sup.waiting_timers == 0
    await until(lambda: len(sup) == 0)
    assert sink.one("broken").payload == "ran"
    assert sink.one("naive").payload == "ran too"


async def test_a_failing_as_timer_is_reported_once_per_class(
    sup: TriggerSupervisor, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(Deadline):
        def as_timer(self) -> TimerSpec:
            raise RuntimeError("no deadline today")

    caplog.set_level(logging.WARNING, logger="deferline.engine")
    for i in range(3):
        sup.add(f"broken{i}", Broken(_in(0), "ran"))
    await until(lambda: len(sup) == 0)
    warned = [r.getMessage() for r in caplog.records if "as_timer()" in r.getMessage()]
    assert len(warned) == 1
    assert "Broken" in warned[0]
    assert "RuntimeError: no deadline today" in warned[0]
    assert len(sink.outcomes) == 3


async def test_unserializable_timer_payload_fails(sup: TriggerSupervisor, sink: Sink) -> None:
    sup.add("odd", Deadline(_in(0), object()))
    await until(lambda: "odd" not in sup)
    out = sink.one("odd")
    assert out.status == "failed"
    assert out.error is not None
    assert "serialized" in out.error


async def test_many_due_timers_fire_in_slices_keeping_the_loop_responsive(
    sup: TriggerSupervisor, sink: Sink
) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    n = 20_000  # tens of milliseconds of firing even on a fast machine: several slices
    for i in range(n):
        sup.add(f"t{i}", DateTimeTrigger(past))
    seen: list[int] = []

    async def ticker() -> None:
        while len(sink.outcomes) < n:
            seen.append(len(sink.outcomes))
            await asyncio.sleep(0)

    await asyncio.gather(ticker(), until(lambda: len(sink.outcomes) == n, within=30))
    assert len({o.trigger_id for o in sink.outcomes}) == n
    assert sup.metrics.fired == n
    assert sup.running == 0
    # Other work ran between slices: the ticker saw the batch half done.
    assert any(0 < count < n for count in seen)
    assert sup.metrics.fire_lag.count == n
    assert sup.metrics.fire_lag.quantile(0.5) > 0


async def test_timers_added_from_on_event_into_the_firing_bucket_are_not_lost() -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    fired: list[str] = []
    sup: TriggerSupervisor

    def on_event(outcome: Any) -> None:
        fired.append(outcome.trigger_id)
        if outcome.trigger_id.startswith("t") and len(fired) % 500 == 0:
            sup.add(f"again{len(fired)}", DateTimeTrigger(past))  # same millisecond bucket

    async with TriggerSupervisor(capacity=10_000, on_event=on_event, block_threshold=None) as sup:
        for i in range(3000):
            sup.add(f"t{i}", DateTimeTrigger(past))
        await until(lambda: len(sup) == 0, within=30)
    assert len(fired) == len(set(fired)) == 3006
    assert fired[:3000] == [f"t{i}" for i in range(3000)]  # one bucket fires in add order


async def test_cancelled_timers_do_not_linger_in_the_heap(
    sup: TriggerSupervisor, sink: Sink, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("deferline.engine._timer_heap._COMPACT_MIN", 10)
    far = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
    for i in range(40):
        sup.add(f"t{i}", DateTimeTrigger(far + dt.timedelta(seconds=i)))
    for i in range(30):
        assert await sup.cancel(f"t{i}")
    # Rebuilt once stale entries outnumbered live ones: only live timers remain queued.
    assert len(sup._deadlines._buckets) < 40
    assert set(sup._deadlines._buckets.values()) <= {f"t{i}" for i in range(40)}
    assert {f"t{i}" for i in range(30, 40)} <= set(sup._deadlines._buckets.values())
    sup.add("now", DateTimeTrigger(dt.datetime.now(dt.UTC)))
    await until(lambda: "now" not in sup)
    assert [o.trigger_id for o in sink.outcomes] == ["now"]
    assert sup.waiting_timers == 10


async def test_held_timers_wait_in_order_and_fire_once_released(sink: Sink) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
    sup: TriggerSupervisor

    def on_event(outcome: Any) -> None:
        sink(outcome)
        if len(sink.outcomes) == 100:
            sup.hold_timers(True)  # as a full producer queue does, mid-slice

    async with TriggerSupervisor(capacity=10_000, on_event=on_event, block_threshold=None) as sup:
        for i in range(1000):
            sup.add(f"t{i:04}", DateTimeTrigger(past + dt.timedelta(milliseconds=i % 7)))
        await until(lambda: len(sink.outcomes) >= 100)
        for _ in range(20):  # the loop runs; nothing more fires while held
            await asyncio.sleep(0.005)
        assert len(sink.outcomes) == 100
        assert sup.timers_held
        assert sup.waiting_timers == 900
        sup.hold_timers(False)
        await until(lambda: len(sink.outcomes) == 1000)
    fired = [o.trigger_id for o in sink.outcomes]
    assert len(set(fired)) == 1000
    expected = sorted((i % 7, f"t{i:04}") for i in range(1000))  # due order, then add order
    assert fired == [tid for _, tid in expected]


async def test_timers_added_while_held_fire_after_release(sink: Sink) -> None:
    async with TriggerSupervisor(capacity=100, on_event=sink, block_threshold=None) as sup:
        sup.hold_timers(True)
        sup.add("late", DateTimeTrigger(_in(-1)))
        for _ in range(10):
            await asyncio.sleep(0.005)
        assert sink.outcomes == []
        sup.hold_timers(False)
        await until(lambda: len(sink.outcomes) == 1)
    assert sink.one("late").status == "fired"
