"""The supervisor's side of the loop watchdog: naming what blocks the loop, and counting it."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from ._metrics import SupervisorMetrics
from ._supervisor_state import _CLEANUP_PREFIX, _TASK_PREFIX, _classpath
from ._watchdog import BlockedLoop

logger = logging.getLogger(__name__)


class BlockReports:
    """What the watchdog thread calls: it names the task the loop is running and reports
    a blocked loop in the log and the metrics (under a lock: it runs on that thread)."""

    __slots__ = ("_firing", "_lock", "_metrics", "_trigger_of")

    def __init__(
        self,
        metrics: SupervisorMetrics,
        *,
        trigger_of: Callable[[str], object],
        firing: Callable[[], bool],
    ) -> None:
        self._metrics = metrics
        self._trigger_of = trigger_of
        self._firing = firing
        self._lock = threading.Lock()

    def describe_task(self, task: asyncio.Task[Any] | None) -> tuple[str | None, str]:
        """Name what the loop is running."""
        if task is None:
            if self._firing():
                return None, "the supervisor's timer callback (firing due timers into on_event)"
            return None, "a loop callback outside any task"
        name = task.get_name()
        for prefix, what in ((_TASK_PREFIX, "run()"), (_CLEANUP_PREFIX, "cleanup()")):
            if name.startswith(prefix):
                tid = name[len(prefix) :]
                trigger = self._trigger_of(tid)
                cls = _classpath(trigger) if trigger is not None else "unknown class"
                return tid, f"trigger {tid} ({cls}) in {what}"
        return None, f"task {name!r}"

    def on_blocked(self, episode: BlockedLoop) -> None:
        """Count and log one report of a blocked loop."""
        metrics = self._metrics
        with self._lock:
            if not episode.ended or episode.culprit.startswith("unknown"):
                metrics.blocked_loop += 1
            if episode.ended:
                metrics.blocked_seconds += episode.seconds
            metrics.last_blocked = (episode.trigger_id, episode.seconds)
        where = f" at {episode.location}" if episode.location else ""
        extra = {"trigger_id": episode.trigger_id, "blocked_seconds": round(episode.seconds, 3)}
        if episode.ended:
            logger.warning(
                "event loop was blocked for %.3f s by %s%s",
                episode.seconds,
                episode.culprit,
                where,
                extra=extra,
            )
        else:
            hint = (
                "; triggers must not block (use asyncio.to_thread for blocking calls)"
                if episode.trigger_id is not None
                else ""
            )
            logger.warning(
                "event loop blocked for %.3f s so far by %s%s%s",
                episode.seconds,
                episode.culprit,
                where,
                hint,
                extra=extra,
            )
