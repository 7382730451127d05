"""What the trigger supervisor holds per trigger that is not a running coroutine, and helpers."""

from __future__ import annotations

import contextvars
import datetime as dt
from typing import Any, Final

from ._trigger import BaseTaskEndEvent, BaseTrigger

_UTC = dt.UTC
_TASK_PREFIX: Final = "deferline-trigger:"
_CLEANUP_PREFIX: Final = "deferline-cleanup:"

_CURRENT_TRIGGER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "deferline_current_trigger", default=None
)


def current_trigger_id() -> str | None:
    """The id of the trigger whose ``run()`` (or ``cleanup()``) is running here, in its task,
    the tasks it starts and the threads it hands work to (``asyncio.to_thread``); None
    elsewhere. What a log handler attributes a log line to."""
    return _CURRENT_TRIGGER.get()


class _Timer:
    """A waiting timer: emit ``payload`` once the wall clock reaches ``deadline``."""

    __slots__ = ("context", "deadline", "end", "payload")

    def __init__(
        self, deadline: float, payload: Any, end: BaseTaskEndEvent | None, context: object
    ) -> None:
        self.deadline = deadline
        self.payload = payload
        self.end = end
        self.context = context


class _Expiry:
    """An admitted trigger that can only time out (its timeout comes before its moment)."""

    __slots__ = ("context", "deadline")

    def __init__(self, deadline: float, context: object) -> None:
        self.deadline = deadline
        self.context = context


class _Request:
    """A trigger as added: its id, the trigger, its timeout (epoch) or None, and its options.

    ``deadline`` is the moment of its live entry in the timer heap, or None when it has none.
    """

    __slots__ = ("context", "deadline", "max_events", "tid", "trigger")

    def __init__(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
    ) -> None:
        self.tid = tid
        self.trigger = trigger
        self.deadline = deadline
        self.context = context
        self.max_events = max_events


class _Queued(_Request):
    """A trigger waiting for capacity."""

    __slots__ = ()


class _AtDeadline:
    """Marker payload of a timer whose payload is its own due moment (DateTimeTrigger)."""


_AT_DEADLINE: Final = _AtDeadline()


def _epoch(value: dt.datetime, name: str) -> float:
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware")
    return value.timestamp()


def _from_epoch(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, _UTC)


def _describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _log_extra(tid: str | None, context: object) -> dict[str, object]:
    return {
        "trigger_id": tid,
        "task": getattr(context, "task", None),
        "partition": getattr(context, "partition", None),
        "member": getattr(context, "member", None),
    }


def _classpath(trigger: object) -> str:
    cls = type(trigger)
    return f"{cls.__module__}.{cls.__qualname__}"
