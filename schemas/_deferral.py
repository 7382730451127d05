"""A DeferRequest read for running its trigger, without building the model when it need not.

A triggerer reads every DeferRequest of its partitions, live and on each rebuild, and needs
only a few of its fields; building the whole model (with its ``TaskKey`` and
``ResumeTarget``) was its largest cost per record. :func:`decode_deferral` checks the usual
shape of a request by hand and hands anything else (a missing field, a value the model would
coerce, a value it would reject) to the model, so every error is the model's own and nothing
the model refuses is ever run. ``tests/schemas/test_deferral.py`` holds the two to each other.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ._codec import TYPE, from_tagged
from ._errors import SchemaError
from ._models import (
    QUEUE_MAX,
    QUEUE_PATTERN,
    TRIGGER_ID_MAX,
    AnyRecord,
    DeferRequest,
    TaskKey,
)
from ._wire import decode_fields

__all__ = ["DeferFields", "decode_deferral", "quick_defer_fields"]

# RFC 3339 as the wire writes it: both the model and fromisoformat read these alike.
_INSTANT = re.compile(
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d"
    r"(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
)
_QUEUE = re.compile(QUEUE_PATTERN)


@dataclass(slots=True)
class DeferFields:
    """What running a DeferRequest's trigger needs of it."""

    trigger_id: str
    task: TaskKey
    defer_seq: int
    classpath: str
    kwargs: dict[str, Any]
    kwargs_token: str | None
    timeout_at: dt.datetime | None

    @classmethod
    def of(cls, request: DeferRequest) -> DeferFields:
        return cls(
            trigger_id=request.trigger_id,
            task=request.task,
            defer_seq=request.defer_seq,
            classpath=request.classpath,
            kwargs=request.kwargs,
            kwargs_token=request.kwargs_token,
            timeout_at=request.timeout_at,
        )


def _instant(value: Any) -> dt.datetime | None:
    if type(value) is not str or _INSTANT.fullmatch(value) is None:
        return None
    try:
        return dt.datetime.fromisoformat(value)
    except ValueError:  # a day the month lacks: the model names it
        return None


def _queue_ok(value: Any) -> bool:
    # fullmatch: the pattern's "$" does not let a final newline by, as in the model.
    return type(value) is str and len(value) <= QUEUE_MAX and _QUEUE.fullmatch(value) is not None


def _tagged_object(value: Any) -> dict[str, Any] | None:
    if type(value) is not dict or TYPE in value:
        return None
    try:
        decoded: dict[str, Any] = from_tagged(value)
    except SchemaError:
        return None
    return decoded


def _resume_ok(resume: Any) -> bool:
    """A ResumeTarget the model takes as it is (or none): what every worker writes."""
    if resume is None:
        return True
    if type(resume) is not dict:
        return False
    queue = resume.get("worker_queue", "default")
    slots = resume.get("pool_slots", 1)
    retries = resume.get("retries", 0)
    return (
        type(resume.get("operator")) is str
        and _queue_ok(queue)
        and type(resume.get("pool", "")) is str
        and type(slots) is int
        and slots >= 1
        and type(resume.get("priority_weight", 1)) is int
        and type(retries) is int
        and retries >= 0
        and _tagged_object(resume.get("op_kwargs", {})) is not None
    )


def quick_defer_fields(raw: dict[str, Any]) -> DeferFields | None:
    """The fields of a decoded DeferRequest ``raw`` in its usual shape; None: ask the model.

    Accepts only what :class:`DeferRequest` accepts unchanged, and gives the same values.
    """
    trigger_id = raw.get("trigger_id")
    classpath = raw.get("classpath")
    defer_seq = raw.get("defer_seq", 0)
    token = raw.get("kwargs_token")
    queue = raw.get("queue")
    if (
        type(trigger_id) is not str
        or not 0 < len(trigger_id) <= TRIGGER_ID_MAX
        or type(classpath) is not str
        or not classpath
        or type(defer_seq) is not int
        or defer_seq < 0
        or (token is not None and (type(token) is not str or not token))
        or type(raw.get("next_method", "")) is not str
        or type(raw.get("end_from_trigger", False)) is not bool
        or (queue is not None and not _queue_ok(queue))
        or not _resume_ok(raw.get("resume"))
        or ("requested_at" in raw and _instant(raw["requested_at"]) is None)
    ):
        return None
    kwargs = _tagged_object(raw.get("kwargs", {}))
    if kwargs is None or (token is not None and kwargs):
        return None
    next_kwargs = raw.get("next_kwargs")
    if next_kwargs is not None and _tagged_object(next_kwargs) is None:
        return None
    timeout_at = raw.get("timeout_at")
    if timeout_at is not None and (timeout_at := _instant(timeout_at)) is None:
        return None
    task = raw.get("task")
    if type(task) is not dict:
        return None
    try:
        key = TaskKey.model_validate(task)
    except ValidationError:
        return None
    return DeferFields(trigger_id, key, defer_seq, classpath, kwargs, token, timeout_at)


def decode_deferral(data: bytes | bytearray | memoryview | str) -> DeferFields | AnyRecord:
    """:func:`~deferline.schemas.decode` for a defer topic: a DeferRequest as its fields.

    Raises :class:`SchemaError` as ``decode`` does, with the same message.
    """
    return decode_fields(data, "defer_request", DeferRequest, quick_defer_fields, DeferFields.of)
