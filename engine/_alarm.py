"""The supervisor's one loop timer: it rings at the earliest moment anything is due."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Final

_MAX_SLEEP: Final = 1.0  # re-read the wall clock at least this often while timers wait


class LoopAlarm:
    """Owns the loop's timer handle: rings ``ring`` once the wall clock reaches what
    ``next_due`` returns (None: nothing to wait for), re-arming at least every second."""

    __slots__ = ("_armed_at", "_handle", "_loop", "_next_due", "_ring", "_soon")

    def __init__(self, ring: Callable[[], None], next_due: Callable[[], float | None]) -> None:
        self._ring = ring
        self._next_due = next_due
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._soon = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop`` from now on and arm for what is due."""
        self._loop = loop
        self.rearm()

    def earlier(self, deadline: float) -> None:
        """Something is now due at ``deadline``: re-arm soon if that is earlier than the
        moment the alarm is set for."""
        if deadline < self._armed_at:
            self._armed_at = deadline
            self.soon()

    def soon(self) -> None:
        """Re-arm on the loop's next iteration (once, however often asked meanwhile)."""
        if not self._soon and self._loop is not None:
            self._soon = True
            self._loop.call_soon(self.rearm)

    def rearm(self) -> None:
        """Set the alarm for what ``next_due`` returns now."""
        self._soon = False
        self.cancel()
        due = self._next_due()
        if due is None or self._loop is None:
            return
        self._armed_at = due
        delay = min(max(0.0, due - time.time()), _MAX_SLEEP)
        self._handle = self._loop.call_later(delay, self._rang)

    def cancel(self) -> None:
        """Disarm."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = math.inf

    def _rang(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        self._ring()
