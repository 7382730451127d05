"""The trigger contract, shaped like Airflow's so an Airflow trigger runs here unchanged.

A trigger is a small, serializable object whose ``run()`` is an async generator of
:class:`TriggerEvent`. The supervisor runs it, awaits ``cleanup()`` afterwards whatever
happened, and turns each event into an outcome with a deterministic event id.
"""

from __future__ import annotations

import abc
import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar, NamedTuple

from deferline.schemas import make_event_id

__all__ = [
    "BaseTaskEndEvent",
    "BaseTrigger",
    "SourcePosition",
    "SourcedEvent",
    "TaskFailedEvent",
    "TaskFailureEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TimerSpec",
    "TriggerEvent",
]


class TriggerEvent:
    """Something a trigger observed; ``payload`` is handed to the resumed task as ``event``.

    Two copies of one trigger that observe the same thing must yield equal payloads: the
    event id is derived from the trigger id and the payload, and duplicates are dropped
    by that id.
    """

    __slots__ = ("payload",)

    def __init__(self, payload: Any = None) -> None:
        self.payload = payload

    def event_id(self, trigger_id: str, status: str = "fired") -> str:
        """The deterministic id this event gets when trigger ``trigger_id`` emits it."""
        return make_event_id(trigger_id, status, self.payload)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, TriggerEvent)
        return bool(self.payload == other.payload)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TriggerEvent<{self.payload!r}>"


class SourcePosition(NamedTuple):
    """Where an event came from: one record of a Kafka topic on the triggerer's own cluster,
    read by the consumer group ``group``.

    Whoever publishes the event also commits ``offset + 1`` for ``group``: in the event's
    transaction where the triggerer writes in transactions, right after the event is acked
    where it does not. A trigger that starts reading from the group's committed offsets then
    neither skips a record whose event was lost nor, with transactions, reads one again whose
    event was published.
    """

    group: str
    topic: str
    partition: int
    offset: int


class SourcedEvent(TriggerEvent):
    """An event read from a record of a Kafka topic (:class:`SourcePosition`).

    A standing watch's sourced event is named after its record (partition and offset), not
    after the run that read it, so the same record read again after a restart is the same
    event: its consumer drops the repeat by id.
    """

    __slots__ = ("source",)

    def __init__(self, payload: Any, *, source: SourcePosition) -> None:
        super().__init__(payload)
        self.source = source

    def __repr__(self) -> str:
        s = self.source
        return f"SourcedEvent<{s.topic}/{s.partition}@{s.offset}: {self.payload!r}>"


class BaseTaskEndEvent(TriggerEvent):
    """An event that ends the task straight from the trigger (Airflow's ``end_from_trigger``).

    The payload is the final task state; ``xcoms`` optionally carries the task's output
    values (XCom key to value), pushed as if the task had returned them.
    """

    __slots__ = ("xcoms",)
    task_instance_state: ClassVar[str]

    def __init__(self, *, xcoms: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if "payload" in kwargs:
            raise ValueError(
                f"{type(self).__name__} takes no payload; its payload is the task state"
            )
        if kwargs:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")
        if xcoms is not None and (
            not isinstance(xcoms, dict) or not all(isinstance(k, str) for k in xcoms)
        ):
            raise TypeError("xcoms must be a dict with string keys")
        super().__init__(self.task_instance_state)
        self.xcoms = xcoms

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, BaseTaskEndEvent)
        return bool(self.xcoms == other.xcoms)

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}<xcoms={self.xcoms!r}>"


class TaskSuccessEvent(BaseTaskEndEvent):
    """End the task as succeeded, without resuming it on a worker."""

    __slots__ = ()
    task_instance_state = "success"


class TaskFailureEvent(BaseTaskEndEvent):
    """End the task as failed, without resuming it on a worker."""

    __slots__ = ()
    task_instance_state = "failed"


TaskFailedEvent = TaskFailureEvent
"""Airflow's name for :class:`TaskFailureEvent`."""


class TaskSkippedEvent(BaseTaskEndEvent):
    """End the task as skipped, without resuming it on a worker."""

    __slots__ = ()
    task_instance_state = "skipped"


class TimerSpec(NamedTuple):
    """What a pure-deadline trigger does: yield ``event`` once ``moment`` has passed.

    Returned by :meth:`BaseTrigger.as_timer`. The supervisor then keeps the trigger as
    one entry of its shared timer heap instead of running a coroutine for it. (A named
    tuple: it is built once per added timer, so it must be cheap.)
    """

    moment: dt.datetime
    event: TriggerEvent


class BaseTrigger(abc.ABC):
    """Base class of every trigger (Airflow's ``airflow.triggers.base.BaseTrigger`` shape).

    Subclasses implement ``__init__`` and ``serialize()`` as a pair (the kwargs returned by
    ``serialize()`` rebuild an equal trigger anywhere), and ``run()`` as an async generator
    that yields one or more :class:`TriggerEvent`. ``cleanup()`` is always awaited after
    ``run()`` ends, whatever the reason. ``run()`` must never block the event loop.
    """

    supports_triggerer_queue: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        # Set by the runner before run() starts, as Airflow's triggerer does.
        self.trigger_id: str | None = None
        self.task_instance: Any = None

    @abc.abstractmethod
    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return ``(classpath, kwargs)`` from which this trigger can be rebuilt."""

    @abc.abstractmethod
    def run(self) -> AsyncIterator[TriggerEvent]:
        """Wait for the condition and yield events (implement as ``async def`` with ``yield``).

        Returning before the first event is an error; raising fails the waiting task.
        """

    async def cleanup(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release what ``run()`` acquired; awaited after ``run()`` ends for any reason."""

    async def on_kill(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Stop external work this trigger started, when a user cancels it (Airflow 3.3's hook).

        Awaited after ``run()`` is cancelled and before ``cleanup()``, only when the trigger
        is cancelled by a user action (a cleared task, ``deferline clear``, a cancel request);
        never when its partition moves to another member, the triggerer stops, it times out
        or it fires. Bounded like ``cleanup()``; what it raises is logged.
        """

    def as_timer(self) -> TimerSpec | None:
        """Declare a pure deadline: ``run()`` only waits for a moment, then yields one event.

        Return a :class:`TimerSpec` to let the supervisor keep this trigger in its shared
        timer heap (one small entry, no coroutine) instead of calling ``run()``. The
        declaration is honoured only when the class that defines ``as_timer`` is also the
        one whose ``run`` and ``cleanup`` are in effect, so a subclass that overrides either
        runs as a normal coroutine trigger. Return ``None`` (the default) to always run.
        """
        return None

    @property
    def log(self) -> logging.Logger:
        """A logger named after the trigger class (Airflow's ``LoggingMixin.log``)."""
        cls = type(self)
        return logging.getLogger(f"{cls.__module__}.{cls.__qualname__}")

    @staticmethod
    def repr(classpath: str, kwargs: dict[str, Any]) -> str:
        """Render a trigger from its serialized form."""
        args = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        return f"<{classpath} {args}>"

    def __repr__(self) -> str:
        try:
            classpath, kwargs = self.serialize()
        except Exception:  # a broken serialize() must not break logging
            return f"<{type(self).__module__}.{type(self).__qualname__} (unserializable)>"
        return self.repr(classpath, kwargs)
