"""The worker's bookkeeping, without I/O: attempt progress (dedup), offsets and slots.

Dedup is derived from the tasks topic, the one log every party writes task progress to:
a RunTask is a duplicate when the task instance has already moved past the run it asks for
(see :func:`run_progress`). Because the state lives in Kafka, it survives a worker restart
and holds across workers of a group (a redelivered or re-sent RunTask may land anywhere).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

from deferline.engine import progress
from deferline.schemas import RunTask, TaskStateRecord

__all__ = [
    "AttemptProgress",
    "OffsetTracker",
    "SlotPool",
    "WorkerMetrics",
    "run_progress",
]

Progress = tuple[int, int, int]


def run_progress(run: RunTask) -> Progress:
    """Where the "running" record of this RunTask sits in its task's life.

    A start of try ``T`` runs at ``(T, 0, 2)``; the resume after deferral ``S`` runs at
    ``(T, S + 1, 3)`` (the same order the scheduler's state machine uses).
    """
    if run.mode == "start":
        return (run.task.try_number, 0, 2)
    return (run.task.try_number, run.defer_seq + 1, 3)


class AttemptProgress:
    """Furthest progress seen per task instance (``ti_key``), from any writer.

    Monotone: a record behind what is known never moves it back, so the order in which the
    worker's own writes and the tasks topic's echo of them arrive does not matter.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, Progress] = {}

    def observe(self, record: TaskStateRecord) -> None:
        """Fold one record of the tasks topic (or one the worker is about to write)."""
        key = record.task.ti_key
        at = progress(record)
        if at > self._seen.get(key, (-1, -1, -1)):
            self._seen[key] = at

    def forget(self, ti_key: str) -> None:
        """Drop a task instance (its key was tombstoned on the tasks topic)."""
        self._seen.pop(ti_key, None)

    def is_duplicate(self, run: RunTask) -> bool:
        """True when the task has moved past this run: it already ran (and finished) it.

        A run whose own "running" record is the furthest progress is *not* a duplicate:
        its worker may have died mid-run, and the redelivered RunTask must run again.
        """
        seen = self._seen.get(run.task.ti_key)
        return seen is not None and seen > run_progress(run)

    def __len__(self) -> int:
        return len(self._seen)


class OffsetTracker:
    """Committable offsets when records of a partition finish out of order.

    Each partition commits up to (not including) its lowest unfinished offset.
    """

    __slots__ = ("_committed", "_done", "_pending")

    def __init__(self) -> None:
        self._pending: dict[object, set[int]] = {}
        self._done: dict[object, int] = {}
        self._committed: dict[object, int] = {}

    def started(self, tp: object, offset: int) -> None:
        """A record was taken from ``tp`` at ``offset``."""
        self._pending.setdefault(tp, set()).add(offset)
        if offset + 1 > self._done.get(tp, -1):
            self._done[tp] = offset + 1

    def finished(self, tp: object, offset: int) -> None:
        """The record at ``offset`` is fully handled (its outcome is durable)."""
        pending = self._pending.get(tp)
        if pending is not None:
            pending.discard(offset)

    def in_flight(self, tp: object) -> int:
        """How many records of ``tp`` are not finished yet."""
        return len(self._pending.get(tp, ()))

    def committable(self) -> dict[object, int]:
        """Offsets to commit now (only partitions that moved since the last call)."""
        out: dict[object, int] = {}
        for tp, high in self._done.items():
            pending = self._pending.get(tp)
            offset = min(pending) if pending else high
            if offset > self._committed.get(tp, -1):
                out[tp] = offset
        return out

    def committed(self, offsets: dict[object, int]) -> None:
        """Record that ``offsets`` were committed."""
        for tp, offset in offsets.items():
            self._committed[tp] = max(offset, self._committed.get(tp, -1))

    def drop(self, tps: Iterable[object]) -> None:
        """Forget partitions that were revoked."""
        for tp in tps:
            self._pending.pop(tp, None)
            self._done.pop(tp, None)
            self._committed.pop(tp, None)


@dataclasses.dataclass(slots=True)
class WorkerMetrics:
    """Running totals of one worker (exported as metrics and printed at shutdown)."""

    started: int = 0
    resumed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    skipped: int = 0
    deferred: int = 0
    duplicates: int = 0
    slot_seconds: float = 0.0
    """Worker-slot time spent running operator code and publishing its outcome."""

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


class SlotPool:
    """Worker slots: how many RunTasks may be taken now.

    The consumer loop takes only as many records as there are free slots, so work waits
    in Kafka (where resumes can overtake it), not in the worker.
    """

    __slots__ = ("_changed", "_free", "busy_peak", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a worker needs at least one slot")
        self.size = size
        self._free = size
        self._changed = asyncio.Event()
        self.busy_peak = 0

    @property
    def free(self) -> int:
        return self._free

    @property
    def busy(self) -> int:
        return self.size - self._free

    async def wait_free(self) -> int:
        """Wait until a slot is free; returns how many are."""
        while self._free == 0:
            self._changed.clear()
            await self._changed.wait()
        return self._free

    def take(self, n: int = 1) -> None:
        """Reserve ``n`` slots (the caller checked :attr:`free`)."""
        if n > self._free:
            raise ValueError(f"only {self._free} slot(s) free, asked for {n}")
        self._free -= n
        self.busy_peak = max(self.busy_peak, self.busy)

    def give_back(self) -> None:
        """Release one slot and wake whoever waits for one."""
        if self._free >= self.size:
            raise ValueError("no slot is taken")
        self._free += 1
        self._changed.set()
