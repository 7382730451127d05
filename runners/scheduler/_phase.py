"""The scheduler process's lifecycle: one explicit state machine (each partition's is
:mod:`._ownership`), and the waiting for a condition on it."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

from .._transitions import checked
from ._publishing import SchedulerError

__all__ = ["Phase", "PhaseMachine"]


class Phase(enum.Enum):
    NEW = "new"
    JOINING = "joining"  # in the group, taking over its first assignment
    RUNNING = "running"  # took over what it was given (see its Ownership for what it owns)
    FAILED = "failed"  # a loop raised; stop() is what is left
    STOPPED = "stopped"


_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.JOINING, Phase.STOPPED}),
    Phase.JOINING: frozenset({Phase.RUNNING, Phase.FAILED, Phase.STOPPED}),
    Phase.RUNNING: frozenset({Phase.FAILED, Phase.STOPPED}),
    Phase.FAILED: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}


class PhaseMachine:
    """The current phase, its allowed moves, and ways to wait for one or for a condition."""

    __slots__ = ("_changed", "phase")

    def __init__(self) -> None:
        self.phase = Phase.NEW
        self._changed = asyncio.Event()

    def move(self, to: Phase) -> None:
        """Move to ``to``; IllegalTransition if the lifecycle has no such move (staying put
        is allowed)."""
        if to is self.phase:
            return
        self.phase = checked("scheduler", _MOVES, self.phase, to)
        self.changed()

    def changed(self) -> None:
        """Wake the waiters: the phase, or something they wait for, changed (what the
        scheduler owns)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def is_(self, *phases: Phase) -> bool:
        return self.phase in phases

    async def reach(self, *phases: Phase) -> None:
        """Wait until the phase is one of ``phases``."""
        while self.phase not in phases:
            await self._changed.wait()

    async def wait_until(
        self, done: Callable[[], bool], main: Callable[[], asyncio.Task[None] | None]
    ) -> None:
        """Wait until ``done()`` (checked at each change, and every second); raises the
        error of the scheduler's ``main`` task if it ended first, SchedulerError if the
        scheduler failed or stopped first."""
        while not done():
            task = main()
            if self.phase in (Phase.FAILED, Phase.STOPPED) or (task is not None and task.done()):
                if task is not None and task.done():
                    await task  # raises its error
                raise SchedulerError("the scheduler stopped first")
            changed = self._changed
            watch: set[asyncio.Future[Any]] = {asyncio.ensure_future(changed.wait())}
            if task is not None:
                watch.add(task)
            try:
                await asyncio.wait(watch, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in watch:
                    if waiter is not task:
                        waiter.cancel()
