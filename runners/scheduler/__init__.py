"""The scheduler process: folds trigger events into task state and resumes tasks."""

from ._cli import scheduler_command
from ._pools import PoolChannel, PoolRecord
from ._scheduler import Scheduler, SchedulerError

__all__ = [
    "PoolChannel",
    "PoolRecord",
    "Scheduler",
    "SchedulerError",
    "scheduler_command",
]
