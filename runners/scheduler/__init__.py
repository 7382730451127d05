"""The scheduler process: folds trigger events into task state and resumes tasks."""

from ._scheduler import (
    Scheduler,
    SchedulerError,
    SchedulerFenced,
    scheduler_command,
)

__all__ = [
    "Scheduler",
    "SchedulerError",
    "SchedulerFenced",
    "scheduler_command",
]
