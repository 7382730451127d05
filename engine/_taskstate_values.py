"""The values the task table works with: where a record sits in its task's life, what
folding it did, the records it emits (among them the RunTask of a resume), its counters and
its per-task view."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from deferline.schemas import (
    SCHEMA_VERSION,
    CancelRequest,
    EventFields,
    MomentTagger,
    ResumeTarget,
    RunTask,
    SchemaError,
    TaskKey,
    TaskStateRecord,
    dumps_record,
    encode,
    to_tagged,
    whole_minute_offset,
)

FAIL_METHOD: Final = "__fail__"
"""``next_method`` of a task whose trigger failed or timed out: the worker fails the task."""

HOLDING_STATES: Final = frozenset({"queued", "running", "deferred"})
"""States that hold a pool slot."""

TERMINAL_STATES: Final = frozenset({"success", "failed", "skipped", "up_for_retry", "removed"})
"""States that end an attempt."""

_FINISHED: Final = frozenset({"success", "failed", "skipped", "removed"})
_END: Final = 1 << 40  # progress of a finished attempt, beyond any deferral
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_STEP: Final[Mapping[str, int]] = {"scheduled": 0, "queued": 1, "running": 2}

Progress = tuple[int, int, int]
Verdict = Literal[
    "applied", "echo", "stale", "pending", "duplicate", "direct", "cancelled", "resent"
]
"""What folding one record did.

``applied``: the state moved; ``echo``: the record repeats the current state; ``stale``: a
task record behind the current state; ``pending``: an event held until its deferral is seen;
``duplicate``: an event for a deferral already resolved (or never matching); ``direct``: the
first event of a deferral the triggerer already resumed directly, seen after the worker moved
on; ``cancelled``: the expected ``cancelled`` event of a trigger whose task was cleared;
``resent``: an event re-read after a takeover (``resend=True``) whose task is still ``queued``
on it: its RunTask is published again, nothing else changes.
"""


def progress(record: TaskStateRecord | _Slim) -> Progress:
    """Where a record sits in its task's life: (try number, deferral, step).

    Within a try: ``scheduled`` < ``queued`` < ``running`` < ``deferred`` #0 < ``scheduled`` /
    ``queued`` / ``running`` after resume #0 (records naming the trigger) < ``deferred`` #1 <
    ... < the end of the try. ``removed`` is after every other end: a cleared attempt stays
    cleared.
    """
    try_number = record.try_number if isinstance(record, _Slim) else record.task.try_number
    state = record.state
    if state == "removed":
        return (try_number, _END, 1)
    if state in TERMINAL_STATES:
        return (try_number, _END, 0)
    if state == "deferred":
        return (try_number, record.defer_seq + 1, 0)
    step = _STEP[state]
    if record.trigger_id is None:
        return (try_number, 0, step)
    return (try_number, record.defer_seq + 1, step + 1)


Decision = TaskStateRecord | RunTask | CancelRequest


class Emit:
    """A record the table decided to publish.

    ``queue`` is the trigger queue of a CancelRequest (its topic is ``defer.<queue>``); the
    other records name their destination themselves (``RunTask.worker_queue`` and ``mode``,
    the tasks topic for a TaskStateRecord).

    The state and the RunTask of a resume (one each per event: the hot path) are given as
    drafts the table built without pydantic; :attr:`record` builds the model on first use,
    and :meth:`value` encodes the draft from a template, the bytes the model's encoder gives.
    """

    __slots__ = ("_draft", "_record", "key", "kind", "queue", "resumes", "worker_queue")

    kind: str
    """The record's ``kind``: ``task_state``, ``run_task`` or ``cancel_request``."""
    key: str
    """The record's message key: the task's ``ti_key``; a CancelRequest's trigger id."""
    worker_queue: str | None
    """A RunTask's worker queue; None for other records."""
    resumes: bool
    """True for a RunTask that resumes a task (its topic is ``queue[.<wq>].resumes``)."""

    def __init__(
        self,
        record: Decision | _Slim | _ResumeRun,
        queue: str | None = None,
        *,
        key: str | None = None,
    ) -> None:
        """``key``: the record's task key when the caller has it (else computed)."""
        # Where it goes is read once per record by the router and the batch builder:
        # plain attributes, set here, not properties.
        self.queue = queue
        self._draft: _Slim | _ResumeRun | None
        self._record: Decision | None
        if isinstance(record, _DRAFTS):  # a tuple made once: a union is made at each call
            self._draft, self._record = record, None
            self.kind = record.kind
            self.key = record.ti_key if key is None else key
            if isinstance(record, _ResumeRun):
                self.worker_queue, self.resumes = record.target.worker_queue, True
            else:
                self.worker_queue, self.resumes = None, False
            return
        self._draft, self._record = None, record
        self.kind = record.kind
        if isinstance(record, CancelRequest):
            self.key = record.trigger_id
        else:
            self.key = record.task.ti_key if key is None else key
        if isinstance(record, RunTask):
            self.worker_queue, self.resumes = record.worker_queue, record.mode == "resume"
        else:
            self.worker_queue, self.resumes = None, False

    @property
    def record(self) -> Decision:
        """The record, as its model."""
        if self._record is None:
            assert self._draft is not None
            self._record = self._draft.full()
        return self._record

    @property
    def written(self) -> WrittenState:
        """A task state as :meth:`TaskTable.apply` takes it back when it is read back."""
        if isinstance(self._draft, _Slim):
            return self._draft
        record = self.record
        assert isinstance(record, TaskStateRecord), "only task states are read back"
        return record

    def value(self) -> bytes:
        """The record's wire JSON."""
        return self._draft.encode() if self._draft is not None else encode(self.record)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Emit):
            return NotImplemented
        return (self.record, self.queue) == (other.record, other.queue)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Emit({self.record!r}, queue={self.queue!r})"


@dataclass(slots=True)
class TableCounters:
    """Running totals of what the table did (exported as metrics)."""

    states_applied: int = 0
    states_stale: int = 0
    events_applied: int = 0
    events_duplicate: int = 0
    events_direct: int = 0
    events_cancelled: int = 0
    events_orphaned: int = 0
    resumes: int = 0
    resends: int = 0
    starts: int = 0
    ended_by_trigger: int = 0
    retries: int = 0
    cancels: int = 0
    repairs: int = 0


class _Slim:
    """A task's current state record, kept small (about a quarter of the pydantic model's
    memory): fields in slots, the task key as its parts, dag and task ids interned, resume
    targets shared (see :meth:`TaskTable._shared`). :meth:`full` gives the record back,
    :meth:`encode` its wire JSON. Never changed in place: a view that moves gets a new one.
    """

    kind: ClassVar = "task_state"

    __slots__ = (
        "dag_id",
        "defer_seq",
        "event",
        "event_id",
        "map_index",
        "next_kwargs",
        "next_method",
        "queue",
        "reason",
        "resume",
        "run_id",
        "source",
        "state",
        "task_id",
        "timeout_at",
        "trigger_id",
        "try_number",
        "updated_at",
        "xcoms",
    )

    def __init__(self, record: TaskStateRecord, resume: ResumeTarget | None) -> None:
        task = record.task
        self.dag_id = sys.intern(task.dag_id)
        self.task_id = sys.intern(task.task_id)
        self.run_id = task.run_id
        self.map_index = task.map_index
        self.try_number = task.try_number
        self.state = record.state
        self.trigger_id = record.trigger_id
        self.defer_seq = record.defer_seq
        self.next_method = None if record.next_method is None else sys.intern(record.next_method)
        self.next_kwargs = record.next_kwargs
        self.event = record.event
        self.event_id = record.event_id
        self.reason = record.reason
        self.updated_at = record.updated_at
        self.source = record.source
        self.resume = resume
        self.timeout_at = record.timeout_at
        self.queue = record.queue
        self.xcoms = record.xcoms

    @property
    def ti_key(self) -> str:
        return f"{self.dag_id}/{self.task_id}/{self.run_id}/{self.map_index}"

    def task_fields(self) -> dict[str, Any]:
        """The task key as its wire JSON object."""
        return {
            "dag_id": self.dag_id,
            "task_id": self.task_id,
            "run_id": self.run_id,
            "map_index": self.map_index,
            "try_number": self.try_number,
        }

    @property
    def task(self) -> TaskKey:
        return TaskKey.model_construct(
            dag_id=self.dag_id,
            task_id=self.task_id,
            run_id=self.run_id,
            map_index=self.map_index,
            try_number=self.try_number,
        )

    def full(self) -> TaskStateRecord:
        """The record this was made from (an equal one)."""
        return TaskStateRecord(
            task=self.task,
            state=self.state,
            trigger_id=self.trigger_id,
            defer_seq=self.defer_seq,
            next_method=self.next_method,
            next_kwargs=self.next_kwargs,
            event=self.event,
            event_id=self.event_id,
            reason=self.reason,
            updated_at=self.updated_at,
            source=self.source,
            resume=self.resume,
            timeout_at=self.timeout_at,
            queue=self.queue,
            xcoms=self.xcoms,
        )

    def encode(self) -> bytes:
        """The wire JSON of :meth:`full`, from a template (the same bytes)."""
        updated_at, timeout_at = self.updated_at, self.timeout_at
        if whole_minute_offset(updated_at) and (
            timeout_at is None or whole_minute_offset(timeout_at)
        ):
            try:
                return dumps_record(
                    {
                        "version": SCHEMA_VERSION,
                        "kind": "task_state",
                        "task": {
                            "dag_id": self.dag_id,
                            "task_id": self.task_id,
                            "run_id": self.run_id,
                            "map_index": self.map_index,
                            "try_number": self.try_number,
                        },
                        "state": self.state,
                        "trigger_id": self.trigger_id,
                        "defer_seq": self.defer_seq,
                        "next_method": self.next_method,
                        "next_kwargs": _tagged(self.next_kwargs),
                        "event": _tagged_value(self.event),
                        "event_id": self.event_id,
                        "reason": self.reason,
                        "updated_at": updated_at,
                        "source": self.source,
                        "resume": None if self.resume is None else _target_fields(self.resume),
                        "timeout_at": timeout_at,
                        "queue": self.queue,
                        "xcoms": _tagged(self.xcoms),
                    }
                )
            except (SchemaError, TypeError):  # orjson's errors are TypeErrors
                pass  # the model's encoder names the field, or writes what orjson will not
        return encode(self.full())

    def __eq__(self, other: object) -> bool:
        # A decoded record read back is compared with the drafts a view waits for.
        if isinstance(other, TaskStateRecord):
            return self.full() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def _tagged(value: Any) -> Any:
    return None if value is None else to_tagged(value)


_PLAIN: Final = frozenset({str, bool, type(None)})
_INT64: Final = range(-(2**63), 2**63)


# A resumed state and its RunTask each tag the event's payload: a burst of timers' events carry
# one moment (9 % of a scheduler's CPU when a million fell due at once).
_tag_moment: Final = MomentTagger()


def _tagged_value(value: Any) -> Any:
    """:func:`to_tagged`, with the usual payloads (a plain str, bool, None or 64-bit int,
    which it returns as they are) passed through without the call, and a moment equal to
    the last one tagged given the same form."""
    kind = type(value)
    if kind in _PLAIN or (kind is int and value in _INT64):
        return value
    return _tag_moment(value)


def _tagged_kwargs(kwargs: dict[str, Any]) -> Any:
    return to_tagged(kwargs) if kwargs else {}  # most targets have none


def _target_fields(target: ResumeTarget) -> dict[str, Any]:
    return {
        "operator": target.operator,
        "op_kwargs": _tagged_kwargs(target.op_kwargs),
        "worker_queue": target.worker_queue,
        "pool": target.pool,
        "pool_slots": target.pool_slots,
        "priority_weight": target.priority_weight,
        "retries": target.retries,
    }


class _ResumeRun:
    """The RunTask of a resume, as its parts: the ``queued`` state, the target and the
    event (see :class:`Emit`). :meth:`full` gives the model, :meth:`encode` its wire JSON."""

    __slots__ = ("event", "state", "target")

    kind: ClassVar = "run_task"

    def __init__(self, state: _Slim, target: ResumeTarget, event: EventFields) -> None:
        self.state = state
        self.target = target
        self.event = event

    @property
    def ti_key(self) -> str:
        return self.state.ti_key

    def full(self) -> RunTask:
        return _resume_run(self.state, self.target, self.event)

    def encode(self) -> bytes:
        """The wire JSON of :meth:`full`, from a template (the same bytes)."""
        state, target, event = self.state, self.target, self.event
        if whole_minute_offset(event.emitted_at):
            try:
                return dumps_record(
                    {
                        "version": SCHEMA_VERSION,
                        "kind": "run_task",
                        "task": state.task_fields(),
                        "mode": "resume",
                        "operator": target.operator,
                        "op_kwargs": _tagged_kwargs(target.op_kwargs),
                        "next_method": state.next_method,
                        "next_kwargs": _tagged(state.next_kwargs),
                        "event": _tagged_value(event.payload),
                        "event_id": event.event_id,
                        "trigger_id": event.trigger_id,
                        "defer_seq": event.defer_seq,
                        "worker_queue": target.worker_queue,
                        "pool": target.pool,
                        "pool_slots": target.pool_slots,
                        "priority_weight": target.priority_weight,
                        "retries": target.retries,
                        "enqueued_at": event.emitted_at,
                    }
                )
            except (SchemaError, TypeError):  # as in _Slim.encode
                pass
        return encode(self.full())


_DRAFTS: Final = (_Slim, _ResumeRun)

WrittenState = TaskStateRecord | _Slim
"""A task state as :meth:`TaskTable.apply` takes it back, read back (see :attr:`Emit.written`)."""


@dataclass(slots=True)
class _View:
    record: _Slim
    at: Progress
    target: ResumeTarget | None
    holds: tuple[str, int] | None = None
    needs_repair: bool = False
    inflight: tuple[TaskStateRecord | _Slim, ...] = ()  # own writes unread (few: a tuple)
    resolved: tuple[str, ...] = ()  # trigger ids whose event is accounted for (few: a tuple)

    def resolve(self, trigger_id: str) -> None:
        if trigger_id not in self.resolved:
            self.resolved = (*self.resolved, trigger_id)


@dataclass(slots=True)
class _Pending:
    event: EventFields
    generation: int
    ref: Hashable | None


def _resume_run(queued: _Slim, target: ResumeTarget, event: EventFields) -> RunTask:
    """The RunTask that resumes ``queued`` (the state an event moved the task to)."""
    return RunTask(
        task=queued.task,
        mode="resume",
        operator=target.operator,
        op_kwargs=target.op_kwargs,
        next_method=queued.next_method,
        next_kwargs=queued.next_kwargs,
        event=event.payload,
        event_id=event.event_id,
        trigger_id=event.trigger_id,
        defer_seq=event.defer_seq,
        worker_queue=target.worker_queue,
        pool=target.pool,
        pool_slots=target.pool_slots,
        priority_weight=target.priority_weight,
        retries=target.retries,
        enqueued_at=event.emitted_at,
    )


def resumed_state(deferred: _Slim, target: ResumeTarget | None, event: EventFields) -> _Slim:
    """The state a deferred task moves to on an event of its trigger (built without pydantic:
    every value comes from records already validated).

    ``cancelled`` → ``removed``; an event with ``task_outcome`` ends the task; otherwise the
    task resumes into ``next_method`` (``fired``) or :data:`FAIL_METHOD`: ``queued`` when
    the table knows how to run it, Airflow's ``scheduled`` with ``next_method`` when not.
    """
    state: _Slim = object.__new__(_Slim)
    # The task is the deferred record's: the event matched its key and try.
    state.dag_id = deferred.dag_id
    state.task_id = deferred.task_id
    state.run_id = deferred.run_id
    state.map_index = deferred.map_index
    state.try_number = deferred.try_number
    state.trigger_id = event.trigger_id
    state.defer_seq = event.defer_seq
    state.event = event.payload
    state.event_id = event.event_id
    state.updated_at = event.emitted_at
    state.source = "scheduler"
    state.resume = target
    state.queue = deferred.queue
    state.timeout_at = deferred.timeout_at
    state.next_method = state.next_kwargs = state.reason = state.xcoms = None
    if event.status == "cancelled":
        state.state = "removed"
        state.reason = event.error or "trigger cancelled"
    elif event.status == "fired" and event.task_outcome is not None:
        state.state = event.task_outcome
        state.reason = f"ended by trigger: {event.task_outcome}"
        state.xcoms = event.xcoms
    else:
        state.state = "queued" if target is not None else "scheduled"
        if event.status == "fired":
            state.next_method = deferred.next_method or "execute_complete"
            state.next_kwargs = deferred.next_kwargs
        else:
            state.reason = (
                "Trigger/execution timeout"
                if event.status == "timed_out"
                else (f"Trigger failure: {event.error}" if event.error else "Trigger failure")
            )
            state.next_method = FAIL_METHOD
            state.next_kwargs = {
                "error": state.reason,
                "traceback": event.traceback,
                "status": event.status,
            }
    return state
