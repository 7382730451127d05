"""Airflow's trigger rows as deferline's records, and back: pure, no database, no broker.

A claimed row becomes a :class:`~deferline.schemas.DeferRequest` whose trigger id names the
row (its id and its ``created_date``), so every bridge that ever claims the row publishes the
same key, and an event coming back names the row it belongs to. The ``created_date`` guards
against a row id the database hands out again after the row was deleted (SQLite does).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deferline.schemas import (
    AssetRef,
    DeferlineError,
    DeferRequest,
    EventFields,
    KwargsCipher,
    SchemaError,
    TaskKey,
    TriggerEventRecord,
    WatchEvent,
    WatchRequest,
    decode_as,
    decode_event,
    dumps_value,
    seal,
)
from deferline.topics import InvalidQueueName, validate_queue_name
from pydantic import ValidationError

__all__ = [
    "BridgeEvent",
    "ClaimedRow",
    "KwargsNotRendered",
    "RejectedRow",
    "RowRef",
    "WatchApply",
    "WatchRow",
    "bridge_event",
    "bridge_trigger_id",
    "parse_trigger_id",
    "read_event",
    "to_defer_request",
    "to_watch_request",
]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_TRIGGER_ID = re.compile(r"^airflow-(\d+)-(\d+)$")


@dataclass(frozen=True, slots=True)
class RowRef:
    """One row of Airflow's ``trigger`` table: its id and when it was created."""

    row_id: int
    created_micros: int
    """``created_date`` in microseconds since the epoch (UTC)."""

    @property
    def created(self) -> dt.datetime:
        """``created_date`` (UTC)."""
        return _EPOCH + dt.timedelta(microseconds=self.created_micros)

    @classmethod
    def of(cls, row_id: int, created: dt.datetime) -> RowRef:
        if created.tzinfo is None:  # Airflow stores UTC; some dialects hand it back naive
            created = created.replace(tzinfo=dt.UTC)
        return cls(row_id, (created - _EPOCH) // dt.timedelta(microseconds=1))


def bridge_trigger_id(row: RowRef) -> str:
    """``airflow-<row id>-<created_date in µs since the epoch>``: the row's deferline key."""
    return f"airflow-{row.row_id}-{row.created_micros}"


def parse_trigger_id(trigger_id: str) -> RowRef | None:
    """The row a bridge trigger id names; None for an id no bridge made."""
    match = _TRIGGER_ID.fullmatch(trigger_id)
    if match is None:
        return None
    return RowRef(int(match[1]), int(match[2]))


class KwargsNotRendered(Exception):
    """A ``start_from_trigger`` row's templated kwargs could not be rendered."""


@dataclass(frozen=True, slots=True)
class ClaimedRow:
    """What the bridge read of a claimed trigger row and of the task instance waiting on it.

    ``kwargs`` is None when Airflow's own code could not decrypt or read them; ``kwargs_error``
    then says why.
    """

    ref: RowRef
    classpath: str
    kwargs: Mapping[str, Any] | None
    kwargs_error: BaseException | None
    queue: str | None
    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    try_number: int
    trigger_timeout: dt.datetime | None
    next_method: str | None


@dataclass(frozen=True, slots=True)
class WatchRow:
    """A claimed row no task instance waits on: an asset watcher (a ``BaseEventTrigger``
    whose events become asset events; ``assets`` as (name, uri)) or a deadline-alert
    callback (``callback``: it runs once, its events are the callback's states)."""

    ref: RowRef
    classpath: str
    kwargs: Mapping[str, Any] | None
    kwargs_error: BaseException | None
    queue: str | None
    assets: tuple[tuple[str, str], ...]
    callback: bool = False


@dataclass(frozen=True, slots=True)
class WatchApply:
    """One event of an asset watcher to write back: an asset event per watched asset, once."""

    ref: RowRef
    event_id: str
    status: Literal["fired", "failed"]
    payload: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class BridgeEvent:
    """One trigger event to write back into Airflow (made by :func:`bridge_event`)."""

    ref: RowRef
    kind: Literal["fired", "failed", "timed_out"]
    payload: Any = None
    task_outcome: Literal["success", "failed", "skipped"] | None = None
    xcoms: dict[str, Any] | None = None
    traceback: list[str] | None = None


@dataclass(frozen=True, slots=True)
class RejectedRow:
    """A row whose trigger cannot run: the task instance fails with ``reason``."""

    ref: RowRef
    reason: BadTriggerRow


class BadTriggerRow(DeferlineError):
    """An Airflow trigger row the bridge cannot hand to deferline (the reason says why)."""


def _allowed(classpath: str, prefixes: Sequence[str]) -> bool:
    for prefix in prefixes:
        prefix = prefix.strip().rstrip(".")
        if prefix and (classpath == prefix or classpath.startswith(prefix + ".")):
            return True
    return False


def to_defer_request(
    row: ClaimedRow,
    *,
    allowed_prefixes: Sequence[str],
    cipher: KwargsCipher | None,
) -> DeferRequest | RejectedRow:
    """The DeferRequest of a claimed row, or why its task instance must fail instead."""
    try:
        return _request(row, allowed_prefixes, cipher)
    except BadTriggerRow as exc:
        return RejectedRow(row.ref, exc)


def _checked_kwargs(
    classpath: str,
    kwargs: Mapping[str, Any] | None,
    error: BaseException | None,
    allowed_prefixes: Sequence[str],
) -> dict[str, Any]:
    """A row's kwargs, once its class is allowed and its kwargs read and fit to travel."""
    if not _allowed(classpath, allowed_prefixes):
        raise BadTriggerRow(
            f"trigger class {classpath!r} is not under an allowed prefix "
            f"({', '.join(allowed_prefixes) or 'none'}); set DEFERLINE_ALLOWED_TRIGGER_PREFIXES"
        )
    if kwargs is None:
        if isinstance(error, KwargsNotRendered):
            raise BadTriggerRow(
                f"the trigger's templated kwargs could not be rendered: {error}"
            ) from error
        raise BadTriggerRow(
            f"the trigger's kwargs cannot be read with Airflow's key: {error!r}"
        ) from error
    checked = dict(kwargs)
    try:
        dumps_value(checked)  # every value must travel as tagged JSON
    except SchemaError as exc:
        raise BadTriggerRow(f"the trigger's kwargs cannot travel to deferline: {exc}") from exc
    return checked


def _checked_queue(queue: str | None) -> str | None:
    if queue is not None:
        try:
            validate_queue_name(queue)
        except InvalidQueueName as exc:
            raise BadTriggerRow(str(exc)) from exc
    return queue


def _request(
    row: ClaimedRow, allowed_prefixes: Sequence[str], cipher: KwargsCipher | None
) -> DeferRequest:
    kwargs = _checked_kwargs(row.classpath, row.kwargs, row.kwargs_error, allowed_prefixes)
    queue = _checked_queue(row.queue)
    try:
        task = TaskKey(
            dag_id=row.dag_id,
            task_id=row.task_id,
            run_id=row.run_id,
            map_index=row.map_index,
            try_number=row.try_number,
        )
        request = DeferRequest(
            trigger_id=bridge_trigger_id(row.ref),
            task=task,
            classpath=row.classpath,
            kwargs=kwargs,
            next_method=row.next_method or "execute_complete",
            timeout_at=_aware(row.trigger_timeout),
            queue=queue,
            # The row's own moment: a re-claim publishes the same bytes again.
            requested_at=row.ref.created,
        )
    except ValidationError as exc:
        raise BadTriggerRow(f"the task instance cannot be named in deferline: {exc}") from exc
    return seal(request, cipher)


def to_watch_request(
    row: WatchRow, *, allowed_prefixes: Sequence[str], cipher: KwargsCipher | None
) -> WatchRequest | RejectedRow:
    """The WatchRequest of an asset watcher or callback row, or why it cannot run in
    deferline (a callback's ``callback_path`` is checked against the prefixes too)."""
    try:
        kwargs = _checked_kwargs(row.classpath, row.kwargs, row.kwargs_error, allowed_prefixes)
        path = kwargs.get("callback_path") if row.callback else None
        if row.callback and not (isinstance(path, str) and _allowed(path, allowed_prefixes)):
            raise BadTriggerRow(
                f"the callback {path!r} is not under an allowed prefix "
                f"({', '.join(allowed_prefixes) or 'none'}); set DEFERLINE_ALLOWED_TRIGGER_PREFIXES"
            )
        queue = _checked_queue(row.queue)
        request = WatchRequest(
            trigger_id=bridge_trigger_id(row.ref),
            classpath=row.classpath,
            kwargs=kwargs,
            queue=queue,
            assets=[AssetRef(name=name, uri=uri) for name, uri in row.assets],
            once=row.callback,
            requested_at=row.ref.created,  # a re-claim publishes the same bytes again
        )
    except BadTriggerRow as exc:
        return RejectedRow(row.ref, exc)
    except ValidationError as exc:
        return RejectedRow(
            row.ref, BadTriggerRow(f"the watcher cannot be named in deferline: {exc}")
        )
    return seal(request, cipher)


def _aware(moment: dt.datetime | None) -> dt.datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=dt.UTC)


def read_event(data: bytes) -> EventFields | WatchEvent:
    """A TriggerEventRecord's fields without a model where its shape allows
    (:func:`~deferline.schemas.decode_event`), or a WatchEvent; raises the
    :class:`SchemaError` that ``decode_as(data, TriggerEventRecord)`` raises for anything
    else (another kind included)."""
    try:
        fields = decode_event(data)
    except SchemaError:
        fields = None
    if isinstance(fields, EventFields | WatchEvent):
        return fields
    return EventFields.of(decode_as(data, TriggerEventRecord))  # raises the model's error


def bridge_event(
    record: TriggerEventRecord | EventFields | WatchEvent,
) -> BridgeEvent | WatchApply | None:
    """What to write back into Airflow for one event; None when there is nothing to write.

    A cancelled trigger writes nothing (its cancel came from Airflow itself), nor does an
    event of a trigger no bridge published (another producer's key on the bridge's topics).
    """
    ref = parse_trigger_id(record.trigger_id)
    if ref is None or record.status == "cancelled":
        return None
    if isinstance(record, WatchEvent):
        return WatchApply(ref, record.event_id, record.status, record.payload, record.error)
    if record.status == "failed":
        lines = record.traceback.splitlines(keepends=True) if record.traceback else []
        if record.error and not any(record.error in line for line in lines):
            lines.append(record.error + "\n")
        return BridgeEvent(ref, "failed", traceback=lines)
    if record.status == "timed_out":
        return BridgeEvent(ref, "timed_out")
    return BridgeEvent(
        ref,
        "fired",
        payload=record.payload,
        task_outcome=record.task_outcome,
        xcoms=dict(record.xcoms) if record.xcoms is not None else None,
    )
