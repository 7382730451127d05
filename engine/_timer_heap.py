"""The supervisor's shared timer heap: waiting timers and every trigger's deadline in one heap
of millisecond buckets, woken by a single loop timer."""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from heapq import heapify, heappop, heappush
from typing import Final

from deferline.schemas import canonical_json, make_event_id, to_tagged

from ._outcome import TriggerOutcome
from ._supervisor_state import (
    _AT_DEADLINE,
    _CLOSE_EXPIRED,
    _CLOSING,
    _RUNNING,
    _Expiry,
    _from_epoch,
    _Pending,
    _Run,
    _SupervisorCore,
    _Timer,
)

_MAX_SLEEP: Final = 1.0  # re-read the wall clock at least this often while timers wait
_FIRE_SLICE: Final = 0.01  # give the loop back after firing timers for this long
_COMPACT_MIN: Final = 10_000  # rebuild the heap once this many entries went stale early

logger = logging.getLogger(__name__)


class _TimerHeap(_SupervisorCore):
    """Timers and timeouts of a :class:`TriggerSupervisor` (a part of it, not used alone)."""

    def _push(self, deadline: float, tid: str) -> None:
        """Add ``tid`` to the bucket of the millisecond its deadline falls in (rounded up)."""
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
        if deadline < self._wake_at:
            self._wake_at = deadline
            if not self._resched and self._loop is not None:
                self._resched = True
                self._loop.call_soon(self._reschedule)

    def _reschedule(self) -> None:
        self._resched = False
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if not self._heap or self._state != "running" or self._loop is None or self._held:
            self._wake_at = math.inf
            return
        due = self._heap[0] / 1000.0
        self._wake_at = due
        delay = min(max(0.0, due - time.time()), _MAX_SLEEP)
        self._wake = self._loop.call_later(delay, self._on_wake)

    def _on_wake(self) -> None:
        """Fire what is due, bucket by bucket, in slices so the loop stays responsive."""
        self._wake = None
        self._wake_at = math.inf
        heap = self._heap
        buckets = self._buckets
        now_ms = time.time() * 1000.0
        stop_at = time.perf_counter() + _FIRE_SLICE
        handled = 0
        self._firing = True
        try:
            while heap and heap[0] <= now_ms:
                key = heappop(heap)
                bucket = buckets.pop(key)
                tids = (bucket,) if type(bucket) is str else bucket
                for index, tid in enumerate(tids):
                    self._due(key, tid)
                    handled += 1
                    if self._held or (not handled & 63 and time.perf_counter() > stop_at):
                        rest = list(tids[index + 1 :])
                        if rest:
                            self._requeue(key, rest)
                        return
        finally:
            self._firing = False
            self._fill()
            self._reschedule()

    def _forget_deadline(self) -> None:
        """Count a heap entry made stale early; rebuild the heap when most entries are."""
        self._stale += 1
        if self._stale > _COMPACT_MIN and self._stale > len(self._entries) and not self._firing:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the timer heap from live entries (cancelled ones would linger until due)."""
        self._stale = 0
        self._heap = []
        self._buckets = {}
        buckets = self._buckets
        for tid, entry in self._entries.items():
            deadline = entry.deadline
            if deadline is None:
                continue
            if type(entry) is _Run and entry.state != _RUNNING and entry.closing != _CLOSING:
                continue  # its timeout is stale; a closing run's close bound is live
            key = math.ceil(deadline * 1000.0)
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = tid
            elif type(bucket) is str:
                buckets[key] = [bucket, tid]
            else:
                bucket.append(tid)  # type: ignore[union-attr]
        self._heap = list(buckets)
        heapify(self._heap)
        if self._loop is not None and self._state == "running":
            self._reschedule()

    def _requeue(self, key: int, rest: list[str]) -> None:
        """Put back the part of a bucket that the last slice did not reach, in order."""
        later = self._buckets.get(key)
        if later is None:
            self._buckets[key] = rest
            heappush(self._heap, key)
        else:  # triggers added to this millisecond while the bucket was being fired
            rest.extend((later,) if type(later) is str else later)
            self._buckets[key] = rest

    def _due(self, key: int, tid: str) -> None:
        """A bucket entry came due: fire the timer or expire the trigger, unless stale."""
        entry = self._entries.get(tid)
        if entry is None:
            return  # cancelled or finished
        deadline = entry.deadline
        if deadline is None or math.ceil(deadline * 1000.0) != key:
            return  # stale: re-added with another deadline, or now a timer due later
        kind = type(entry)
        if kind is _Timer:
            del self._entries[tid]
            self._active -= 1
            self._timers -= 1
            self._fire_timer(tid, entry)  # type: ignore[arg-type]
        elif kind is _Expiry:
            del self._entries[tid]
            self._active -= 1
            self._timers -= 1
            self._emit_timeout(tid, deadline, entry.context)
        elif kind is _Pending:
            del self._entries[tid]
            self._pending_count -= 1
            self._emit_timeout(tid, deadline, entry.context)
        else:
            assert isinstance(entry, _Run)
            if entry.closing == _CLOSING:
                entry.closing = _CLOSE_EXPIRED  # closing run() overran: cancel it
                if entry.task is not None:
                    entry.task.cancel()
            elif entry.state == _RUNNING:
                self._begin_stop(entry)
                self._emit_timeout(tid, deadline, entry.context)

    def _due_at(self, deadline: float) -> tuple[dt.datetime, bytes]:
        """The due time of ``deadline`` and its canonical JSON (the payload of a timer that
        fires with its moment), shared by the timers of a burst: computed once per distinct
        deadline, not once per timer."""
        last = self._last_due
        if last is None or last[0] != deadline:
            due = _from_epoch(deadline)
            last = self._last_due = (deadline, due, canonical_json(due))
        return last[1], last[2]

    def _fire_timer(self, tid: str, timer: _Timer) -> None:
        fired = time.time()
        self.metrics.fire_lag.observe(fired - timer.deadline)
        payload = timer.payload
        end = timer.end
        try:
            if payload is _AT_DEADLINE:
                due, due_json = self._due_at(timer.deadline)
                payload = due
                event_id = make_event_id(tid, "fired", payload, canonical=due_json)
            else:
                due = _from_epoch(timer.deadline)
                event_id = make_event_id(tid, "fired", payload)
            xcoms = None if end is None else end.xcoms
            if xcoms is not None:
                to_tagged(xcoms)
        except Exception as exc:
            self._emit_failure(tid, timer.context, f"event cannot be serialized: {exc}", None)
            return
        self.metrics.fired += 1
        self._deliver(
            TriggerOutcome(
                tid,
                "fired",
                payload,
                event_id,
                None if end is None else end.task_instance_state,  # type: ignore[arg-type]
                xcoms,
                None,
                None,
                due,
                _from_epoch(fired),
                timer.context,
                True,
            )
        )
