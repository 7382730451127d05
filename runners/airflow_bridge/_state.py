"""The bridge's lifecycle: one state, one transition table, one method that moves it."""

from __future__ import annotations

import enum
from typing import Final

from .._transitions import IllegalTransition, checked

__all__ = ["BridgeLifecycle", "BridgeState", "IllegalTransition"]


class BridgeState(enum.Enum):
    """NEW → STARTING → RUNNING → STOPPING → STOPPED; FAILED when a loop died on its own."""

    NEW = "new"
    STARTING = "starting"
    """Airflow loaded, the job row written, the Kafka clients starting."""
    RUNNING = "running"
    """Claiming rows and writing events back."""
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_S = BridgeState
_MOVES: Final[dict[BridgeState, frozenset[BridgeState]]] = {
    _S.NEW: frozenset({_S.STARTING, _S.STOPPED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.STOPPING, _S.FAILED}),
    _S.RUNNING: frozenset({_S.STOPPING, _S.FAILED}),
    _S.FAILED: frozenset({_S.STOPPING}),
    _S.STOPPING: frozenset({_S.STOPPED}),
    _S.STOPPED: frozenset(),
}


class BridgeLifecycle:
    """Where the bridge is in its life; every move is checked against the table."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = BridgeState.NEW

    def move(self, to: BridgeState) -> None:
        """Move to ``to``, or raise :class:`IllegalTransition`."""
        self.state = checked("bridge", _MOVES, self.state, to)

    def can_move(self, to: BridgeState) -> bool:
        return to in _MOVES[self.state]
