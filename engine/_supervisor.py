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
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from heapq import heapify, heappop, heappush
from types import TracebackType
from typing import Any, Final

from deferline.schemas import make_event_id, to_tagged

from ._errors import SupervisorError
from ._metrics import SupervisorMetrics
from ._outcome import TriggerOutcome
from ._trigger import BaseTaskEndEvent, BaseTrigger, TimerSpec, TriggerEvent
from ._watchdog import BlockedLoop, LoopWatchdog

__all__ = ["TriggerSupervisor"]

logger = logging.getLogger(__name__)

_UTC = dt.UTC
_MAX_SLEEP: Final = 1.0  # re-read the wall clock at least this often while timers wait
_FIRE_SLICE: Final = 0.01  # give the loop back after firing timers for this long
_COMPACT_MIN: Final = 10_000  # rebuild the heap once this many entries went stale early
_TASK_PREFIX: Final = "deferline-trigger:"
_CLEANUP_PREFIX: Final = "deferline-cleanup:"

# Lifecycle of a coroutine trigger.
_RUNNING: Final = 0  # run() is being iterated
_STOPPING: Final = 1  # cancelled or timed out: the stopper owns cleanup and release
_FINISHING: Final = 2  # run() ended on its own: its task owns cleanup and release
_DONE: Final = 3
# Closing a finished run() (its finally blocks), bounded through the timer heap.
_CLOSING: Final = 1
_CLOSE_EXPIRED: Final = 2


class _Timer:
    """A waiting timer: emit ``payload`` once the wall clock reaches ``deadline``."""

    __slots__ = ("context", "deadline", "end", "payload")

    def __init__(
        self, deadline: float, payload: Any, end: BaseTaskEndEvent | None, context: object
    ) -> None:
        self.deadline = deadline
        self.payload = payload
        self.end = end
        self.context = context


class _Expiry:
    """An admitted trigger that can only time out (its timeout comes before its moment)."""

    __slots__ = ("context", "deadline")

    def __init__(self, deadline: float, context: object) -> None:
        self.deadline = deadline
        self.context = context


class _Pending:
    """A trigger waiting for capacity; ``deadline`` is its timeout (epoch) or None."""

    __slots__ = ("context", "deadline", "max_events", "tid", "trigger")

    def __init__(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
    ) -> None:
        self.tid = tid
        self.trigger = trigger
        self.deadline = deadline
        self.context = context
        self.max_events = max_events


class _Run:
    """A coroutine trigger and the task that iterates its ``run()``."""

    __slots__ = (
        "cleaned",
        "closing",
        "context",
        "deadline",
        "events",
        "max_events",
        "state",
        "stopper",
        "task",
        "tid",
        "trigger",
    )

    def __init__(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
    ) -> None:
        self.tid = tid
        self.trigger = trigger
        self.deadline = deadline
        self.context = context
        self.max_events = max_events
        self.events = 0
        self.state = _RUNNING
        self.cleaned = False
        self.closing = 0
        self.task: asyncio.Task[None] | None = None
        self.stopper: asyncio.Task[None] | None = None


_Entry = _Timer | _Expiry | _Pending | _Run


class _Exhausted:
    """Marker: the async generator has no more events."""


_EXHAUSTED: Final = _Exhausted()


class _AtDeadline:
    """Marker payload of a timer whose payload is its own due moment (DateTimeTrigger)."""


_AT_DEADLINE: Final = _AtDeadline()


async def _anext(agen: AsyncIterator[Any]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _EXHAUSTED


def _epoch(value: dt.datetime, name: str) -> float:
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware")
    return value.timestamp()


def _from_epoch(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, _UTC)


def _describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _log_extra(tid: str | None, context: object) -> dict[str, object]:
    return {
        "trigger_id": tid,
        "task": getattr(context, "task", None),
        "partition": getattr(context, "partition", None),
        "member": getattr(context, "member", None),
    }


def _classpath(trigger: object) -> str:
    cls = type(trigger)
    return f"{cls.__module__}.{cls.__qualname__}"


class TriggerSupervisor:
    """Runs triggers under a capacity, with timeouts, cleanup, metrics and a loop watchdog.

    Args:
        capacity: How many triggers run at once; timers count like coroutine triggers
            (as in Airflow's ``--capacity``). Triggers over capacity wait, in the order they
            were added, and are reported as ``pending``. A waiting timer costs a few hundred
            bytes, so a large capacity (hundreds of thousands) is reasonable for timer-heavy
            loads; coroutine triggers cost a few kilobytes each.
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
        self._capacity = capacity
        self._on_event = on_event
        self._cleanup_timeout = float(cleanup_timeout)
        self._block_threshold = block_threshold
        self._entries: dict[str, _Entry] = {}
        # The shared timer structure: a heap of millisecond keys, each naming a bucket of
        # trigger ids (a bare id while alone). Entries are validated lazily when due.
        self._heap: list[int] = []
        self._buckets: dict[int, str | list[str]] = {}
        self._stale = 0
        self._pending: deque[_Pending] = deque()
        self._pending_count = 0
        self._active = 0
        self._timers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at = math.inf
        self._resched = False
        self._firing = False
        self._filling = False
        self._held = False
        self._state = "new"
        self._stoppers: set[asyncio.Task[None]] = set()
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._timer_capable: dict[type, bool] = {}
        self._metrics_lock = threading.Lock()
        self._watchdog: LoopWatchdog | None = None
        self._stopped = asyncio.Event()
        self.metrics = SupervisorMetrics(self)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start on the running loop (and the watchdog thread)."""
        if self._state != "new":
            raise SupervisorError(f"supervisor cannot start: it is {self._state}")
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        if self._block_threshold is not None:
            self._watchdog = LoopWatchdog(
                threshold=self._block_threshold,
                describe=self._describe_task,
                on_blocked=self._on_blocked,
            )
            self._watchdog.start()
        self._reschedule()

    async def stop(self) -> None:
        """Stop every trigger without emitting anything; idempotent and bounded.

        Running triggers are cancelled and cleaned up (each bounded by ``cleanup_timeout``);
        waiting timers and pending triggers are dropped. What was running will run again
        wherever the triggers are re-assigned.
        """
        if self._state in ("stopping", "stopped"):
            await self._stopped.wait()
            return
        if self._state == "new":
            self._state = "stopped"
            self._stopped.set()
            return
        self._state = "stopping"
        try:
            if self._wake is not None:
                self._wake.cancel()
                self._wake = None
            runs: list[_Run] = []
            for entry in self._entries.values():
                if type(entry) is _Run:
                    runs.append(entry)
            for tid in [tid for tid, e in self._entries.items() if type(e) is not _Run]:
                del self._entries[tid]
            self._heap.clear()
            self._buckets.clear()
            self._stale = 0
            self._pending.clear()
            self._pending_count = 0
            self._timers = 0
            self._active = len(runs)
            stopping = [e for e in runs if e.state == _RUNNING]
            for e in stopping:
                e.state = _STOPPING
            waits: list[asyncio.Future[Any]] = [
                e.task for e in runs if e.state == _FINISHING and e.task is not None
            ]
            waits.extend(self._stoppers)
            if stopping:
                waits.append(asyncio.ensure_future(self._stop_runs(stopping)))
            if waits:
                await asyncio.wait(waits, timeout=3 * self._cleanup_timeout)
            for task in list(self._abandoned):
                task.cancel()
            if self._abandoned:
                logger.warning(
                    "%d abandoned trigger task(s) still running at stop", len(self._abandoned)
                )
        finally:
            if self._watchdog is not None:
                await self._watchdog.stop()
            self._state = "stopped"
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
        if self._state != "running":
            raise SupervisorError(f"cannot add trigger {trigger_id}: supervisor is {self._state}")
        if trigger_id in self._entries:
            return False
        if not isinstance(trigger_id, str) or not trigger_id:
            raise TypeError("trigger_id must be a non-empty string")
        if not isinstance(trigger, BaseTrigger):
            raise TypeError(f"trigger must be a BaseTrigger, got {type(trigger).__name__}")
        if max_events is not None and (not isinstance(max_events, int) or max_events < 1):
            raise ValueError("max_events must be a positive integer or None")
        deadline = None if timeout_at is None else _epoch(timeout_at, "timeout_at")
        if self._active < self._capacity and not self._pending_count:
            self._admit(trigger_id, trigger, deadline, context, max_events, queued=False)
        else:
            pending = _Pending(trigger_id, trigger, deadline, context, max_events)
            self._entries[trigger_id] = pending
            self._pending.append(pending)
            self._pending_count += 1
            if deadline is not None:
                self._push(deadline, trigger_id)
        return True

    async def cancel(self, trigger_id: str) -> bool:
        """Stop a trigger, await its cleanup (bounded) and emit nothing; False if unknown."""
        entry = self._entries.get(trigger_id)
        if entry is None:
            return False
        kind = type(entry)
        if kind is _Timer or kind is _Expiry:
            del self._entries[trigger_id]
            self._active -= 1
            self._timers -= 1
            self.metrics.cancelled += 1
            self._forget_deadline()
            self._fill()
            return True
        if kind is _Pending:
            del self._entries[trigger_id]
            self._pending_count -= 1
            self.metrics.cancelled += 1
            if entry.deadline is not None:
                self._forget_deadline()
            return True
        assert isinstance(entry, _Run)
        if entry.state == _RUNNING:
            self.metrics.cancelled += 1
            logger.debug("trigger cancelled", extra=_log_extra(trigger_id, entry.context))
            self._begin_stop(entry)
        waiter = entry.stopper if entry.stopper is not None else entry.task
        if waiter is not None and not waiter.done():
            # asyncio.wait never cancels what it waits for: the stop completes even if our
            # caller is cancelled meanwhile.
            await asyncio.wait({waiter}, timeout=3 * self._cleanup_timeout)
        return True

    def reject(
        self, trigger_id: str, error: BaseException | str, *, context: object = None
    ) -> None:
        """Emit a final ``failed`` outcome for a trigger that could not even be built.

        For load errors (not allowed, import error, bad kwargs, undecryptable kwargs): the
        failure then flows like any other, with the same deterministic event id.
        """
        message = error if isinstance(error, str) else _describe_error(error)
        self.metrics.failed += 1
        logger.warning("trigger rejected: %s", message, extra=_log_extra(trigger_id, context))
        self._deliver(
            TriggerOutcome(
                trigger_id,
                "failed",
                None,
                make_event_id(trigger_id, "failed", None),
                error=message,
                fired_at=dt.datetime.now(_UTC),
                context=context,
            )
        )

    def __contains__(self, trigger_id: object) -> bool:
        return trigger_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def running(self) -> int:
        """Triggers holding capacity (running coroutines, waiting timers, stopping ones)."""
        return self._active

    @property
    def waiting_timers(self) -> int:
        """Triggers held in the shared timer heap."""
        return self._timers

    @property
    def pending(self) -> int:
        """Triggers waiting for capacity."""
        return self._pending_count

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
        if not held and not self._resched and self._loop is not None:
            self._resched = True
            self._loop.call_soon(self._reschedule)

    @property
    def capacity(self) -> int:
        """The configured capacity."""
        return self._capacity

    @property
    def capacity_left(self) -> int:
        """Free capacity."""
        return max(0, self._capacity - self._active)

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
        self._active += 1
        spec = self._timer_spec(trigger)
        if spec is not None:
            fire_at = spec.moment.timestamp()
            self._timers += 1
            if deadline is not None and deadline < fire_at:
                self._entries[tid] = _Expiry(deadline, context)
                if not queued:
                    self._push(deadline, tid)
            else:
                event = spec.event
                end = event if isinstance(event, BaseTaskEndEvent) else None
                payload = event.payload
                if (
                    payload is spec.moment
                    and payload.tzinfo is _UTC
                    and _from_epoch(fire_at) == payload
                ):
                    payload = _AT_DEADLINE  # rebuilt when fired: saves a datetime per timer
                self._entries[tid] = _Timer(fire_at, payload, end, context)
                self._push(fire_at, tid)
            return
        if deadline is not None and deadline <= time.time():
            self._timers += 1
            self._entries[tid] = _Expiry(deadline, context)
            if not queued:
                self._push(deadline, tid)
            return
        run = _Run(tid, trigger, deadline, context, max_events)
        self._entries[tid] = run
        if deadline is not None and not queued:
            self._push(deadline, tid)
        trigger.trigger_id = tid
        assert self._loop is not None
        run.task = self._loop.create_task(self._lifecycle(run), name=_TASK_PREFIX + tid)
        run.task.add_done_callback(self._task_done)
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
        except Exception:
            logger.debug("as_timer() raised; running %s as a coroutine", cls, exc_info=True)
            return None
        if (
            not isinstance(spec, TimerSpec)
            or not isinstance(spec.moment, dt.datetime)
            or spec.moment.utcoffset() is None
            or not isinstance(spec.event, TriggerEvent)
        ):
            return None
        return spec

    def _fill(self) -> None:
        """Admit pending triggers, oldest first, while there is capacity."""
        if self._filling or self._state != "running":
            return
        self._filling = True
        try:
            pending = self._pending
            entries = self._entries
            while pending and self._active < self._capacity:
                p = pending.popleft()
                if entries.get(p.tid) is not p:
                    continue  # cancelled or timed out while pending
                self._pending_count -= 1
                self._admit(p.tid, p.trigger, p.deadline, p.context, p.max_events, queued=True)
        finally:
            self._filling = False

    # -- the shared timer heap ---------------------------------------------------------

    def _push(self, deadline: float, tid: str) -> None:
        """Add ``tid`` to the bucket of the millisecond its deadline falls in (rounded up)."""
        key = math.ceil(deadline * 1000.0)
        buckets = self._buckets
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = tid
            heappush(self._heap, key)
        elif type(bucket) is str:
            buckets[key] = [bucket, tid]
        else:
            bucket.append(tid)  # type: ignore[union-attr]
        if deadline < self._wake_at:
            self._wake_at = deadline
            if not self._resched and self._loop is not None:
                self._resched = True
                self._loop.call_soon(self._reschedule)

    def _reschedule(self) -> None:
        self._resched = False
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if not self._heap or self._state != "running" or self._loop is None or self._held:
            self._wake_at = math.inf
            return
        due = self._heap[0] / 1000.0
        self._wake_at = due
        delay = min(max(0.0, due - time.time()), _MAX_SLEEP)
        self._wake = self._loop.call_later(delay, self._on_wake)

    def _on_wake(self) -> None:
        """Fire what is due, bucket by bucket, in slices so the loop stays responsive."""
        self._wake = None
        self._wake_at = math.inf
        heap = self._heap
        buckets = self._buckets
        now_ms = time.time() * 1000.0
        stop_at = time.perf_counter() + _FIRE_SLICE
        handled = 0
        self._firing = True
        try:
            while heap and heap[0] <= now_ms:
                key = heappop(heap)
                bucket = buckets.pop(key)
                tids = (bucket,) if type(bucket) is str else bucket
                for index, tid in enumerate(tids):
                    self._due(key, tid)
                    handled += 1
                    if self._held or (not handled & 63 and time.perf_counter() > stop_at):
                        rest = list(tids[index + 1 :])
                        if rest:
                            self._requeue(key, rest)
                        return
        finally:
            self._firing = False
            self._fill()
            self._reschedule()

    def _forget_deadline(self) -> None:
        """Count a heap entry made stale early; rebuild the heap when most entries are."""
        self._stale += 1
        if self._stale > _COMPACT_MIN and self._stale > len(self._entries) and not self._firing:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the timer heap from live entries (cancelled ones would linger until due)."""
        self._stale = 0
        self._heap = []
        self._buckets = {}
        buckets = self._buckets
        for tid, entry in self._entries.items():
            deadline = entry.deadline
            if deadline is None or (type(entry) is _Run and entry.state != _RUNNING):
                continue
            key = math.ceil(deadline * 1000.0)
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = tid
            elif type(bucket) is str:
                buckets[key] = [bucket, tid]
            else:
                bucket.append(tid)  # type: ignore[union-attr]
        self._heap = list(buckets)
        heapify(self._heap)
        if self._loop is not None and self._state == "running":
            self._reschedule()

    def _requeue(self, key: int, rest: list[str]) -> None:
        """Put back the part of a bucket that the last slice did not reach, in order."""
        later = self._buckets.get(key)
        if later is None:
            self._buckets[key] = rest
            heappush(self._heap, key)
        else:  # triggers added to this millisecond while the bucket was being fired
            rest.extend((later,) if type(later) is str else later)
            self._buckets[key] = rest

    def _due(self, key: int, tid: str) -> None:
        """A bucket entry came due: fire the timer or expire the trigger, unless stale."""
        entry = self._entries.get(tid)
        if entry is None:
            return  # cancelled or finished
        deadline = entry.deadline
        if deadline is None or math.ceil(deadline * 1000.0) != key:
            return  # stale: re-added with another deadline, or now a timer due later
        kind = type(entry)
        if kind is _Timer:
            del self._entries[tid]
            self._active -= 1
            self._timers -= 1
            self._fire_timer(tid, entry)  # type: ignore[arg-type]
        elif kind is _Expiry:
            del self._entries[tid]
            self._active -= 1
            self._timers -= 1
            self._emit_timeout(tid, deadline, entry.context)
        elif kind is _Pending:
            del self._entries[tid]
            self._pending_count -= 1
            self._emit_timeout(tid, deadline, entry.context)
        else:
            assert isinstance(entry, _Run)
            if entry.closing == _CLOSING:
                entry.closing = _CLOSE_EXPIRED  # closing run() overran: cancel it
                if entry.task is not None:
                    entry.task.cancel()
            elif entry.state == _RUNNING:
                self._begin_stop(entry)
                self._emit_timeout(tid, deadline, entry.context)

    def _fire_timer(self, tid: str, timer: _Timer) -> None:
        fired = time.time()
        self.metrics.fire_lag.observe(fired - timer.deadline)
        payload = timer.payload
        due = _from_epoch(timer.deadline)
        if payload is _AT_DEADLINE:
            payload = due
        end = timer.end
        try:
            event_id = make_event_id(tid, "fired", payload)
            xcoms = None if end is None else end.xcoms
            if xcoms is not None:
                to_tagged(xcoms)
        except Exception as exc:
            self._emit_failure(tid, timer.context, f"event cannot be serialized: {exc}", None)
            return
        self.metrics.fired += 1
        self._deliver(
            TriggerOutcome(
                tid,
                "fired",
                payload,
                event_id,
                None if end is None else end.task_instance_state,  # type: ignore[arg-type]
                xcoms,
                None,
                None,
                due,
                _from_epoch(fired),
                timer.context,
                True,
            )
        )

    # -- coroutine triggers ------------------------------------------------------------

    async def _lifecycle(self, run: _Run) -> None:
        """The task of one coroutine trigger: iterate run(), then clean up and release."""
        try:
            await self._pump(run)
        except asyncio.CancelledError:
            if run.state == _STOPPING:
                return  # our own cancellation: the stopper cleans up and releases
            # Cancelled from outside (loop shutdown): clean up quietly, then propagate.
            run.state = _FINISHING
            try:
                await self._cleanup([run])
            finally:
                self._release(run)
            raise
        if run.state == _RUNNING:
            run.state = _FINISHING
        if run.state == _FINISHING:
            try:
                await self._cleanup([run])
            finally:
                self._release(run)

    async def _pump(self, run: _Run) -> None:
        """Iterate ``run()``, emitting events; every error becomes a failed outcome."""
        trigger = run.trigger
        try:
            agen = trigger.run()
        except Exception as exc:
            self._fail(run, exc)
            return
        if not hasattr(agen, "__anext__"):
            close = getattr(agen, "close", None)
            if asyncio.iscoroutine(agen) and close is not None:
                close()
            self._fail(
                run,
                f"{_classpath(trigger)}.run() must be an async generator (async def with "
                f"yield), but it returned {type(agen).__name__}",
            )
            return
        ahead: asyncio.Task[Any] | None = None
        closed = False
        try:
            while True:
                if ahead is None:
                    event = await _anext(agen)
                else:
                    event, ahead = await ahead, None
                if event is _EXHAUSTED:
                    closed = True
                    if run.events == 0 and run.state == _RUNNING:
                        self._fail(
                            run,
                            f"{_classpath(trigger)}.run() returned without yielding an event",
                        )
                    return
                if run.state != _RUNNING:
                    return  # stopped while it ignored cancellation: emit nothing
                if not isinstance(event, TriggerEvent):
                    self._fail(
                        run,
                        f"{_classpath(trigger)}.run() yielded {type(event).__name__}, "
                        "not a TriggerEvent",
                    )
                    return
                run.events += 1
                if run.max_events is not None and run.events >= run.max_events:
                    self._emit_event(run, event, final=True)
                    return
                # Look one step ahead: when run() returns right after this yield, the
                # event is the last one and is marked final.
                assert self._loop is not None
                ahead = self._loop.create_task(_anext(agen), name=_TASK_PREFIX + run.tid)
                await asyncio.sleep(0)
                if (
                    ahead.done()
                    and not ahead.cancelled()
                    and ahead.exception() is None
                    and ahead.result() is _EXHAUSTED
                ):
                    closed = True
                    self._emit_event(run, event, final=True)
                    return
                if not self._emit_event(run, event, final=False):
                    return
        except asyncio.CancelledError:
            closed = True  # the cancellation went through the generator and closed it
            raise
        except Exception as exc:
            closed = True
            self._fail(run, exc)
        finally:
            if ahead is not None and not ahead.done():
                ahead.cancel()
                closed = True
            if not closed:
                await self._close_generator(run, agen)

    async def _close_generator(self, run: _Run, agen: AsyncIterator[Any]) -> None:
        """Close ``run()`` (its ``finally`` blocks run), bounded by ``cleanup_timeout``.

        The bound is an entry in the shared timer heap that cancels this task when due,
        cheaper than an ``asyncio.timeout`` handle per trigger.
        """
        aclose = getattr(agen, "aclose", None)
        if aclose is None:
            return
        try:
            if self._entries.get(run.tid) is not run:  # a zombie: already released
                async with asyncio.timeout(self._cleanup_timeout):
                    await aclose()
                return
            run.closing = _CLOSING
            run.deadline = time.time() + self._cleanup_timeout
            self._push(run.deadline, run.tid)
            try:
                await aclose()
            except asyncio.CancelledError:
                if run.closing != _CLOSE_EXPIRED:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise TimeoutError from None
            finally:
                if run.closing == _CLOSING:
                    self._forget_deadline()
                run.closing = 0
                run.deadline = None
        except TimeoutError:
            logger.warning(
                "closing run() of %s took over %.1f s; abandoned",
                _classpath(run.trigger),
                self._cleanup_timeout,
                extra=_log_extra(run.tid, run.context),
            )
        except Exception:
            logger.warning(
                "closing run() of %s raised",
                _classpath(run.trigger),
                exc_info=True,
                extra=_log_extra(run.tid, run.context),
            )

    def _begin_stop(self, run: _Run) -> None:
        """Stop a running trigger in the background (cancellation or timeout)."""
        run.state = _STOPPING
        assert self._loop is not None
        stopper = self._loop.create_task(self._stop_runs([run]))
        run.stopper = stopper
        self._stoppers.add(stopper)
        stopper.add_done_callback(self._stopper_done)

    async def _stop_runs(self, runs: Collection[_Run]) -> None:
        """Cancel, await (bounded), clean up (bounded) and release stopping triggers."""
        try:
            tasks = {r.task: r for r in runs if r.task is not None and not r.task.done()}
            for task in tasks:
                task.cancel()
            if tasks:
                _, stuck = await asyncio.wait(tasks, timeout=self._cleanup_timeout)
                for task in stuck:
                    run = tasks[task]
                    self._abandon(
                        task,
                        run,
                        f"run() of {_classpath(run.trigger)} ignored cancellation for "
                        f"{self._cleanup_timeout:.1f} s; abandoned",
                    )
            await self._cleanup(runs)
        finally:
            for run in runs:
                self._release(run)

    async def _cleanup(self, runs: Iterable[_Run]) -> None:
        """Await ``cleanup()`` of each trigger once, all together, bounded by the timeout."""
        assert self._loop is not None
        tasks: dict[asyncio.Task[None], _Run] = {}
        for run in runs:
            if run.cleaned:
                continue
            run.cleaned = True
            if type(run.trigger).cleanup is BaseTrigger.cleanup:
                continue
            task = self._loop.create_task(self._call_cleanup(run), name=_CLEANUP_PREFIX + run.tid)
            tasks[task] = run
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=self._cleanup_timeout)
        for task in stuck:
            task.cancel()
            run = tasks[task]
            self._abandon(
                task,
                run,
                f"cleanup() of {_classpath(run.trigger)} did not finish within "
                f"{self._cleanup_timeout:.1f} s; abandoned",
            )

    async def _call_cleanup(self, run: _Run) -> None:
        try:
            await run.trigger.cleanup()
        except Exception:
            logger.warning(
                "cleanup() of %s raised",
                _classpath(run.trigger),
                exc_info=True,
                extra=_log_extra(run.tid, run.context),
            )

    def _abandon(self, task: asyncio.Task[Any], run: _Run, message: str) -> None:
        self.metrics.abandoned += 1
        logger.warning(message, extra=_log_extra(run.tid, run.context))
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned_done)

    def _abandoned_done(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: it was reported when abandoned

    def _stopper_done(self, task: asyncio.Task[None]) -> None:
        self._stoppers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("stopping a trigger failed", exc_info=task.exception())

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("trigger task failed unexpectedly", exc_info=task.exception())

    def _release(self, run: _Run) -> None:
        """Give the trigger's capacity back and forget it."""
        if run.state == _DONE:
            return
        run.state = _DONE
        if self._entries.get(run.tid) is run:
            del self._entries[run.tid]
            self._active -= 1
            if run.deadline is not None and run.deadline > time.time():
                self._forget_deadline()
            self._fill()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger finished", extra=_log_extra(run.tid, run.context))

    # -- outcomes ----------------------------------------------------------------------

    def _emit_event(self, run: _Run, event: TriggerEvent, *, final: bool) -> bool:
        """Emit one event; False (and a failure instead) when it cannot be serialized."""
        if run.state != _RUNNING:
            return False
        payload = event.payload
        end = event if isinstance(event, BaseTaskEndEvent) else None
        xcoms = None if end is None else end.xcoms
        try:
            event_id = make_event_id(run.tid, "fired", payload)
            if xcoms is not None:
                to_tagged(xcoms)
        except Exception as exc:
            self._fail(
                run, f"{_classpath(run.trigger)} yielded an event that cannot be serialized: {exc}"
            )
            return False
        if final:
            run.state = _FINISHING
        self.metrics.fired += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger fired", extra=_log_extra(run.tid, run.context))
        self._deliver(
            TriggerOutcome(
                run.tid,
                "fired",
                payload,
                event_id,
                None if end is None else end.task_instance_state,  # type: ignore[arg-type]
                xcoms,
                None,
                None,
                None,
                dt.datetime.now(_UTC),
                run.context,
                final,
            )
        )
        return True

    def _fail(self, run: _Run, error: BaseException | str) -> None:
        if run.state != _RUNNING:
            return
        run.state = _FINISHING
        if isinstance(error, BaseException):
            message = _describe_error(error)
            tb = "".join(traceback.format_exception(error))
        else:
            message, tb = error, None
        self._emit_failure(run.tid, run.context, message, tb)

    def _emit_failure(self, tid: str, context: object, message: str, tb: str | None) -> None:
        self.metrics.failed += 1
        logger.warning("trigger failed: %s", message, extra=_log_extra(tid, context))
        self._deliver(
            TriggerOutcome(
                tid,
                "failed",
                None,
                make_event_id(tid, "failed", None),
                None,
                None,
                message,
                tb,
                None,
                dt.datetime.now(_UTC),
                context,
                True,
            )
        )

    def _emit_timeout(self, tid: str, deadline: float, context: object) -> None:
        fired = time.time()
        self.metrics.timed_out += 1
        self.metrics.fire_lag.observe(fired - deadline)
        due = _from_epoch(deadline)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "trigger timed out (due %s)", due.isoformat(), extra=_log_extra(tid, context)
            )
        self._deliver(
            TriggerOutcome(
                tid,
                "timed_out",
                None,
                make_event_id(tid, "timed_out", None),
                None,
                None,
                f"trigger timed out at {due.isoformat()}",
                None,
                due,
                _from_epoch(fired),
                context,
                True,
            )
        )

    def _deliver(self, outcome: TriggerOutcome) -> None:
        try:
            self._on_event(outcome)
        except Exception:
            self.metrics.callback_errors += 1
            logger.exception(
                "on_event raised for %s outcome",
                outcome.status,
                extra=_log_extra(outcome.trigger_id, outcome.context),
            )

    # -- watchdog ----------------------------------------------------------------------

    def _describe_task(self, task: asyncio.Task[Any] | None) -> tuple[str | None, str]:
        """Name what the loop is running (called from the watchdog thread)."""
        if task is None:
            if self._firing:
                return None, "the supervisor's timer callback (firing due timers into on_event)"
            return None, "a loop callback outside any task"
        name = task.get_name()
        for prefix, what in ((_TASK_PREFIX, "run()"), (_CLEANUP_PREFIX, "cleanup()")):
            if name.startswith(prefix):
                tid = name[len(prefix) :]
                entry = self._entries.get(tid)
                trigger = getattr(entry, "trigger", None)
                cls = _classpath(trigger) if trigger is not None else "unknown class"
                return tid, f"trigger {tid} ({cls}) in {what}"
        return None, f"task {name!r}"

    def _on_blocked(self, episode: BlockedLoop) -> None:
        with self._metrics_lock:
            if not episode.ended or episode.culprit.startswith("unknown"):
                self.metrics.blocked_loop += 1
            if episode.ended:
                self.metrics.blocked_seconds += episode.seconds
            self.metrics.last_blocked = (episode.trigger_id, episode.seconds)
        where = f" at {episode.location}" if episode.location else ""
        extra = {"trigger_id": episode.trigger_id, "blocked_seconds": round(episode.seconds, 3)}
        if episode.ended:
            logger.warning(
                "event loop was blocked for %.3f s by %s%s",
                episode.seconds,
                episode.culprit,
                where,
                extra=extra,
            )
        else:
            hint = (
                "; triggers must not block (use asyncio.to_thread for blocking calls)"
                if episode.trigger_id is not None
                else ""
            )
            logger.warning(
                "event loop blocked for %.3f s so far by %s%s%s",
                episode.seconds,
                episode.culprit,
                where,
                hint,
                extra=extra,
            )
