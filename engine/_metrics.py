"""Counters and gauges of the supervisor, in a shape a Prometheus collector can read."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Protocol

__all__ = ["LagHistogram", "SupervisorMetrics"]

DEFAULT_LAG_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip


class LagHistogram:
    """Fixed-bucket histogram of fire lag in seconds (Prometheus ``le`` buckets, not cumulative).

    ``counts[i]`` counts observations ``<= bounds[i]`` and ``> bounds[i-1]``; the last
    count is the ``+Inf`` overflow. Negative lags (fired early) count in the first bucket.
    """

    __slots__ = ("bounds", "count", "counts", "max", "sum")

    def __init__(self, bounds: Sequence[float] = DEFAULT_LAG_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("bounds must be strictly increasing and non-empty")
        self.bounds: tuple[float, ...] = tuple(bounds)
        self.counts: list[int] = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        """Record one lag."""
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds
        if seconds > self.max:
            self.max = seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper_bound, cumulative_count)`` pairs ending with ``(inf, count)``."""
        total = 0
        out: list[tuple[float, int]] = []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float:
        """Estimate a quantile by linear interpolation inside its bucket (0 when empty)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be within [0, 1]")
        if self.count == 0:
            return 0.0
        rank = q * self.count
        seen = 0
        lower = 0.0
        for i, n in enumerate(self.counts):
            upper = self.bounds[i] if i < len(self.bounds) else self.max
            if n and seen + n >= rank:
                return lower + (upper - lower) * max(0.0, rank - seen) / n
            seen += n
            lower = upper
        return self.max

    @property
    def mean(self) -> float:
        """Mean lag (0 when empty)."""
        return self.sum / self.count if self.count else 0.0


class SupervisorMetrics:
    """Counters the supervisor increments; gauges are read live from the supervisor.

    Counters: ``fired`` (events emitted), ``failed``, ``timed_out``, ``cancelled``,
    ``blocked_loop`` (episodes of a blocked event loop), ``blocked_seconds`` (their total),
    ``abandoned`` (tasks that ignored cancellation or hung in cleanup and were given up),
    ``callback_errors`` (``on_event`` raised). ``fire_lag`` is the fire time minus the due
    time of timers and timeouts.
    """

    __slots__ = (
        "_gauges",
        "abandoned",
        "blocked_loop",
        "blocked_seconds",
        "callback_errors",
        "cancelled",
        "failed",
        "fire_lag",
        "fired",
        "last_blocked",
        "timed_out",
    )

    def __init__(self, gauges: _Gauges | None = None) -> None:
        self.fired = 0
        self.failed = 0
        self.timed_out = 0
        self.cancelled = 0
        self.blocked_loop = 0
        self.blocked_seconds = 0.0
        self.abandoned = 0
        self.callback_errors = 0
        self.fire_lag = LagHistogram()
        self.last_blocked: tuple[str | None, float] | None = None
        """``(trigger_id or None, seconds)`` of the latest blocked-loop episode."""
        self._gauges = gauges

    @property
    def running(self) -> int:
        """Triggers holding capacity: running coroutines plus waiting timers."""
        return self._gauges.running if self._gauges is not None else 0

    @property
    def waiting_timers(self) -> int:
        """Triggers held in the shared timer heap (a subset of ``running``)."""
        return self._gauges.waiting_timers if self._gauges is not None else 0

    @property
    def pending(self) -> int:
        """Triggers waiting for capacity."""
        return self._gauges.pending if self._gauges is not None else 0

    @property
    def capacity(self) -> int:
        """The configured capacity."""
        return self._gauges.capacity if self._gauges is not None else 0

    @property
    def capacity_left(self) -> int:
        """Free slots."""
        return self._gauges.capacity_left if self._gauges is not None else 0

    def snapshot(self) -> dict[str, float]:
        """All counters and gauges as one flat dict (for logging or a collector)."""
        return {
            "running": self.running,
            "waiting_timers": self.waiting_timers,
            "pending": self.pending,
            "capacity": self.capacity,
            "capacity_left": self.capacity_left,
            "fired": self.fired,
            "failed": self.failed,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "blocked_loop": self.blocked_loop,
            "blocked_seconds": self.blocked_seconds,
            "abandoned": self.abandoned,
            "callback_errors": self.callback_errors,
            "fire_lag_count": self.fire_lag.count,
            "fire_lag_sum": self.fire_lag.sum,
            "fire_lag_p50": self.fire_lag.quantile(0.5),
            "fire_lag_p99": self.fire_lag.quantile(0.99),
        }


class _Gauges(Protocol):
    """What the metrics read live from their supervisor."""

    @property
    def running(self) -> int: ...
    @property
    def waiting_timers(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def capacity_left(self) -> int: ...
