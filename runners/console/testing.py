"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

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
