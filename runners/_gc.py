"""Cyclic-GC cadence for the long-running processes (triggerer, scheduler)."""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "collect_less_often", "spare_what_lives_now"]


YOUNG_THRESHOLD = 200_000
"""Net allocations between two collections of the youngest generation (CPython's default: 700).

Above what a member holds in flight at once: a round of 10,000 fired triggers, or a fold of
as many events with its decisions, is some 100,000 tracked objects that die when the round
commits. Collected every 50,000, each round was walked once or twice before it died, and at a
million tasks every pass missed the cache on the old objects they point at (about 1.2 µs an
object): 116 passes of 50 to 85 ms, a sixth of the scheduler's CPU, while a million timers
fired (docs/history/2026-12-07.md, "A million due at once"). The price is a longer pause
when one comes: up to about 0.3 s at a million tasks, 50 to 85 ms before.
"""


def collect_less_often() -> None:
    """Collect the youngest generation every :data:`YOUNG_THRESHOLD` net allocations.

    A triggerer or scheduler holds hundreds of thousands of long-lived objects (tables,
    waiting triggers, task views) and allocates a few short-lived ones per record; at the
    default cadence the collector runs thousands of times a second under load and each
    older-generation pass walks those objects again. Measured on the scheduler against the
    default: CPU per resumed task 145 → 106 µs (docs/benchmarks.md). Garbage without cycles is
    freed by reference counting as before; only cycles wait a little longer.
    """
    gc.set_threshold(YOUNG_THRESHOLD, 20, 100)


def spare_what_lives_now() -> None:
    """Move every object alive now out of the collector's reach (``gc.freeze``).

    Called once a process has built its long-lived state (the scheduler's fold, restored or
    read from the tasks topic): hundreds of thousands of objects that no collection would
    free are then never rescanned. Only for processes: in a library call it would keep the
    garbage cycles of everything else alive now.
    """
    gc.freeze()
