"""What the trigger supervisor holds per trigger: entries, lifecycle states and helpers."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from ._metrics import SupervisorMetrics
from ._outcome import TriggerOutcome
from ._trigger import BaseTaskEndEvent, BaseTrigger, TriggerEvent

logger = logging.getLogger(__name__)

_UTC = dt.UTC
_TASK_PREFIX: Final = "deferline-trigger:"
_CLEANUP_PREFIX: Final = "deferline-cleanup:"

# Lifecycle of a coroutine trigger.
_RUNNING: Final = 0  # run() is being iterated
_STOPPING: Final = 1  # cancelled or timed out: the stopper owns cleanup and release
_FINISHING: Final = 2  # run() ended on its own: its task owns cleanup and release
_DONE: Final = 3
# Closing a finished run() (its finally blocks), bounded through the timer heap.
_CLOSING: Final = 1
_CLOSE_EXPIRED: Final = 2


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
    """A trigger as added: its id, the trigger, its timeout (epoch) or None, and its options."""

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


class _Pending(_Request):
    """A trigger waiting for capacity."""

    __slots__ = ()


class _Run(_Request):
    """A coroutine trigger and the task that iterates its ``run()``."""

    __slots__ = ("cleaned", "closing", "events", "killed", "state", "stopper", "task")

    def __init__(
        self,
        tid: str,
        trigger: BaseTrigger,
        deadline: float | None,
        context: object,
        max_events: int | None,
    ) -> None:
        super().__init__(tid, trigger, deadline, context, max_events)
        self.events = 0
        self.state = _RUNNING
        self.cleaned = False
        self.killed = False  # cancelled by a user: on_kill() before cleanup()
        self.closing = 0
        self.task: asyncio.Task[None] | None = None
        self.stopper: asyncio.Task[None] | None = None


_Entry = _Timer | _Expiry | _Pending | _Run


class _Exhausted:
    """Marker: the async generator has no more events."""


_EXHAUSTED: Final = _Exhausted()


class _AtDeadline:
    """Marker payload of a timer whose payload is its own due moment (DateTimeTrigger)."""


_AT_DEADLINE: Final = _AtDeadline()


async def _anext(agen: AsyncIterator[Any]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _EXHAUSTED


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


class _SupervisorCore:
    """The state the supervisor's parts share, and the calls they make into one another.

    :class:`TriggerSupervisor` is built from parts, one module each: the timer heap, the
    coroutine runs, the outcomes and the watchdog hand-off. This base only declares what
    they share; the supervisor's ``__init__`` sets it.
    """

    _capacity: int
    _on_event: Callable[[TriggerOutcome], None]
    _cleanup_timeout: float
    _entries: dict[str, _Entry]
    _heap: list[int]
    _buckets: dict[int, str | list[str]]
    _stale: int
    _pending_count: int
    _active: int
    _timers: int
    _loop: asyncio.AbstractEventLoop | None
    _wake: asyncio.TimerHandle | None
    _wake_at: float
    _resched: bool
    _last_due: tuple[float, dt.datetime, bytes] | None
    _firing: bool
    _held: bool
    _state: str
    _stoppers: set[asyncio.Task[None]]
    _abandoned: set[asyncio.Task[Any]]
    _metrics_lock: threading.Lock
    metrics: SupervisorMetrics

    def _fill(self) -> None:
        raise NotImplementedError

    def _push(self, deadline: float, tid: str) -> None:
        raise NotImplementedError

    def _forget_deadline(self) -> None:
        raise NotImplementedError

    def _begin_stop(self, run: _Run) -> None:
        raise NotImplementedError

    def _fail(self, run: _Run, error: BaseException | str) -> None:
        raise NotImplementedError

    def _emit_event(self, run: _Run, event: TriggerEvent, *, final: bool) -> bool:
        raise NotImplementedError

    def _emit_failure(self, tid: str, context: object, message: str, tb: str | None) -> None:
        raise NotImplementedError

    def _emit_timeout(self, tid: str, deadline: float, context: object) -> None:
        raise NotImplementedError

    def _deliver(self, outcome: TriggerOutcome) -> None:
        raise NotImplementedError
