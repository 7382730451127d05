"""How many tasks a table holds in each state, and how many deferrals are past their timeout,
kept as the table changes: a metrics scrape of a million tasks must not walk them all on the
event loop (it took half a second; docs/benchmarks.md)."""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Callable

from ._taskstate_values import _Slim

__all__ = ["Census"]

Deadline = tuple[dt.datetime, str]
"""(timeout, ti_key) of a deferral with a timeout."""

_SLACK = 1024
"""Deadlines of deferrals that ended before their timeout are dropped when they outnumber the
live ones by this many (each then costs O(1) amortised)."""


class Census:
    """State counts and deferral deadlines of one table.

    The table reports every change of a task's record (:meth:`moved`); ``current`` gives a
    task's record now (None when the table does not hold it), to tell live deadlines from
    those of deferrals that ended.
    """

    def __init__(
        self,
        current: Callable[[str], _Slim | None],
        counts: dict[str, int] | None = None,
        deadlines: list[Deadline] | None = None,
    ) -> None:
        self._current = current
        self._counts: dict[str, int] = counts if counts is not None else {}
        self._deadlines = deadlines if deadlines is not None else []
        heapq.heapify(self._deadlines)
        self._timed = len(self._deadlines)  # deferrals with a timeout, now
        self._late: dict[str, dt.datetime] = {}  # deadlines passed: key → timeout

    def counts(self) -> dict[str, int]:
        """Tasks per state (states with none left out)."""
        return dict(self._counts)

    def moved(self, key: str, before: _Slim | None, after: _Slim | None) -> None:
        """Task ``key``'s record went from ``before`` to ``after`` (None: not held)."""
        counts = self._counts
        if before is not None:
            state = before.state
            left = counts[state] - 1
            if left:
                counts[state] = left
            else:
                del counts[state]
            if state == "deferred" and before.timeout_at is not None:
                self._timed -= 1
        if after is not None:
            state = after.state
            counts[state] = counts.get(state, 0) + 1
            if state == "deferred" and after.timeout_at is not None:
                self._timed += 1
                heapq.heappush(self._deadlines, (after.timeout_at, key))
                if len(self._deadlines) > 2 * self._timed + _SLACK:
                    self._compact()

    def overdue(self, now: dt.datetime) -> int:
        """Deferred tasks whose timeout is before ``now``: O(those, plus the deadlines passed
        since the last call)."""
        deadlines, late = self._deadlines, self._late
        while deadlines and deadlines[0][0] < now:
            timeout, key = heapq.heappop(deadlines)
            late[key] = timeout
        overdue = 0
        for key, timeout in list(late.items()):
            if not self._live(key, timeout):
                del late[key]
            elif timeout < now:
                overdue += 1
        return overdue

    def merge(self, other: Census) -> None:
        """Add the tasks of ``other`` (a table of other keys, absorbed)."""
        if not self._counts:  # a restart absorbs every partition into an empty table
            self._counts, self._deadlines = other._counts, other._deadlines
        else:
            for state, count in other._counts.items():
                self._counts[state] = self._counts.get(state, 0) + count
            self._deadlines += other._deadlines
            heapq.heapify(self._deadlines)
        self._timed += other._timed
        self._late.update(other._late)
        other._counts, other._deadlines, other._timed, other._late = {}, [], 0, {}

    def _live(self, key: str, timeout: dt.datetime) -> bool:
        record = self._current(key)
        return record is not None and record.state == "deferred" and record.timeout_at == timeout

    def _compact(self) -> None:
        live = dict.fromkeys(entry for entry in self._deadlines if self._live(entry[1], entry[0]))
        self._deadlines = list(live)  # once each: a deferral may be pushed again unchanged
        heapq.heapify(self._deadlines)
