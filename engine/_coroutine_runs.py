"""The supervisor's coroutine triggers: one task iterates each ``run()``; stop, close and
cleanup are bounded by ``cleanup_timeout``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Iterable
from typing import Any

from ._supervisor_state import (
    _CLEANUP_PREFIX,
    _CLOSE_EXPIRED,
    _CLOSING,
    _DONE,
    _EXHAUSTED,
    _FINISHING,
    _RUNNING,
    _STOPPING,
    _TASK_PREFIX,
    _anext,
    _classpath,
    _log_extra,
    _Run,
    _SupervisorCore,
)
from ._trigger import BaseTrigger, TriggerEvent

logger = logging.getLogger(__name__)


class _CoroutineRuns(_SupervisorCore):
    """Coroutine triggers of a :class:`TriggerSupervisor` (a part of it, not used alone)."""

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
