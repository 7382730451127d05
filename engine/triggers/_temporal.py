"""Timer triggers: fire at a moment, or after a delay from when the trigger was created."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from .._trigger import BaseTrigger, TaskSuccessEvent, TimerSpec, TriggerEvent
from ._validate import aware_datetime, boolean

__all__ = ["DateTimeTrigger", "TimeDeltaTrigger"]

_RECHECK = 60.0  # re-read the wall clock at least this often while waiting


class DateTimeTrigger(BaseTrigger):
    """Fire once ``moment`` has passed; the payload is the moment, as in Airflow.

    With ``end_from_trigger=True`` it yields :class:`TaskSuccessEvent` instead, ending
    the task without a worker. A pure deadline: the supervisor keeps it in its shared
    timer heap, so it costs one small entry, no coroutine, while it waits.
    """

    def __init__(self, moment: dt.datetime | str, *, end_from_trigger: bool = False) -> None:
        super().__init__()
        self.moment = aware_datetime(moment, "moment")
        self.end_from_trigger = boolean(end_from_trigger, "end_from_trigger")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "deferline.engine.triggers.DateTimeTrigger",
            {"moment": self.moment, "end_from_trigger": self.end_from_trigger},
        )

    def _event(self) -> TriggerEvent:
        return TaskSuccessEvent() if self.end_from_trigger else TriggerEvent(self.moment)

    def as_timer(self) -> TimerSpec:
        return TimerSpec(self.moment, self._event())

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            remaining = (self.moment - dt.datetime.now(dt.UTC)).total_seconds()
            if remaining <= 0:
                break
            await asyncio.sleep(min(remaining, _RECHECK))
        yield self._event()


class TimeDeltaTrigger(DateTimeTrigger):
    """Fire ``delta`` after the trigger is created (a timedelta, or seconds).

    Like Airflow's, it serializes as a :class:`DateTimeTrigger` for the computed moment, so
    a trigger moved to another process keeps its original due time.
    """

    def __init__(self, delta: dt.timedelta | float, *, end_from_trigger: bool = False) -> None:
        if isinstance(delta, bool) or not isinstance(delta, dt.timedelta | int | float):
            raise TypeError(f"delta must be a timedelta or seconds, got {type(delta).__name__}")
        if not isinstance(delta, dt.timedelta):
            delta = dt.timedelta(seconds=delta)
        super().__init__(dt.datetime.now(dt.UTC) + delta, end_from_trigger=end_from_trigger)
