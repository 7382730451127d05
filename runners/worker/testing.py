"""Internals of deferline.runners.worker for deferline's tests and benchmarks only."""

from ._metrics import WorkerCollector
from ._state import AttemptProgress, OffsetTracker, SlotPool, WorkerMetrics, run_progress

__all__ = [
    "AttemptProgress",
    "OffsetTracker",
    "SlotPool",
    "WorkerCollector",
    "WorkerMetrics",
    "run_progress",
]
