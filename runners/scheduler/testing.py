"""Internals of deferline.runners.scheduler for deferline's tests and benchmarks only."""

from ._checkpoint import Checkpoints, merge_states, split_delta
from ._cli import _parse_pools as parse_pools
from ._fold import TaskFold
from ._metrics import pool_ledger_metrics
from ._ownership import Ownership
from ._phase import Phase, PhaseMachine
from ._records import orphan_letter, read_as, read_event, waves
from ._routing import PartitionRouter
from ._standby import Standby
from ._tasks_topic import TasksReader
from ._writers import BATCHES_AHEAD

__all__ = [
    "BATCHES_AHEAD",
    "Checkpoints",
    "Ownership",
    "PartitionRouter",
    "Phase",
    "PhaseMachine",
    "Standby",
    "TaskFold",
    "TasksReader",
    "merge_states",
    "orphan_letter",
    "parse_pools",
    "pool_ledger_metrics",
    "read_as",
    "read_event",
    "split_delta",
    "waves",
]
