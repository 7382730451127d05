"""The scheduler process's lifecycle: one explicit state machine (each partition's is
:mod:`._ownership`)."""

from __future__ import annotations

import asyncio
import enum

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
    """The current phase, its allowed moves, and a way to wait for one."""

    __slots__ = ("_changed", "phase")

    def __init__(self) -> None:
        self.phase = Phase.NEW
        self._changed = asyncio.Event()

    def move(self, to: Phase) -> None:
        """Move to ``to``; ValueError if the lifecycle has no such move (staying put is
        allowed)."""
        if to is self.phase:
            return
        if to not in _MOVES[self.phase]:
            raise ValueError(f"scheduler cannot go from {self.phase.value} to {to.value}")
        self.phase = to
        self._changed.set()
        self._changed = asyncio.Event()

    def is_(self, *phases: Phase) -> bool:
        return self.phase in phases

    async def reach(self, *phases: Phase) -> None:
        """Wait until the phase is one of ``phases``."""
        while self.phase not in phases:
            await self._changed.wait()
