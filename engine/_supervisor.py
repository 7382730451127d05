"""The trigger supervisor: runs many triggers concurrently in one asyncio process.

Two kinds of trigger share one capacity:

* **Timers** (triggers that declare a pure deadline through ``BaseTrigger.as_timer``) are
  kept as one small entry in a shared heap ordered by due time, woken by a single loop
  timer. No coroutine, task or handle per timer; the trigger object itself is dropped.
* **Coroutine triggers** run ``run()`` in one task each. Their absolute timeouts live in the
  same heap, so a timeout costs a heap entry, not a task.

Every trigger ends in exactly one of: its final event, a failure, a timeout (each handed to
``on_event``), or a cancellation (which emits nothing). ``cleanup()`` is awaited after
``run()`` ends, bounded by ``cleanup_timeout``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Final

from deferline.schemas import canonical_json

from ._alarm import LoopAlarm
from ._coroutine_runs import CoroutineRunner, RunState, _Run
from ._errors import SupervisorError
from ._metrics import SupervisorMetrics
from ._outcome import TriggerOutcome
from ._slots import SlotBook
from ._supervisor_outcomes import OutcomeSink, fired_outcome
from ._supervisor_state import (
    _AT_DEADLINE,
    _UTC,
    _classpath,
    _describe_error,
    _epoch,
    _Expiry,
    _from_epoch,
    _log_extra,
    _Queued,
    _Timer,
)
from ._supervisor_watchdog import BlockReports
from ._timer_heap import DeadlineHeap
from ._trigger import BaseTaskEndEvent, BaseTrigger, TimerSpec, TriggerEvent
from ._watchdog import LoopWatchdog

__all__ = ["TriggerSupervisor"]

logger = logging.getLogger(__name__)


class SupervisorState(enum.Enum):
    """Lifecycle of a supervisor: NEW → RUNNING → STOPPING → STOPPED (or NEW → STOPPED)."""

    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


_NEW: Final = SupervisorState.NEW
_RUNNING: Final = SupervisorState.RUNNING
_STOPPING: Final = SupervisorState.STOPPING
_STOPPED: Final = SupervisorState.STOPPED

_CANCEL_SLICE: Final = 2000  # cancel_many gives the loop back after this many triggers
_FIRE_SLICE: Final = 0.01  # give the loop back after firing timers for this long

# Below 2**32 s (the year 2106) the epoch float of a datetime is within half a microsecond of
# it, so the datetime rebuilt from the float is the datetime itself; past that, compare.
_EPOCH_EXACT: Final = 2.0**32


class TriggerSupervisor:
    """Runs triggers under a capacity, with timeouts, cleanup, metrics and a loop watchdog.

    Args:
        capacity: How many triggers run at once; timers count like coroutine triggers
            (as in Airflow's ``--capacity``). Triggers over capacity wait, in the order they
            were added, and are reported as ``pending``. A waiting timer is one small entry
            in the timer heap, far lighter than a coroutine trigger (docs/benchmarks.md,
            ``bench_engine_memory``), so a large capacity suits timer-heavy loads.
        on_event: Called synchronously, once per outcome, on the loop thread. Must not
            block; exceptions it raises are logged and counted, never propagated.
        cleanup_timeout: Seconds granted to ``cleanup()`` and, separately, to a cancelled
            ``run()`` to finish; what overruns is abandoned and logged (default 5).
        block_threshold: Report the event loop as blocked when it does not get back to
            its heartbeat for this many seconds (default 0.2); ``None`` disables the
            watchdog.
    """

    def __init__(
        self,
        *,
        capacity: int,
        on_event: Callable[[TriggerOutcome], None],
        cleanup_timeout: float = 5.0,
        block_threshold: float | None = 0.2,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if not callable(on_event):
            raise TypeError("on_event must be callable")
        if not cleanup_timeout > 0:
            raise ValueError("cleanup_timeout must be > 0")
        if block_threshold is not None and not block_threshold > 0:
            raise ValueError("block_threshold must be > 0 or None")
        self._cleanup_timeout = float(cleanup_timeout)
        self._block_threshold = block_threshold
        self._state = _NEW
        self._held = False
        self._firing = False
        self._filling = False
        self._last_due: tuple[float, dt.datetime, bytes] | None = None
        self._timer_capable: dict[type, bool] = {}
        self._timer_refused: set[type] = set()  # classes whose as_timer() failed once
        self._watchdog: LoopWatchdog | None = None
        self._stopped = asyncio.Event()
        self.metrics = SupervisorMetrics(self)
        self._slots = SlotBook(capacity)
        self._deadlines = DeadlineHeap()
        self._alarm = LoopAlarm(self._on_wake, self._next_due)
        self._sink = OutcomeSink(on_event, self.metrics)
        self._runner = CoroutineRunner(
            sink=self._sink,
            metrics=self.metrics,
            cleanup_timeout=self._cleanup_timeout,
            arm=self._push,
            forget=self._forget_deadline,
            release=self._release,
        )
        self._reports = BlockReports(
            self.metrics, trigger_of=self._trigger_of, firing=lambda: self._firing
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start on the running loop (and the watchdog thread)."""
        if self._state is not _NEW:
            raise SupervisorError(f"supervisor cannot start: it is {self._state.value}")
        loop = asyncio.get_running_loop()
        self._state = _RUNNING
        self._runner.bind(loop)
        if self._block_threshold is not None:
            self._watchdog = LoopWatchdog(
                threshold=self._block_threshold,
                describe=self._reports.describe_task,
                on_blocked=self._reports.on_blocked,
            )
            self._watchdog.start()
        self._alarm.bind(loop)

    async def stop(self) -> None:
        """Stop every trigger without emitting anything; idempotent and bounded.

        Running triggers are cancelled and cleaned up (each bounded by ``cleanup_timeout``);
        waiting timers and pending triggers are dropped. What was running will run again
        wherever the triggers are re-assigned.
        """
        if self._state is _STOPPING or self._state is _STOPPED:
            await self._stopped.wait()
            return
        if self._state is _NEW:
            self._state = _STOPPED
            self._stopped.set()
            return
        self._state = _STOPPING
        try:
            self._alarm.cancel()
            runs = self._slots.keep_runs()
            self._deadlines.clear()
            waits = self._runner.stop_all(runs)
            if waits:
                await asyncio.wait(waits, timeout=3 * self._cleanup_timeout)
            self._runner.cancel_abandoned()
        finally:
            if self._watchdog is not None:
                await self._watchdog.stop()
            self._state = _STOPPED
            self._stopped.set()

    async def __aenter__(self) -> TriggerSupervisor:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- public API --------------------------------------------------------------------

    def add(
        self,
        trigger_id: str,
        trigger: BaseTrigger,
        *,
        timeout_at: dt.datetime | None = None,
        context: object = None,
        max_events: int | None = 1,
    ) -> bool:
        """Start (or queue, when at capacity) a trigger; False if ``trigger_id`` is present.

        Args:
            trigger_id: Unique id; outcomes carry it and event ids derive from it.
            trigger: The trigger instance.
            timeout_at: Absolute deadline (timezone-aware); past it the trigger ends with a
                ``timed_out`` outcome, even while pending.
            context: Any object, handed back on every outcome. If it has ``task``,
                ``partition`` or ``member`` attributes, log lines carry them.
            max_events: Stop the trigger after this many events; the last is ``final``.
                The default 1 is Airflow's task semantics (a task resumes on its trigger's
                first event, and the trigger is then removed). ``None`` lets a multi-event
                trigger run until ``run()`` returns; each event gets its own id, and the
                last is marked ``final`` when ``run()`` returns right after yielding it.
        """
        if self._state is not _RUNNING:
            raise SupervisorError(
                f"cannot add trigger {trigger_id}: supervisor is {self._state.value}"
            )
        if trigger_id in self._slots.entries:
            return False
        if not isinstance(trigger_id, str) or not trigger_id:
            raise TypeError("trigger_id must be a non-empty string")
        if not isinstance(trigger, BaseTrigger):
            raise TypeError(f"trigger must be a BaseTrigger, got {type(trigger).__name__}")
        if max_events is not None and (not isinstance(max_events, int) or max_events < 1):
            raise ValueError("max_events must be a positive integer or None")
        deadline = None if timeout_at is None else _epoch(timeout_at, "timeout_at")
        if self._slots.admits():
            self._admit(trigger_id, trigger, deadline, context, max_events, queued=False)
        else:
            self._slots.queue(_Queued(trigger_id, trigger, deadline, context, max_events))
            if deadline is not None:
                self._push(deadline, trigger_id)
        return True

    async def cancel(self, trigger_id: str, *, kill: bool = False) -> bool:
        """Stop a trigger, await its cleanup (bounded) and emit nothing; False if unknown.

        ``kill``: a user cancelled it, so a running coroutine trigger's ``on_kill()`` is
        awaited before its ``cleanup()`` (within the same bound).
        """
        entry = self._slots.entries.get(trigger_id)
        if entry is None:
            return False
        if type(entry) is not _Run:
            self._slots.remove(trigger_id)
            self.metrics.cancelled += 1
            if entry.deadline is not None:
                self._forget_deadline()
            self._fill()
            return True
        if entry.state is RunState.RUNNING:
            self.metrics.cancelled += 1
            logger.debug("trigger cancelled", extra=_log_extra(trigger_id, entry.context))
            self._runner.stop(entry, kill=kill)
        waiter = entry.stopper if entry.stopper is not None else entry.task
        if waiter is not None and not waiter.done():
            # asyncio.wait never cancels what it waits for: the stop completes even if our
            # caller is cancelled meanwhile.
            await asyncio.wait({waiter}, timeout=3 * self._cleanup_timeout)
        return True

    async def cancel_many(self, trigger_ids: Iterable[str]) -> int:
        """Cancel many triggers like :meth:`cancel`; returns how many were present.

        Waiting timers and pending triggers are dropped on the spot (cancelling one never
        suspends), so only coroutine triggers are stopped as tasks, together: the tens of
        thousands of timers of a released partition are not cancelled through one task each
        on the way out of a rebalance or a shutdown (docs/benchmarks.md). The loop is given
        back every few thousand triggers.
        """
        entries = self._slots.entries
        runs: list[str] = []
        waiting: list[str] = []
        count = 0
        for tid in trigger_ids:
            entry = entries.get(tid)
            if entry is None:
                continue
            kind = type(entry)
            if kind is _Queued:  # first: a freed slot must not admit one of these
                await self.cancel(tid)  # returns without suspending
                count += 1
            elif kind is _Run:
                runs.append(tid)
            else:
                waiting.append(tid)
        for index, tid in enumerate(waiting, 1):
            if await self.cancel(tid):  # returns without suspending
                count += 1
            if not index % _CANCEL_SLICE:
                await asyncio.sleep(0)
        for start in range(0, len(runs), _CANCEL_SLICE):
            chunk = runs[start : start + _CANCEL_SLICE]
            count += sum(await asyncio.gather(*(self.cancel(tid) for tid in chunk)))
        return count

    def reject(
        self, trigger_id: str, error: BaseException | str, *, context: object = None
    ) -> None:
        """Emit a final ``failed`` outcome for a trigger that could not even be built.

        For load errors (not allowed, import error, bad kwargs, undecryptable kwargs): the
        failure then flows like any other, with the same deterministic event id.
        """
        message = error if isinstance(error, str) else _describe_error(error)
        self._sink.failed(trigger_id, context, message, None, verb="rejected")

    def __contains__(self, trigger_id: object) -> bool:
        return trigger_id in self._slots.entries

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> int:
        """Triggers holding capacity (running coroutines, waiting timers, stopping ones)."""
        return self._slots.active

    @property
    def waiting_timers(self) -> int:
        """Triggers held in the shared timer heap."""
        return self._slots.timers

    @property
    def pending(self) -> int:
        """Triggers waiting for capacity."""
        return self._slots.queued

    @property
    def timers_held(self) -> bool:
        """True while :meth:`hold_timers` keeps due timers from firing."""
        return self._held

    def hold_timers(self, held: bool) -> None:
        """Stop (``True``) or restart (``False``) firing due timers and timeouts.

        While held, due entries stay in the heap in their order and fire once released;
        nothing is dropped. The consumer of outcomes uses this as backpressure (the
        triggerer holds the timers while its producer queue is full). Coroutine triggers
        keep running; their events still arrive.
        """
        if held == self._held:
            return
        self._held = held
        if not held:
            self._alarm.soon()

    @property
    def capacity(self) -> int:
        """The configured capacity."""
        return self._slots.capacity

    @property
    def capacity_left(self) -> int:
        """Free capacity."""
        return max(0, self._slots.capacity - self._slots.active)

    # -- admission ---------------------------------------------------------------------

    def _admit(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
        *,
        queued: bool,
    ) -> None:
        """Place an admitted trigger; ``queued`` means its timeout is already on the heap."""
        slots = self._slots
        spec = self._timer_spec(trigger)
        if spec is not None:
            fire_at = spec.moment.timestamp()
            if deadline is not None and deadline < fire_at:
                slots.place_timer(tid, _Expiry(deadline, context))
                if not queued:
                    self._push(deadline, tid)
            else:
                event = spec.event
                end = event if isinstance(event, BaseTaskEndEvent) else None
                payload = event.payload
                if (
                    payload is spec.moment
                    and payload.tzinfo is _UTC
                    and (0 <= fire_at < _EPOCH_EXACT or _from_epoch(fire_at) == payload)
                ):
                    payload = _AT_DEADLINE  # rebuilt when fired: saves a datetime per timer
                slots.place_timer(tid, _Timer(fire_at, payload, end, context))
                self._push(fire_at, tid)
            return
        if deadline is not None and deadline <= time.time():
            slots.place_timer(tid, _Expiry(deadline, context))
            if not queued:
                self._push(deadline, tid)
            return
        run = _Run(tid, trigger, deadline, context, max_events)
        slots.place_run(run)
        if deadline is not None and not queued:
            self._push(deadline, tid)
        self._runner.start(run)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger started: %s", _classpath(trigger), extra=_log_extra(tid, context))

    def _timer_spec(self, trigger: BaseTrigger) -> TimerSpec | None:
        cls = type(trigger)
        capable = self._timer_capable.get(cls)
        if capable is None:
            owner = next(k for k in cls.__mro__ if "as_timer" in vars(k))
            capable = (
                owner is not BaseTrigger
                and getattr(cls, "run", None) is getattr(owner, "run", None)
                and getattr(cls, "cleanup", None) is getattr(owner, "cleanup", None)
            )
            self._timer_capable[cls] = capable
        if not capable:
            return None
        try:
            spec = trigger.as_timer()
        except Exception as exc:
            self._not_a_timer(trigger, f"raised {_describe_error(exc)}")
            return None
        if spec is None:
            return None
        if (
            not isinstance(spec, TimerSpec)
            or not isinstance(spec.moment, dt.datetime)
            or spec.moment.utcoffset() is None
            or not isinstance(spec.event, TriggerEvent)
        ):
            self._not_a_timer(
                trigger, "returned no TimerSpec of an aware datetime and a TriggerEvent"
            )
            return None
        return spec

    def _not_a_timer(self, trigger: BaseTrigger, what: str) -> None:
        """Report an ``as_timer()`` that failed: a warning the first time for its class."""
        cls = type(trigger)
        level = logging.DEBUG if cls in self._timer_refused else logging.WARNING
        self._timer_refused.add(cls)
        logger.log(
            level, "as_timer() of %s %s; running it as a coroutine", _classpath(trigger), what
        )

    def _fill(self) -> None:
        """Admit queued triggers, oldest first, while there is capacity."""
        if self._filling or not self._slots.queued or self._state is not _RUNNING:
            return
        self._filling = True
        try:
            while (entry := self._slots.next_queued()) is not None:
                self._admit(
                    entry.tid,
                    entry.trigger,
                    entry.deadline,
                    entry.context,
                    entry.max_events,
                    queued=True,
                )
        finally:
            self._filling = False

    def _release(self, run: _Run) -> None:
        """A finished run gave its slot back: admit what waits for one."""
        if self._slots.release(run):
            self._fill()

    def _trigger_of(self, tid: str) -> object:
        """The trigger object of ``tid`` if it has one (read from the watchdog thread)."""
        return getattr(self._slots.entries.get(tid), "trigger", None)

    # -- deadlines -----------------------------------------------------------------------

    def _push(self, deadline: float, tid: str) -> None:
        """Queue ``tid`` on the timer heap for ``deadline``."""
        self._deadlines.push(deadline, tid)
        self._alarm.earlier(deadline)

    def _next_due(self) -> float | None:
        """What the alarm waits for: the earliest deadline, unless stopped or held."""
        if self._state is not _RUNNING or self._held:
            return None
        return self._deadlines.first()

    def _forget_deadline(self) -> None:
        """Count a heap entry made stale early; rebuild the heap when most entries are."""
        if (
            self._deadlines.forget(len(self._slots.entries))
            and not self._firing
            and self._state is _RUNNING
        ):
            self._deadlines.rebuild(
                [
                    (tid, deadline)
                    for tid, entry in self._slots.entries.items()
                    if (deadline := entry.deadline) is not None
                ]
            )
            self._alarm.rearm()

    def _on_wake(self) -> None:
        """Fire what is due, bucket by bucket, in slices so the loop stays responsive."""
        deadlines = self._deadlines
        now_ms = time.time() * 1000.0
        stop_at = time.perf_counter() + _FIRE_SLICE
        handled = 0
        self._firing = True
        try:
            while (due := deadlines.pop_due(now_ms)) is not None:
                key, tids, start = due
                for index in range(start, len(tids)):
                    self._due(key, tids[index])
                    handled += 1
                    if self._held or (not handled & 63 and time.perf_counter() > stop_at):
                        deadlines.requeue(key, tids, index + 1)
                        return
        finally:
            self._firing = False
            self._fill()
            self._alarm.rearm()

    def _due(self, key: int, tid: str) -> None:
        """A heap entry came due: fire the timer or time the trigger out, unless stale."""
        entry = self._slots.entries.get(tid)
        if entry is None:
            return  # cancelled or finished
        deadline = entry.deadline
        if deadline is None or math.ceil(deadline * 1000.0) != key:
            return  # stale: re-added with another deadline, or now a timer due later
        kind = type(entry)
        if kind is _Run:
            if self._runner.deadline_due(entry):  # type: ignore[arg-type]
                self._sink.timed_out(tid, deadline, entry.context)
            return
        self._slots.remove(tid)
        if kind is _Timer:
            self._fire_timer(tid, entry)  # type: ignore[arg-type]
        else:
            self._sink.timed_out(tid, deadline, entry.context)

    def _due_at(self, deadline: float) -> tuple[dt.datetime, bytes]:
        """The due time of ``deadline`` and its canonical JSON (the payload of a timer that
        fires with its moment), shared by the timers of a burst: computed once per distinct
        deadline, not once per timer."""
        last = self._last_due
        if last is None or last[0] != deadline:
            due = _from_epoch(deadline)
            last = self._last_due = (deadline, due, canonical_json(due))
        return last[1], last[2]

    def _fire_timer(self, tid: str, timer: _Timer) -> None:
        fired = time.time()
        self.metrics.fire_lag.observe(fired - timer.deadline)
        payload = timer.payload
        canonical = None
        try:
            if payload is _AT_DEADLINE:
                due, canonical = self._due_at(timer.deadline)
                payload = due
            else:
                due = _from_epoch(timer.deadline)
            outcome = fired_outcome(
                tid, payload, timer.end, timer.context, True, due, _from_epoch(fired), canonical
            )
        except Exception as exc:
            self._sink.failed(tid, timer.context, f"event cannot be serialized: {exc}", None)
            return
        self._sink.fired(outcome)
