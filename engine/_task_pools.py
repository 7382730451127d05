"""Pools: slot counts, and admitting scheduled tasks in priority-weight order."""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from deferline.schemas import (
    ResumeTarget,
    RunTask,
    TaskStateRecord,
)

from ._taskstate_values import HOLDING_STATES, _Slim, _View


@dataclass(frozen=True, slots=True)
class Pools:
    """Slot counts per pool; a pool not listed has ``default_slots`` slots.

    ``default_slots=None`` makes unlisted pools unlimited.
    """

    slots: Mapping[str, int] = field(default_factory=lambda: {"default_pool": 128})
    default_slots: int | None = 128

    def size(self, pool: str) -> int | None:
        """Slots of ``pool``; None means unlimited."""
        if pool in self.slots:
            return self.slots[pool]
        return self.default_slots


def _holds(record: _Slim, target: ResumeTarget | None) -> tuple[str, int] | None:
    if target is None or record.state not in HOLDING_STATES:
        return None
    return (target.pool, target.pool_slots)


_Ready = tuple[int, dt.datetime, str, int]
"""A scheduled task waiting for a slot: (-priority weight, scheduled at, ti_key, try number)."""


def start_records(
    scheduled: _Slim, target: ResumeTarget, now: dt.datetime
) -> tuple[TaskStateRecord, RunTask]:
    """What starting a scheduled task publishes: its ``queued`` state and its RunTask."""
    state = TaskStateRecord(
        task=scheduled.task,
        state="queued",
        updated_at=now,
        source="scheduler",
        resume=target,
    )
    run = RunTask(
        task=scheduled.task,
        mode="start",
        operator=target.operator,
        op_kwargs=target.op_kwargs,
        worker_queue=target.worker_queue,
        pool=target.pool,
        pool_slots=target.pool_slots,
        priority_weight=target.priority_weight,
        retries=target.retries,
        enqueued_at=now,
    )
    return state, run


class PoolBook:
    """Slots in use per pool, and the scheduled tasks waiting for one, highest priority
    weight first. The only writer of both; the table tells it what each task holds."""

    __slots__ = ("_ready", "_used", "pools")

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._used: dict[str, int] = {}
        self._ready: dict[str, list[_Ready]] = {}

    def hold(self, before: tuple[str, int] | None, after: tuple[str, int] | None) -> None:
        """A task that held ``before`` (pool, slots) now holds ``after``."""
        used = self._used
        if before is not None:
            left = used[before[0]] - before[1]
            if left:
                used[before[0]] = left
            else:  # as a restored book has it: pools in use only
                del used[before[0]]
        if after is not None:
            used[after[0]] = used.get(after[0], 0) + after[1]

    def wait(self, pool: str, entry: _Ready) -> None:
        """Queue a scheduled task for a slot of ``pool``."""
        heapq.heappush(self._ready.setdefault(pool, []), entry)

    def waiting(self) -> list[str]:
        """The pools with tasks waiting, in name order."""
        return sorted(self._ready)

    def admissible(self, pool: str, views: Mapping[str, _View]) -> Iterator[tuple[str, _View]]:
        """Yield the waiting tasks of ``pool`` to start, best first, while it has room.

        The caller starts each one it is given (so it holds its slots) before taking the
        next; entries whose task moved on meanwhile are dropped, and tasks that need more
        slots than are free keep their place.
        """
        heap = self._ready[pool]
        size = self.pools.size(pool)
        held: list[_Ready] = []
        try:
            while heap:
                free = None if size is None else size - self._used.get(pool, 0)
                if free is not None and free <= 0:
                    break
                entry = heapq.heappop(heap)
                view = views.get(entry[2])
                if (
                    view is None
                    or view.record.state != "scheduled"
                    or view.record.next_method is not None
                    or view.record.try_number != entry[3]
                    or view.record.updated_at != entry[1]  # scheduled again since: its new place
                    or view.target is None
                    or view.target.pool != pool
                ):
                    continue  # superseded entry
                if free is not None and view.target.pool_slots > free:
                    held.append(entry)
                    continue
                yield entry[2], view
        finally:
            for entry in held:
                heapq.heappush(heap, entry)
            if not heap:
                del self._ready[pool]

    def merge(self, other: PoolBook) -> None:
        """Take the usage and the waiting tasks of ``other`` (a book of other tasks), which
        is emptied: a pool's queue only this book lacks is taken whole, not entry by entry."""
        for pool, slots in other._used.items():
            self._used[pool] = self._used.get(pool, 0) + slots
        for pool, heap in other._ready.items():
            mine = self._ready.get(pool)
            if mine is None:
                self._ready[pool] = heap
            else:
                mine += heap
                heapq.heapify(mine)
        other._used, other._ready = {}, {}

    def usage(self) -> dict[str, tuple[int, int | None]]:
        """Slots in use and pool size, per pool in use or configured."""
        names = set(self.pools.slots) | set(self._used)
        return {name: (self._used.get(name, 0), self.pools.size(name)) for name in sorted(names)}

    def restore(self, used: dict[str, int], ready: dict[str, list[_Ready]]) -> None:
        """Take the usage and the waiting tasks of a restored table (``ready`` unordered)."""
        for heap in ready.values():
            heapq.heapify(heap)
        self._used = used
        self._ready = ready
