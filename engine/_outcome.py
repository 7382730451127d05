"""What the supervisor reports for a trigger: one outcome per event, failure or timeout."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal, NamedTuple

from ._trigger import SourcePosition

__all__ = ["OutcomeStatus", "TriggerOutcome"]

OutcomeStatus = Literal["fired", "failed", "timed_out"]


class TriggerOutcome(NamedTuple):
    """One event of one trigger, as handed to the supervisor's ``on_event`` callback.

    A frozen value (a named tuple: the cheapest to build on the fire path).
    ``event_id`` is deterministic (trigger id, status and canonical payload), so the same
    event from two copies of a trigger has one id. ``final`` is True when the trigger has
    finished with this outcome: its last event, a failure or a timeout.
    """

    trigger_id: str
    status: OutcomeStatus
    payload: Any
    event_id: str
    task_outcome: Literal["success", "failed", "skipped"] | None = None
    """Set when the trigger ends the task itself (TaskSuccessEvent and friends)."""
    xcoms: dict[str, Any] | None = None
    error: str | None = None
    traceback: str | None = None
    due_at: dt.datetime | None = None
    """When a timer was due (timers and timeouts only); ``fired_at - due_at`` is the lag."""
    fired_at: dt.datetime | None = None
    context: object = None
    """Whatever the caller passed to ``add(..., context=...)``."""
    final: bool = True
    source: SourcePosition | None = None
    """The Kafka record the event was read from (a :class:`SourcedEvent`), committed by whoever
    publishes the event."""
