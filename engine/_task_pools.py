"""Pools: slot counts, and admitting scheduled tasks in priority-weight order."""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from deferline.schemas import (
    ResumeTarget,
    RunTask,
    TaskStateRecord,
)

from ._taskstate_values import HOLDING_STATES, Emit, TableCounters, _Slim, _View


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


class _PoolAdmission:
    """Admission of a :class:`TaskTable` (a part of it, not used alone): starts scheduled
    tasks while their pool has free slots, highest priority weight first."""

    pools: Pools
    counters: TableCounters
    _views: dict[str, _View]
    _used: dict[str, int]
    _ready: dict[str, list[tuple[int, dt.datetime, str, int]]]
    _outbox: list[Emit]
    _clock: dt.datetime

    def _own(self, key: str, view: _View, record: TaskStateRecord) -> None:
        raise NotImplementedError

    def _admit(self, pool: str) -> None:
        heap = self._ready[pool]
        size = self.pools.size(pool)
        held: list[tuple[int, dt.datetime, str, int]] = []
        while heap:
            free = None if size is None else size - self._used.get(pool, 0)
            if free is not None and free <= 0:
                break
            entry = heapq.heappop(heap)
            view = self._views.get(entry[2])
            if (
                view is None
                or view.record.state != "scheduled"
                or view.record.next_method is not None
                or view.record.try_number != entry[3]
                or view.target is None
                or view.target.pool != pool
            ):
                continue  # superseded entry
            if free is not None and view.target.pool_slots > free:
                held.append(entry)
                continue
            self._start(entry[2], view, view.target)
        for entry in held:
            heapq.heappush(heap, entry)
        if not heap:
            del self._ready[pool]

    def _start(self, key: str, view: _View, target: ResumeTarget) -> None:
        scheduled = view.record
        now = self._clock
        state = TaskStateRecord(
            task=scheduled.task,
            state="queued",
            updated_at=now,
            source="scheduler",
            resume=target,
        )
        self._own(key, view, state)
        self._outbox.append(
            Emit(
                RunTask(
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
            )
        )
        self.counters.starts += 1
