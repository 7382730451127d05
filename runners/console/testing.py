"""Internals of deferline.runners.console for deferline's tests and benchmarks only."""

from ._feed import RecordFeed
from ._groups import GroupTracker
from ._loop import LoopStats, percentile
from ._status import ConsoleState, ConsoleStatus
from ._tail import TopicTail

__all__ = [
    "ConsoleState",
    "ConsoleStatus",
    "GroupTracker",
    "LoopStats",
    "RecordFeed",
    "TopicTail",
    "percentile",
]
