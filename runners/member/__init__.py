"""What every member of a partitioned consumer group shares, triggerer or scheduler: a
partition's lifecycle and what an assignment changes."""

from ._assignment import AssignmentDiff, diff_assignment
from ._lifecycle import MOVES, IllegalPartitionMove, PartitionPhase, moved

__all__ = [
    "MOVES",
    "AssignmentDiff",
    "IllegalPartitionMove",
    "PartitionPhase",
    "diff_assignment",
    "moved",
]
