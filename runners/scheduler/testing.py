"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._checkpoint import Checkpoints, SchedulerCheckpoint, merge_states, split_delta
from ._cli import _parse_pools
from ._fold import TaskFold
from ._metrics import pool_ledger_metrics
from ._ownership import Hold, IllegalMove, Ownership
from ._phase import Phase, PhaseMachine
from ._records import orphan_letter, read_as, read_event, waves
from ._routing import PartitionRouter
from ._standby import Standby
from ._tasks_topic import TasksReader
from ._writers import BATCHES_AHEAD

__all__ = [
    "BATCHES_AHEAD",
    "Checkpoints",
    "Hold",
    "IllegalMove",
    "Ownership",
    "PartitionRouter",
    "Phase",
    "PhaseMachine",
    "SchedulerCheckpoint",
    "Standby",
    "TaskFold",
    "TasksReader",
    "_parse_pools",
    "merge_states",
    "orphan_letter",
    "pool_ledger_metrics",
    "read_as",
    "read_event",
    "split_delta",
    "waves",
]
