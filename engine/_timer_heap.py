"""The supervisor's deadline heap: trigger ids by the millisecond they fall due. Pure: it
reads no clock and knows no loop; the supervisor asks it what is due and wakes it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from heapq import heappop, heappush
from typing import Final

_COMPACT_MIN: Final = 10_000  # rebuild the heap once this many entries went stale early


class DeadlineHeap:
    """A heap of millisecond keys, each naming a bucket of trigger ids in the order they were
    pushed (a bare id while alone). A bucket put back part-handled keeps its list and the
    index of its first id left (``_starts``): handling a bucket of a million ids in a
    thousand slices then copies nothing, where copying the rest at each slice cost seconds.

    Nothing is removed early: the owner checks each id it pops against its own book (an id
    that is gone, or whose deadline moved to another key, is stale) and reports each entry
    it made stale with :meth:`forget`; once stale entries outnumber live ones, it calls
    :meth:`rebuild` with the live ones.
    """

    __slots__ = ("_buckets", "_heap", "_stale", "_starts")

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._buckets: dict[int, str | list[str]] = {}
        self._starts: dict[int, int] = {}
        self._stale = 0

    def push(self, deadline: float, tid: str) -> None:
        """Add ``tid`` to the bucket of the millisecond its deadline falls in."""
        key = math.ceil(deadline * 1000.0)
        buckets = self._buckets
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = tid
            heappush(self._heap, key)
        elif type(bucket) is str:
            buckets[key] = [bucket, tid]
        else:
            bucket.append(tid)  # type: ignore[union-attr]

    def first(self) -> float | None:
        """The earliest queued moment (epoch seconds), or None when empty."""
        return self._heap[0] / 1000.0 if self._heap else None

    def pop_due(self, now_ms: float) -> tuple[int, Sequence[str], int] | None:
        """Take the earliest bucket if its millisecond is at or before ``now_ms``: its key,
        its ids and the index of the first one not handled yet."""
        heap = self._heap
        if not heap or heap[0] > now_ms:
            return None
        key = heappop(heap)
        bucket = self._buckets.pop(key)
        start = self._starts.pop(key, 0)
        return key, (bucket,) if type(bucket) is str else bucket, start

    def requeue(self, key: int, tids: Sequence[str], start: int) -> None:
        """Put back a popped bucket whose ids before ``start`` were handled, ahead of ids
        pushed since. The handled part is dropped once it is the larger one, so a bucket
        handled in many slices costs time in proportion to its size alone."""
        if start >= len(tids):
            return
        rest = tids if type(tids) is list else list(tids)
        if start * 2 > len(rest):
            del rest[:start]
            start = 0
        later = self._buckets.get(key)
        if later is None:
            heappush(self._heap, key)
        else:
            rest.extend((later,) if type(later) is str else later)
        self._buckets[key] = rest
        if start:
            self._starts[key] = start

    def forget(self, live: int) -> bool:
        """Count one entry made stale early; True once a rebuild is due (stale entries are
        over ``_COMPACT_MIN`` and outnumber the ``live`` ones)."""
        self._stale += 1
        return self._stale > _COMPACT_MIN and self._stale > live

    def rebuild(self, live: Iterable[tuple[str, float]]) -> None:
        """Replace the whole heap by the ``(id, deadline)`` pairs given, in their order."""
        self.clear()
        for tid, deadline in live:
            self.push(deadline, tid)

    def clear(self) -> None:
        """Drop every entry."""
        self._heap = []
        self._buckets = {}
        self._starts = {}
        self._stale = 0
