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
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Final

from deferline.schemas import make_event_id

from ._coroutine_runs import _CoroutineRuns
from ._errors import SupervisorError
from ._metrics import SupervisorMetrics
from ._outcome import TriggerOutcome
from ._supervisor_outcomes import _Outcomes
from ._supervisor_state import (
    _AT_DEADLINE,
    _FINISHING,
    _RUNNING,
    _STOPPING,
    _TASK_PREFIX,
    _UTC,
    _classpath,
    _describe_error,
    _Entry,
    _epoch,
    _Expiry,
    _from_epoch,
    _log_extra,
    _Pending,
    _Run,
    _Timer,
)
from ._supervisor_watchdog import _WatchdogHandOff
from ._timer_heap import _TimerHeap
from ._trigger import BaseTaskEndEvent, BaseTrigger, TimerSpec, TriggerEvent
from ._watchdog import LoopWatchdog

__all__ = ["TriggerSupervisor"]

logger = logging.getLogger(__name__)

_CANCEL_SLICE = 2000  # cancel_many gives the loop back after this many triggers

# Below 2**32 s (the year 2106) the epoch float of a datetime is within half a microsecond of
# it, so the datetime rebuilt from the float is the datetime itself; past that, compare.
_EPOCH_EXACT: Final = 2.0**32


class TriggerSupervisor(_TimerHeap, _CoroutineRuns, _Outcomes, _WatchdogHandOff):
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
        self._last_due: tuple[float, dt.datetime, bytes] | None = None
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

    async def cancel(self, trigger_id: str, *, kill: bool = False) -> bool:
        """Stop a trigger, await its cleanup (bounded) and emit nothing; False if unknown.

        ``kill``: a user cancelled it, so a running coroutine trigger's ``on_kill()`` is
        awaited before its ``cleanup()`` (within the same bound).
        """
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
            entry.killed = kill
            logger.debug("trigger cancelled", extra=_log_extra(trigger_id, entry.context))
            self._begin_stop(entry)
        waiter = entry.stopper if entry.stopper is not None else entry.task
        if waiter is not None and not waiter.done():
            # asyncio.wait never cancels what it waits for: the stop completes even if our
            # caller is cancelled meanwhile.
            await asyncio.wait({waiter}, timeout=3 * self._cleanup_timeout)
        return True

    async def cancel_many(self, trigger_ids: Iterable[str]) -> int:
        """Cancel many triggers like :meth:`cancel`; returns how many were present.

        Waiting timers and pending triggers are dropped on the spot (cancelling one never
        suspends), so only coroutine triggers are stopped as tasks, together. Cancelling the
        tens of thousands of timers of a released partition through one task each cost
        more than a second on the way out of a rebalance or a shutdown. The loop is given
        back every few thousand triggers.
        """
        entries = self._entries
        runs: list[str] = []
        waiting: list[str] = []
        count = 0
        for tid in trigger_ids:
            entry = entries.get(tid)
            if entry is None:
                continue
            kind = type(entry)
            if kind is _Pending:  # first: a freed slot must not admit one of these
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
                    and (0 <= fire_at < _EPOCH_EXACT or _from_epoch(fire_at) == payload)
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
