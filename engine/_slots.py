"""The supervisor's book of triggers: every entry by id, and the slot counters they imply."""

from __future__ import annotations

from collections import deque

from ._coroutine_runs import _Run
from ._supervisor_state import _Expiry, _Queued, _Timer

_Entry = _Timer | _Expiry | _Queued | _Run


class SlotBook:
    """Every trigger the supervisor holds, by id, and the only writer of its slot counters.

    ``active`` counts the entries holding capacity (timers, expiries and coroutine runs),
    ``timers`` those of them waiting in the timer heap (timers and expiries) and ``queued``
    the triggers waiting for capacity, oldest first. Read ``entries``; change it through the
    methods, so the counters always equal the counts by entry type.
    """

    __slots__ = ("_queue", "active", "capacity", "entries", "queued", "timers")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[str, _Entry] = {}
        self._queue: deque[_Queued] = deque()
        self.active = 0
        self.timers = 0
        self.queued = 0

    def __len__(self) -> int:
        return len(self.entries)

    def admits(self) -> bool:
        """True when a new trigger may start now: a free slot and nobody queued before it."""
        return self.active < self.capacity and not self.queued

    def place_timer(self, tid: str, entry: _Timer | _Expiry) -> None:
        """Book an admitted trigger that waits in the timer heap."""
        self.entries[tid] = entry
        self.active += 1
        self.timers += 1

    def place_run(self, run: _Run) -> None:
        """Book an admitted coroutine trigger."""
        self.entries[run.tid] = run
        self.active += 1

    def queue(self, entry: _Queued) -> None:
        """Book a trigger that waits for capacity."""
        self.entries[entry.tid] = entry
        self._queue.append(entry)
        self.queued += 1

    def remove(self, tid: str) -> _Entry:
        """Forget ``tid`` (which must be booked) and give back what it held."""
        entry = self.entries.pop(tid)
        kind = type(entry)
        if kind is _Queued:
            self.queued -= 1  # its place in the queue is skipped when reached
            if not self.queued:
                self._queue.clear()  # only such places are left
        else:
            self.active -= 1
            if kind is not _Run:
                self.timers -= 1
        return entry

    def release(self, run: _Run) -> bool:
        """Forget a finished run if it is still booked; True if it was."""
        if self.entries.get(run.tid) is not run:
            return False
        self.remove(run.tid)
        return True

    def next_queued(self) -> _Queued | None:
        """Take the oldest queued trigger if a slot is free (the caller admits it)."""
        queue = self._queue
        entries = self.entries
        while queue and self.active < self.capacity:
            entry = queue.popleft()
            if entries.get(entry.tid) is entry:
                self.remove(entry.tid)
                return entry
        return None

    def keep_runs(self) -> list[_Run]:
        """Forget everything but the coroutine runs (which stop on their own), and return them."""
        runs = [entry for entry in self.entries.values() if type(entry) is _Run]
        for tid in [tid for tid, entry in self.entries.items() if type(entry) is not _Run]:
            del self.entries[tid]
        self._queue.clear()
        self.active = len(runs)
        self.timers = 0
        self.queued = 0
        return runs
