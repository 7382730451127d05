"""Blocked-loop watchdog: notice when the event loop stalls and name what was running.

A heartbeat callback on the loop records when it last ran; a monitor thread notices when
the heartbeat is overdue by more than the threshold, samples the task the loop is
stepping (``asyncio.current_task`` is readable from another thread) and the loop thread's
innermost frame, and reports both. When the loop comes back, the heartbeat reports how
long it was blocked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BlockedLoop", "LoopWatchdog"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockedLoop:
    """One episode of a blocked event loop."""

    trigger_id: str | None
    """The trigger whose code was running, when it was one."""
    culprit: str
    """Human description: trigger and class, or the task or callback that was running."""
    location: str | None
    """``file:line in function`` of the innermost frame the loop thread was executing."""
    seconds: float
    """How long the loop was blocked (so far, when ``ended`` is False)."""
    ended: bool


class LoopWatchdog:
    """Watches one event loop from a daemon thread; start and stop it from the loop."""

    def __init__(
        self,
        *,
        threshold: float,
        describe: Callable[[asyncio.Task[object] | None], tuple[str | None, str]],
        on_blocked: Callable[[BlockedLoop], None],
    ) -> None:
        if threshold <= 0:
            raise ValueError("threshold must be > 0")
        self._threshold = threshold
        self._interval = max(0.005, threshold / 2)
        self._describe = describe
        self._on_blocked = on_blocked
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._last_beat = 0.0
        self._episode: tuple[float, str | None, str, str | None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin watching the running loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._last_beat = time.monotonic()
        self._stop.clear()
        self._handle = self._loop.call_later(self._interval, self._beat)
        self._thread = threading.Thread(
            target=self._monitor, name="deferline-loop-watchdog", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop watching; idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            await asyncio.to_thread(thread.join, 5.0)

    # -- loop side ---------------------------------------------------------------------

    def _beat(self) -> None:
        now = time.monotonic()
        previous, self._last_beat = self._last_beat, now
        blocked = now - previous  # exact when the block began right after a beat
        episode, self._episode = self._episode, None
        if episode is not None and episode[0] == previous:
            _, trigger_id, culprit, location = episode
            self._report(BlockedLoop(trigger_id, culprit, location, blocked, ended=True))
        elif blocked - self._interval > self._threshold:
            # Shorter than the monitor's sampling period: we know it happened, not who.
            self._report(BlockedLoop(None, "unknown (not sampled)", None, blocked, ended=True))
        assert self._loop is not None
        self._handle = self._loop.call_later(self._interval, self._beat)

    # -- monitor thread ----------------------------------------------------------------

    def _monitor(self) -> None:
        while not self._stop.wait(self._interval):
            beat = self._last_beat
            late = time.monotonic() - beat
            if late - self._interval <= self._threshold or self._episode is not None:
                continue
            loop = self._loop
            task = asyncio.current_task(loop) if loop is not None else None
            location = self._location()
            # Sample again a moment later: one culprit holds the loop in both samples; a
            # loop merely overloaded with many short steps shows different ones.
            self._stop.wait(0.002)
            again = asyncio.current_task(loop) if loop is not None else None
            if self._last_beat != beat:  # the loop came back while we looked
                continue
            if again is task and self._location() == location:
                trigger_id, culprit = self._describe(task)
            else:
                _, example = self._describe(task)
                trigger_id, culprit = None, f"many short steps (loop overloaded; e.g. {example})"
            self._episode = (beat, trigger_id, culprit, location)
            self._report(BlockedLoop(trigger_id, culprit, location, late, ended=False))

    def _location(self) -> str | None:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return None
        code = frame.f_code
        return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"

    def _report(self, episode: BlockedLoop) -> None:
        try:
            self._on_blocked(episode)
        except Exception:  # never let reporting kill the watchdog
            logger.exception("blocked-loop report failed")
