"""The supervisor's side of the loop watchdog: naming what blocks the loop, and counting it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ._supervisor_state import (
    _CLEANUP_PREFIX,
    _TASK_PREFIX,
    _classpath,
    _SupervisorCore,
)
from ._watchdog import BlockedLoop

logger = logging.getLogger(__name__)


class _WatchdogHandOff(_SupervisorCore):
    """Watchdog reports of a :class:`TriggerSupervisor` (a part of it, not used alone)."""

    def _describe_task(self, task: asyncio.Task[Any] | None) -> tuple[str | None, str]:
        """Name what the loop is running (called from the watchdog thread)."""
        if task is None:
            if self._firing:
                return None, "the supervisor's timer callback (firing due timers into on_event)"
            return None, "a loop callback outside any task"
        name = task.get_name()
        for prefix, what in ((_TASK_PREFIX, "run()"), (_CLEANUP_PREFIX, "cleanup()")):
            if name.startswith(prefix):
                tid = name[len(prefix) :]
                entry = self._entries.get(tid)
                trigger = getattr(entry, "trigger", None)
                cls = _classpath(trigger) if trigger is not None else "unknown class"
                return tid, f"trigger {tid} ({cls}) in {what}"
        return None, f"task {name!r}"

    def _on_blocked(self, episode: BlockedLoop) -> None:
        with self._metrics_lock:
            if not episode.ended or episode.culprit.startswith("unknown"):
                self.metrics.blocked_loop += 1
            if episode.ended:
                self.metrics.blocked_seconds += episode.seconds
            self.metrics.last_blocked = (episode.trigger_id, episode.seconds)
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
