"""Internals of deferline.runners.worker for deferline's tests and benchmarks only."""

from ._state import AttemptProgress, OffsetTracker, SlotPool, run_progress

__all__ = ["AttemptProgress", "OffsetTracker", "SlotPool", "run_progress"]
