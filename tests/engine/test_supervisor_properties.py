"""Property tests of the supervisor's parts: the deadline heap, the slot book, and the
supervisor's promise that each trigger ends with exactly one outcome, or none after a cancel."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from collections.abc import AsyncIterator

from deferline.engine import TriggerEvent, TriggerOutcome, TriggerSupervisor
from deferline.engine.testing import DeadlineHeap, Expiry, Queued, Run, SlotBook, Timer
from deferline.engine.triggers import DateTimeTrigger
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests._until import until

from ._support import _TestTrigger

_IDS = st.sampled_from([f"t{i}" for i in range(12)])


class DeadlineHeapMachine(RuleBasedStateMachine):
    """The heap against a model of its owner's book (id → live deadline), as the supervisor
    uses it: popped ids are checked against the book, cancels are reported with ``forget``,
    a rebuild gets the live entries, and a slice puts the rest of its bucket back."""

    def __init__(self) -> None:
        super().__init__()
        self.heap = DeadlineHeap()
        self.live: dict[str, float] = {}
        self.now_ms = 0
        self.fired: list[str] = []
        self.expected: list[str] = []  # every id made live, once per time it was

    def _valid(self, key: int, tid: str) -> bool:
        deadline = self.live.get(tid)
        return deadline is not None and math.ceil(deadline * 1000.0) == key

    def _handle(self, key: int, tid: str) -> None:
        if not self._valid(key, tid):
            return  # stale
        assert key <= self.now_ms, "an entry popped before its millisecond"
        others = [math.ceil(d * 1000.0) for t, d in self.live.items() if t != tid]
        assert all(key <= other for other in others), "a live entry was overtaken"
        del self.live[tid]
        self.fired.append(tid)

    @rule(tid=_IDS, offset=st.integers(min_value=-5, max_value=40), fraction=st.booleans())
    def push(self, tid: str, offset: int, fraction: bool) -> None:
        """Add a trigger, or re-add one with another deadline (its old entry goes stale)."""
        self._push(tid, (self.now_ms + offset - (0.5 if fraction else 0.0)) / 1000.0)

    def _push(self, tid: str, deadline: float) -> None:
        if tid not in self.live:
            self.expected.append(tid)
        self.live[tid] = deadline
        self.heap.push(deadline, tid)

    @rule(tid=_IDS)
    def cancel(self, tid: str) -> None:
        if self.live.pop(tid, None) is None:
            return
        self.expected.remove(tid)
        if self.heap.forget(len(self.live)):
            self.heap.rebuild(list(self.live.items()))

    @rule(tid=_IDS)
    def rebuild(self, tid: str) -> None:
        """A rebuild at any moment keeps every live entry (here: after cancelling ``tid``)."""
        self.cancel(tid)
        self.heap.rebuild(list(self.live.items()))

    @rule(
        advance=st.integers(min_value=0, max_value=30),
        per_slice=st.integers(min_value=1, max_value=4),
        added=st.lists(st.tuples(_IDS, st.booleans()), max_size=3),
    )
    def fire(self, advance: int, per_slice: int, added: list[tuple[str, bool]]) -> None:
        """Fire one slice of what is due: ``per_slice`` ids, the rest of the bucket put back,
        with triggers added meanwhile (from ``on_event``), into the millisecond being fired
        (True) or later."""
        self.now_ms += advance
        handled = 0
        while (due := self.heap.pop_due(self.now_ms)) is not None:
            key, tids, start = due
            for index in range(start, len(tids)):
                self._handle(key, tids[index])
                handled += 1
                if handled == per_slice:
                    for new, same in added:
                        self._push(new, key / 1000.0 if same else (self.now_ms + 5) / 1000.0)
                    self.heap.requeue(key, tids, index + 1)
                    return

    @invariant()
    def nothing_due_is_left_behind_unseen(self) -> None:
        assert self.heap.first() is not None or not self.live, (
            "a live entry is missing from the heap"
        )

    def teardown(self) -> None:
        self.now_ms = 10**9
        while (due := self.heap.pop_due(self.now_ms)) is not None:
            key, tids, start = due
            for tid in tids[start:]:
                self._handle(key, tid)
        assert not self.live, f"never popped: {sorted(self.live)}"
        assert sorted(self.fired) == sorted(self.expected), "a live entry popped twice or never"


TestDeadlineHeap = DeadlineHeapMachine.TestCase
TestDeadlineHeap.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class _Idle(_TestTrigger):
    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)  # never iterated here


class SlotBookMachine(RuleBasedStateMachine):
    """After any sequence of bookings the slot counters equal the counts by entry type, no
    more slots are held than there are, and the queue admits oldest first."""

    booked = Bundle("booked")

    @initialize(capacity=st.integers(min_value=1, max_value=4))
    def start(self, capacity: int) -> None:
        self.book = SlotBook(capacity)
        self.serial = 0
        self.queue_order: list[Queued] = []

    def _tid(self) -> str:
        self.serial += 1
        return f"t{self.serial}"

    @precondition(lambda self: self.book.admits())
    @rule(target=booked, expiry=st.booleans())
    def place_timer(self, expiry: bool) -> str:
        tid = self._tid()
        entry = Expiry(1.0, None) if expiry else Timer(1.0, None, None, None)
        self.book.place_timer(tid, entry)
        return tid

    @precondition(lambda self: self.book.admits())
    @rule(target=booked)
    def place_run(self) -> str:
        tid = self._tid()
        self.book.place_run(Run(tid, _Idle(), None, None, 1))
        return tid

    @rule(target=booked)
    def queue(self) -> str:
        tid = self._tid()
        entry = Queued(tid, _Idle(), None, None, 1)
        self.book.queue(entry)
        self.queue_order.append(entry)
        return tid

    @rule(tid=consumes(booked))
    def remove(self, tid: str) -> None:
        entry = self.book.entries.get(tid)
        if entry is None:
            return  # already gone (released, admitted or dropped at stop)
        if type(entry) is Run:
            assert self.book.release(entry)
            assert not self.book.release(entry)
        else:
            assert self.book.remove(tid) is entry
        if type(entry) is Queued:
            self.queue_order.remove(entry)

    @rule(as_run=st.booleans())
    def admit_next(self, as_run: bool) -> None:
        entry = self.book.next_queued()
        if entry is None:
            assert not self.queue_order or self.book.active >= self.book.capacity
            return
        assert entry is self.queue_order.pop(0), "the queue did not admit oldest first"
        if as_run:
            self.book.place_run(Run(entry.tid, entry.trigger, None, None, 1))
        else:
            self.book.place_timer(entry.tid, Timer(1.0, None, None, None))

    @rule()
    def keep_runs(self) -> None:
        runs = self.book.keep_runs()
        assert all(type(run) is Run for run in runs)
        self.queue_order.clear()

    @invariant()
    def counters_equal_the_counts_by_type(self) -> None:
        if not hasattr(self, "book"):
            return
        kinds = [type(entry) for entry in self.book.entries.values()]
        assert self.book.timers == kinds.count(Timer) + kinds.count(Expiry)
        assert self.book.active == self.book.timers + kinds.count(Run)
        assert self.book.queued == kinds.count(Queued) == len(self.queue_order)
        assert self.book.active <= self.book.capacity


TestSlotBook = SlotBookMachine.TestCase
TestSlotBook.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# -- the supervisor: one outcome per trigger, none after a cancel ------------------------------


class _Coroutine(_TestTrigger):
    """Sleeps, then yields, fails, returns without an event, or waits forever."""

    def __init__(self, delay: float, ends: str) -> None:
        super().__init__()
        self.delay = delay
        self.ends = ends

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        if self.ends == "fails":
            raise RuntimeError("boom")
        if self.ends == "hangs":
            await asyncio.Event().wait()
        if self.ends != "empty":
            yield TriggerEvent("done")


_SPECS = st.tuples(
    st.sampled_from(["timer", "fires", "fails", "empty", "hangs"]),
    st.integers(min_value=0, max_value=30),  # ms until it fires or ends
    st.one_of(st.none(), st.integers(min_value=0, max_value=40)),  # ms until it times out
    st.booleans(),  # cancelled
).filter(lambda spec: spec[0] != "hangs" or spec[2] is not None or spec[3])  # all can end


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(_SPECS, min_size=1, max_size=12),
    capacity=st.integers(min_value=1, max_value=6),
    yields=st.integers(min_value=0, max_value=5),
)
def test_each_trigger_ends_with_one_outcome_or_none_after_its_cancel(
    specs: list[tuple[str, int, int | None, bool]], capacity: int, yields: int
) -> None:
    asyncio.run(_one_outcome_each(specs, capacity, yields))


async def _one_outcome_each(
    specs: list[tuple[str, int, int | None, bool]], capacity: int, yields: int
) -> None:
    outcomes: dict[str, list[TriggerOutcome]] = {}
    cancelled_at: dict[str, int] = {}  # id -> its outcome count when cancel() was called

    def on_event(outcome: TriggerOutcome) -> None:
        outcomes.setdefault(outcome.trigger_id, []).append(outcome)

    now = dt.datetime.now(dt.UTC)
    supervisor = TriggerSupervisor(
        capacity=capacity, on_event=on_event, cleanup_timeout=0.5, block_threshold=None
    )
    async with supervisor:
        for index, (kind, ms, timeout_ms, _) in enumerate(specs):
            at = now + dt.timedelta(milliseconds=ms)
            trigger = DateTimeTrigger(at) if kind == "timer" else _Coroutine(ms / 1000, kind)
            timeout = None if timeout_ms is None else now + dt.timedelta(milliseconds=timeout_ms)
            assert supervisor.add(f"t{index}", trigger, timeout_at=timeout)
        for _ in range(yields):
            await asyncio.sleep(0)
        for index, (*_, cancel) in enumerate(specs):
            if cancel:
                tid = f"t{index}"
                cancelled_at[tid] = len(outcomes.get(tid, ()))
                await supervisor.cancel(tid)
        await until(lambda: len(supervisor) == 0, within=10)
        assert supervisor.running == supervisor.pending == 0
    for index in range(len(specs)):
        tid = f"t{index}"
        got = outcomes.get(tid, [])
        assert sum(o.final for o in got) <= 1, got
        assert all(o.final for o in got), got  # max_events=1: the one event is final
        if tid in cancelled_at:
            assert len(got) == cancelled_at[tid], f"{tid} emitted after its cancel: {got}"
        else:
            assert len(got) == 1, f"{tid} ended with {got}"


def test_a_bucket_put_back_part_handled_is_not_copied() -> None:
    """Firing a bucket of a million ids in a thousand slices must not copy what is left at
    each slice (seconds of work): the list put back is the one popped, with its start."""
    heap = DeadlineHeap()
    for i in range(10):
        heap.push(1.0, f"t{i}")
    first = heap.pop_due(1000)
    assert first is not None
    key, tids, _ = first
    heap.requeue(key, tids, 3)
    heap.push(1.0, "late")
    again = heap.pop_due(1000)
    assert again is not None
    assert again[1] is tids
    assert again[2] == 3
    assert list(again[1][3:]) == [f"t{i}" for i in range(3, 10)] + ["late"]
    heap.requeue(key, again[1], 8)  # most of it handled: the handled part is dropped
    assert heap.pop_due(1000) == (key, ["t8", "t9", "late"], 0)
