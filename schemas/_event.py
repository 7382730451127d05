"""A TriggerEventRecord read for folding, without building the model when it need not.

The scheduler reads every event once and folds it; building the pydantic model (with its
``TaskKey``) was a fifth of its work per event. :func:`decode_event` checks the usual shape of
an event by hand, as :func:`~deferline.schemas.decode_deferral` does for a DeferRequest, and
hands anything else (a missing field, a value the model would coerce or reject) to the model,
so every error is the model's own. ``tests/schemas/test_event.py`` holds the two to each other.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ._codec import LastRead, from_tagged
from ._deferral import _instant, _queue_ok, _tagged_object
from ._errors import SchemaError
from ._models import AnyRecord, EventStatus, TaskKey, TaskOutcome, TriggerEventRecord
from ._wire import decode_fields

__all__ = ["EventFields", "decode_event", "quick_event_fields"]

_STATUSES = frozenset({"fired", "failed", "timed_out", "cancelled"})
_OUTCOMES = frozenset({"success", "failed", "skipped"})
_validate_task_key = TaskKey.__pydantic_validator__.validate_python
# A burst's events carry one due moment and one queue: each read once, not once an event.
_due_instant = LastRead(_instant)
_known_queue = LastRead(_queue_ok)


@dataclass(slots=True)
class EventFields:
    """The fields of a :class:`~deferline.schemas.TriggerEventRecord`, in slots."""

    event_id: str
    trigger_id: str
    task: TaskKey
    defer_seq: int
    status: EventStatus
    payload: Any
    task_outcome: TaskOutcome | None
    xcoms: dict[str, Any] | None
    error: str | None
    traceback: str | None
    due_at: dt.datetime | None
    emitted_at: dt.datetime
    member: str | None
    partition: int | None
    queue: str | None
    resumed_directly: bool

    @classmethod
    def of(cls, record: TriggerEventRecord) -> EventFields:
        return cls(
            event_id=record.event_id,
            trigger_id=record.trigger_id,
            task=record.task,
            defer_seq=record.defer_seq,
            status=record.status,
            payload=record.payload,
            task_outcome=record.task_outcome,
            xcoms=record.xcoms,
            error=record.error,
            traceback=record.traceback,
            due_at=record.due_at,
            emitted_at=record.emitted_at,
            member=record.member,
            partition=record.partition,
            queue=record.queue,
            resumed_directly=record.resumed_directly,
        )

    def full(self) -> TriggerEventRecord:
        """The record these fields were read from (an equal one)."""
        return TriggerEventRecord(
            event_id=self.event_id,
            trigger_id=self.trigger_id,
            task=self.task,
            defer_seq=self.defer_seq,
            status=self.status,
            payload=self.payload,
            task_outcome=self.task_outcome,
            xcoms=self.xcoms,
            error=self.error,
            traceback=self.traceback,
            due_at=self.due_at,
            emitted_at=self.emitted_at,
            member=self.member,
            partition=self.partition,
            queue=self.queue,
            resumed_directly=self.resumed_directly,
        )


def quick_event_fields(raw: dict[str, Any]) -> EventFields | None:
    """The fields of a decoded TriggerEventRecord ``raw`` in its usual shape; None: ask the
    model. Accepts only what :class:`TriggerEventRecord` accepts unchanged, with its values."""
    event_id = raw.get("event_id")
    trigger_id = raw.get("trigger_id")
    defer_seq = raw.get("defer_seq", 0)
    status = raw.get("status")
    outcome = raw.get("task_outcome")
    partition = raw.get("partition")
    queue = raw.get("queue")
    resumed_directly = raw.get("resumed_directly", False)
    error = raw.get("error")
    traceback = raw.get("traceback")
    member = raw.get("member")
    if (
        type(event_id) is not str
        or not event_id
        or type(trigger_id) is not str
        or not trigger_id
        or type(defer_seq) is not int
        or type(status) is not str
        or status not in _STATUSES
        or (outcome is not None and (type(outcome) is not str or outcome not in _OUTCOMES))
        or (error is not None and type(error) is not str)
        or (traceback is not None and type(traceback) is not str)
        or (member is not None and type(member) is not str)
        or (partition is not None and type(partition) is not int)
        or (queue is not None and not _known_queue(queue))
        or type(resumed_directly) is not bool
    ):
        return None
    emitted_at = _instant(raw.get("emitted_at"))  # absent: the model's default is now
    due_at = raw.get("due_at")
    if emitted_at is None or (due_at is not None and (due_at := _due_instant(due_at)) is None):
        return None
    xcoms = raw.get("xcoms")
    if xcoms is not None and (xcoms := _tagged_object(xcoms)) is None:
        return None
    task = raw.get("task")
    if type(task) is not dict:
        return None
    try:
        payload = from_tagged(raw.get("payload"))
        key = _validate_task_key(task)  # model_validate without its Python wrapper
    except (SchemaError, ValidationError):
        return None
    return EventFields(
        event_id,
        trigger_id,
        key,
        defer_seq,
        raw["status"],  # status, as the Literal type the checks above made sure of
        payload,
        raw.get("task_outcome"),  # outcome, likewise
        xcoms,
        error,
        traceback,
        due_at,
        emitted_at,
        member,
        partition,
        queue,
        resumed_directly,
    )


def decode_event(data: bytes | bytearray | memoryview | str) -> EventFields | AnyRecord:
    """:func:`~deferline.schemas.decode` for the scheduler: a TriggerEventRecord as its fields.

    Raises :class:`SchemaError` as ``decode`` does, with the same message.
    """
    return decode_fields(
        data, "trigger_event", TriggerEventRecord, quick_event_fields, EventFields.of
    )
