"""What each rebalance did to a lane: one summary per rebalance, counted, logged and kept."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ._lane_types import RebalanceSummary
from ._metrics import TriggererMetrics

logger = logging.getLogger(__name__)


class RebalanceRecorder:
    """Records rebalances: from revocation, through assignment, to the end of the rebuild.

    A rebalance is open from its assignment until its rebuild is over (or, when there is
    nothing to rebuild, closed at once); a revocation that interrupts it closes it first.
    """

    def __init__(
        self, *, label: str, metrics: TriggererMetrics, log: Callable[..., dict[str, Any]]
    ) -> None:
        self._label = label
        self._metrics = metrics
        self._log = log
        self.history: list[RebalanceSummary] = []
        """The last rebalances (most recent last, at most 100)."""
        self._open: RebalanceSummary | None = None
        self._revoked: tuple[float, float] | None = None
        """``(monotonic, wall clock)`` of the revocation, until the next assignment."""
        self._started = 0.0

    def revoked(self) -> None:
        """A revocation began (the rebalance open before it, if any, is closed)."""
        self._revoked = (time.monotonic(), time.time())
        self.finish()

    def assigned(
        self,
        generation: int,
        *,
        kept: list[int],
        acquired: list[int],
        lost: list[int],
        triggers_kept: int,
        triggers_cancelled: int,
    ) -> None:
        """An assignment arrived: this rebalance is open until :meth:`finish`."""
        revoked, self._revoked = self._revoked, None
        self._started = revoked[0] if revoked is not None else time.monotonic()
        self._open = RebalanceSummary(
            generation=generation,
            kept=kept,
            acquired=acquired,
            lost=lost,
            triggers_kept=triggers_kept,
            triggers_cancelled=triggers_cancelled,
            revoked_at=revoked[1] if revoked is not None else None,
            assigned_at=time.time(),
        )

    def paused(self, number: int, since: float | None = None) -> None:
        """Partition ``number`` emits (kept) or follows its tail (acquired) again: paused
        since ``since`` (monotonic), by default since the revocation (or, for a member that
        owned nothing, the assignment)."""
        summary = self._open
        if summary is not None:
            start = self._started if since is None else since
            summary.paused_seconds[number] = time.monotonic() - start

    def rebuilt(self, triggers: int) -> None:
        """The rebuild of the acquired partitions started ``triggers`` triggers."""
        summary = self._open
        if summary is not None:
            summary.triggers_rebuilt += triggers
            summary.rebuilt_at = time.time()

    def finish(self) -> None:
        """Count, record and log the open rebalance (once its rebuild is over)."""
        summary, self._open = self._open, None
        if summary is None:
            return
        metrics, queue = self._metrics, self._label
        for outcome, numbers in (
            ("kept", summary.kept),
            ("acquired", summary.acquired),
            ("lost", summary.lost),
        ):
            metrics.rebalance_partitions.labels(queue=queue, outcome=outcome).inc(len(numbers))
        for action, count in (
            ("kept", summary.triggers_kept),
            ("cancelled", summary.triggers_cancelled),
            ("rebuilt", summary.triggers_rebuilt),
        ):
            metrics.rebalance_triggers.labels(queue=queue, action=action).inc(count)
        for seconds in summary.paused_seconds.values():
            metrics.partition_pause_seconds.labels(queue=queue).observe(seconds)
        self.history.append(summary)
        del self.history[:-100]
        pauses = list(summary.paused_seconds.values())
        logger.info(
            "rebalance",
            extra=self._log(
                generation=summary.generation,
                partitions_kept=len(summary.kept),
                partitions_acquired=len(summary.acquired),
                partitions_lost=len(summary.lost),
                triggers_kept=summary.triggers_kept,
                triggers_cancelled=summary.triggers_cancelled,
                triggers_rebuilt=summary.triggers_rebuilt,
                paused_seconds={
                    str(n): round(s, 3) for n, s in sorted(summary.paused_seconds.items())
                },
                max_paused_seconds=round(max(pauses), 3) if pauses else 0.0,
            ),
        )
