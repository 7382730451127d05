"""Internals exposed for deferline's own tests and benchmarks.

Not part of the public API: no compatibility promise; names here move or go without notice.
"""

from ._state import AttemptProgress, OffsetTracker, SlotPool, run_progress

__all__ = ["AttemptProgress", "OffsetTracker", "SlotPool", "run_progress"]
