"""The loop at a glance, folded from records: tasks by state, events, resume latency.

Pure: records in (values peeked at with orjson, no model validation), figures out; the time
of a sample is passed in, never read from a clock, so every figure is testable without a
broker. Memory follows the number of tasks (one small entry per task key) plus a minute of
samples.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["LoopStats", "LoopSummary", "percentile"]

_WINDOW = 60.0
"""Seconds of history behind the per-second rates and the latency percentiles."""


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), math.ceil(q * len(sorted_values))))
    return sorted_values[rank - 1]


def _epoch(value: Any) -> float | None:
    """Seconds since the epoch of a wire time (it always carries its offset), or None."""
    try:
        return dt.datetime.fromisoformat(value).timestamp() if isinstance(value, str) else None
    except ValueError:
        return None


def _peek(value: bytes | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True, slots=True)
class LoopSummary:
    """What the overview shows at one moment."""

    tasks: dict[str, int]
    change_per_s: dict[str, float]
    deferrals_waiting: int
    events_per_s: float
    resume_p50_s: float | None
    resume_p99_s: float | None
    resumes_in_window: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "change_per_s": self.change_per_s,
            "deferrals_waiting": self.deferrals_waiting,
            "events_per_s": self.events_per_s,
            "resume_p50_s": self.resume_p50_s,
            "resume_p99_s": self.resume_p99_s,
            "resumes_in_window": self.resumes_in_window,
            "window_s": _WINDOW,
        }


class LoopStats:
    """Latest state per task, event counts and resume latencies, from the records read.

    Resume latency is the time from a trigger's event (``emitted_at``) to the scheduler's
    task state that resumes on it (the record carrying that ``event_id``), timed by that
    record's timestamp on the tasks topic: its ``updated_at`` is the event's own time, as the
    fold takes time from events, never the clock. Both records are needed, in whichever order
    the topics deliver them.
    """

    def __init__(self) -> None:
        self._state: dict[bytes, str] = {}
        self._counts: Counter[str] = Counter()
        self.events_seen = 0
        self._emitted: dict[str, float] = {}
        self._applied: dict[str, float] = {}
        self._latencies: deque[tuple[float, float]] = deque()
        self._samples: deque[tuple[float, Counter[str], int]] = deque()

    def task_state(self, key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> None:
        """A record of the tasks topic (a tombstone removes the task)."""
        if key is None:
            return
        previous = self._state.get(key)
        data = _peek(value)
        state = data.get("state") if data is not None else None
        if previous is not None:
            self._counts[previous] -= 1
        if not isinstance(state, str):
            self._state.pop(key, None)
            return
        state = _STATES.get(state, state)
        self._state[key] = state
        self._counts[state] += 1
        event_id = data.get("event_id") if data is not None else None
        if isinstance(event_id, str) and state != "deferred" and timestamp_ms is not None:
            self._pair(event_id, applied=timestamp_ms / 1000)

    def trigger_event(self, value: bytes | None) -> None:
        """A record of a resume (events) topic."""
        data = _peek(value)
        if data is None or data.get("kind") != "trigger_event":
            return
        self.events_seen += 1
        event_id = data.get("event_id")
        emitted = _epoch(data.get("emitted_at"))
        if isinstance(event_id, str) and emitted is not None:
            self._pair(event_id, emitted=emitted)

    def _pair(
        self, event_id: str, *, emitted: float | None = None, applied: float | None = None
    ) -> None:
        """Note one end of a resume; the second end seen completes it."""
        if emitted is not None:
            applied = self._applied.pop(event_id, None)
            if applied is None:
                self._emitted[event_id] = emitted
                return
        elif applied is not None:
            emitted = self._emitted.pop(event_id, None)
            if emitted is None:
                self._applied.setdefault(event_id, applied)
                return
        if emitted is not None and applied is not None:
            self._latencies.append((applied, max(0.0, applied - emitted)))

    def sample(self, now: float) -> LoopSummary:
        """Take a sample at ``now`` (epoch seconds) and summarise the last minute."""
        counts = Counter({k: v for k, v in self._counts.items() if v > 0})
        self._samples.append((now, counts, self.events_seen))
        while self._samples and now - self._samples[0][0] > _WINDOW:
            self._samples.popleft()
        self._forget(now)
        rates: dict[str, float] = {}
        events_per_s = 0.0
        rate_span = 10.0  # the change per second is over the last ten seconds
        base = next((s for s in self._samples if now - s[0] <= rate_span), None)
        if base is not None and now - base[0] > 0:
            span = now - base[0]
            then = base[1]
            for state in set(counts) | set(then):
                rates[state] = (counts[state] - then[state]) / span
            events_per_s = (self.events_seen - base[2]) / span
        recent = sorted(lat for at, lat in self._latencies if now - at <= _WINDOW)
        return LoopSummary(
            tasks=dict(sorted(counts.items())),
            change_per_s={k: round(v, 2) for k, v in sorted(rates.items())},
            deferrals_waiting=counts["deferred"],
            events_per_s=round(events_per_s, 2),
            resume_p50_s=percentile(recent, 0.5),
            resume_p99_s=percentile(recent, 0.99),
            resumes_in_window=len(recent),
        )

    def rebase(self) -> None:
        """Forget the samples so far (taken while catching up on history: rates meaningless)."""
        self._samples.clear()

    def _forget(self, now: float) -> None:
        while self._latencies and now - self._latencies[0][0] > _WINDOW:
            self._latencies.popleft()
        # An event whose resume never came (failed tasks, or still queued) is let go after
        # the window: its latency could no longer be shown.
        for pending in (self._emitted, self._applied):
            for event_id in [e for e, at in pending.items() if now - at > _WINDOW]:
                del pending[event_id]

    def __len__(self) -> int:
        return len(self._state)


_STATES = {s: s for s in ("deferred", "queued", "running", "success", "failed", "scheduled")}
"""Interned state names: a million tasks share a handful of strings."""
