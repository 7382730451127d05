"""The supervisor's coroutine triggers: one task iterates each ``run()``; stop, close and
cleanup are bounded by ``cleanup_timeout``."""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from typing import Any, Final

from ._errors import SupervisorError
from ._metrics import SupervisorMetrics
from ._supervisor_outcomes import OutcomeSink, fired_outcome
from ._supervisor_state import (
    _CLEANUP_PREFIX,
    _CURRENT_TRIGGER,
    _TASK_PREFIX,
    _UTC,
    _classpath,
    _describe_error,
    _log_extra,
    _Request,
)
from ._trigger import BaseTaskEndEvent, BaseTrigger, TriggerEvent

logger = logging.getLogger(__name__)


class RunState(enum.Enum):
    """Lifecycle of a coroutine trigger: RUNNING, then STOPPING or FINISHING, then DONE."""

    __hash__ = object.__hash__  # members are singletons; Enum's own hash runs in Python

    RUNNING = "running"
    """``run()`` is being iterated."""
    STOPPING = "stopping"
    """Cancelled or timed out: the stopper owns cleanup and release."""
    FINISHING = "finishing"
    """``run()`` ended on its own: its task owns cleanup and release."""
    DONE = "done"
    """Released: its slot is free."""


_RUNNING: Final = RunState.RUNNING
_STOPPING: Final = RunState.STOPPING
_FINISHING: Final = RunState.FINISHING
_DONE: Final = RunState.DONE
_MOVES: Final[dict[RunState, frozenset[RunState]]] = {
    _RUNNING: frozenset({_STOPPING, _FINISHING}),
    _STOPPING: frozenset({_DONE}),
    _FINISHING: frozenset({_DONE}),
    _DONE: frozenset(),
}


class CloseBound(enum.Enum):
    """Closing ``run()`` after its last event (its ``finally`` blocks), bounded through the
    timer heap: the run's deadline is then the close bound."""

    NONE = "none"
    ARMED = "armed"
    """Closing; the bound is on the heap."""
    EXPIRED = "expired"
    """The bound came due: the closing task is being cancelled."""


class _Exhausted:
    """Marker: the async generator has no more events."""


_EXHAUSTED: Final = _Exhausted()


async def _anext(agen: AsyncIterator[Any]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _EXHAUSTED


class _Run(_Request):
    """A coroutine trigger and the task that iterates its ``run()``.

    Its ``deadline`` is its timeout while RUNNING, its close bound while closing, else None.
    """

    __slots__ = ("cleaned", "close", "events", "killed", "state", "stopper", "task")

    def __init__(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
    ) -> None:
        super().__init__(tid, trigger, deadline, context, max_events)
        self.events = 0
        self.state = _RUNNING
        self.cleaned = False
        self.killed = False  # cancelled by a user: on_kill() before cleanup()
        self.close = CloseBound.NONE
        self.task: asyncio.Task[None] | None = None
        self.stopper: asyncio.Task[None] | None = None


class CoroutineRunner:
    """Owns the lifecycle of every coroutine trigger: start, events, stop, close, cleanup
    and release, each bounded by ``cleanup_timeout``.

    Its host keeps the deadlines and the slots: ``arm`` puts a deadline on the timer heap
    (and calls :meth:`deadline_due` when it comes due), ``forget`` reports one made stale
    early, ``release`` gives a finished run's slot back.
    """

    def __init__(
        self,
        *,
        sink: OutcomeSink,
        metrics: SupervisorMetrics,
        cleanup_timeout: float,
        arm: Callable[[float, str], None],
        forget: Callable[[], None],
        release: Callable[[_Run], None],
    ) -> None:
        self._sink = sink
        self._metrics = metrics
        self._cleanup_timeout = cleanup_timeout
        self._arm = arm
        self._forget = forget
        self._release_slot = release
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stoppers: set[asyncio.Task[None]] = set()
        self._abandoned: set[asyncio.Task[Any]] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on ``loop`` from now on."""
        self._loop = loop

    # -- what the supervisor calls ----------------------------------------------------------

    def start(self, run: _Run) -> None:
        """Start iterating ``run()`` in a task of its own."""
        run.trigger.trigger_id = run.tid
        assert self._loop is not None
        run.task = self._loop.create_task(self._lifecycle(run), name=_TASK_PREFIX + run.tid)
        run.task.add_done_callback(self._task_done)

    def stop(self, run: _Run, *, kill: bool = False) -> None:
        """Stop a RUNNING trigger in the background (cancellation or timeout); ``kill``: a
        user cancelled it, so its ``on_kill()`` is awaited before its ``cleanup()``."""
        run.killed = kill
        self._move(run, _STOPPING)
        assert self._loop is not None
        stopper = self._loop.create_task(self._stop_runs([run]))
        run.stopper = stopper
        self._stoppers.add(stopper)
        stopper.add_done_callback(self._stopper_done)

    def deadline_due(self, run: _Run) -> bool:
        """The run's deadline came due: expire its close bound, or stop it on its timeout.
        True when it timed out (the caller emits the timeout)."""
        if run.close is CloseBound.ARMED:
            run.close = CloseBound.EXPIRED  # closing run() overran: cancel it
            if run.task is not None:
                run.task.cancel()
            return False
        if run.state is _RUNNING:
            self.stop(run)
            return True
        return False

    def stop_all(self, runs: Iterable[_Run]) -> list[asyncio.Future[Any]]:
        """Stop every RUNNING run together; returns what to await until all are released."""
        runs = list(runs)
        stopping = [run for run in runs if run.state is _RUNNING]
        for run in stopping:
            self._move(run, _STOPPING)
        waits: list[asyncio.Future[Any]] = [
            run.task for run in runs if run.state is _FINISHING and run.task is not None
        ]
        waits.extend(self._stoppers)
        if stopping:
            waits.append(asyncio.ensure_future(self._stop_runs(stopping)))
        return waits

    def cancel_abandoned(self) -> None:
        """Cancel the tasks given up on (they ignored cancellation or hung in cleanup)."""
        for task in list(self._abandoned):
            task.cancel()
        if self._abandoned:
            logger.warning(
                "%d abandoned trigger task(s) still running at stop", len(self._abandoned)
            )

    # -- the lifecycle ------------------------------------------------------------------------

    def _move(self, run: _Run, state: RunState) -> None:
        """The one place a run's state changes; a RUNNING run's timeout goes stale with it."""
        if state not in _MOVES[run.state]:
            raise SupervisorError(
                f"trigger {run.tid} cannot go from {run.state.value} to {state.value}"
            )
        if run.state is _RUNNING and run.deadline is not None:
            if run.deadline > time.time():
                self._forget()
            run.deadline = None
        run.state = state

    async def _lifecycle(self, run: _Run) -> None:
        """The task of one coroutine trigger: iterate run(), then clean up and release."""
        cancelled: asyncio.CancelledError | None = None
        try:
            await self._pump(run)
        except asyncio.CancelledError as exc:
            if run.state is _STOPPING:
                return  # our own cancellation: the stopper cleans up and releases
            cancelled = exc  # from outside (loop shutdown): clean up quietly, then propagate
        if run.state is _RUNNING:
            self._move(run, _FINISHING)
        if run.state is _FINISHING:
            try:
                await self._cleanup([run])
            finally:
                self._release(run)
        if cancelled is not None:
            raise cancelled

    async def _pump(self, run: _Run) -> None:
        """Iterate ``run()``, emitting events; every error becomes a failed outcome."""
        trigger = run.trigger
        _CURRENT_TRIGGER.set(run.tid)  # this task's context: its own, not the caller's
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
                    if run.events == 0 and run.state is _RUNNING:
                        self._fail(
                            run,
                            f"{_classpath(trigger)}.run() returned without yielding an event",
                        )
                    return
                if run.state is not _RUNNING:
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

    def _emit_event(self, run: _Run, event: TriggerEvent, *, final: bool) -> bool:
        """Emit one event; False (and a failure instead) when it cannot be serialized."""
        if run.state is not _RUNNING:
            return False
        end = event if isinstance(event, BaseTaskEndEvent) else None
        try:
            outcome = fired_outcome(
                run.tid, event.payload, end, run.context, final, None, dt.datetime.now(_UTC)
            )
        except Exception as exc:
            self._fail(
                run, f"{_classpath(run.trigger)} yielded an event that cannot be serialized: {exc}"
            )
            return False
        source = getattr(event, "source", None)
        if source is not None:
            outcome = outcome._replace(source=source)
        if final:
            self._move(run, _FINISHING)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger fired", extra=_log_extra(run.tid, run.context))
        self._sink.fired(outcome)
        return True

    def _fail(self, run: _Run, error: BaseException | str) -> None:
        if run.state is not _RUNNING:
            return
        self._move(run, _FINISHING)
        if isinstance(error, BaseException):
            message = _describe_error(error)
            tb = "".join(traceback.format_exception(error))
        else:
            message, tb = error, None
        self._sink.failed(run.tid, run.context, message, tb)

    async def _close_generator(self, run: _Run, agen: AsyncIterator[Any]) -> None:
        """Close ``run()`` (its ``finally`` blocks run), bounded by ``cleanup_timeout``.

        The bound is the run's deadline on the shared timer heap, which cancels this task
        when due: cheaper than an ``asyncio.timeout`` handle per trigger.
        """
        aclose = getattr(agen, "aclose", None)
        if aclose is None:
            return
        try:
            if run.state is _DONE:  # a zombie: already released
                async with asyncio.timeout(self._cleanup_timeout):
                    await aclose()
                return
            run.close = CloseBound.ARMED
            run.deadline = time.time() + self._cleanup_timeout
            self._arm(run.deadline, run.tid)
            try:
                await aclose()
            except asyncio.CancelledError:
                if run.close is not CloseBound.EXPIRED:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise TimeoutError from None
            finally:
                if run.close is CloseBound.ARMED:
                    self._forget()
                run.close = CloseBound.NONE
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
            if type(run.trigger).cleanup is BaseTrigger.cleanup and not run.killed:
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
        hooks = (run.trigger.on_kill, run.trigger.cleanup) if run.killed else (run.trigger.cleanup,)
        for hook in hooks:
            try:
                await hook()
            except Exception:
                logger.warning(
                    "%s() of %s raised",
                    hook.__name__,
                    _classpath(run.trigger),
                    exc_info=True,
                    extra=_log_extra(run.tid, run.context),
                )

    def _abandon(self, task: asyncio.Task[Any], run: _Run, message: str) -> None:
        self._metrics.abandoned += 1
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
        """Give the trigger's slot back and forget it (once)."""
        if run.state is _DONE:
            return
        self._move(run, _DONE)
        self._release_slot(run)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("trigger finished", extra=_log_extra(run.tid, run.context))
