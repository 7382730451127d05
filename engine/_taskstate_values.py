"""The values the task table works with: where a record sits in its task's life, what
folding it did, the records it emits (among them the RunTask of a resume), its counters and
its per-task view."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from deferline.schemas import (
    CancelRequest,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
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


def progress(record: TaskStateRecord) -> Progress:
    """Where a record sits in its task's life: (try number, deferral, step).

    Within a try: ``scheduled`` < ``queued`` < ``running`` < ``deferred`` #0 < ``scheduled`` /
    ``queued`` / ``running`` after resume #0 (records naming the trigger) < ``deferred`` #1 <
    ... < the end of the try. ``removed`` is after every other end: a cleared attempt stays
    cleared.
    """
    try_number = record.task.try_number
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


@dataclass(frozen=True, slots=True)
class Emit:
    """A record the table decided to publish.

    ``queue`` is the trigger queue of a CancelRequest (its topic is ``defer.<queue>``); the
    other records name their destination themselves (``RunTask.worker_queue`` and ``mode``,
    the tasks topic for a TaskStateRecord).
    """

    record: TaskStateRecord | RunTask | CancelRequest
    queue: str | None = None


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
    targets shared (see :meth:`TaskTable._shared`). :meth:`full` gives the record back."""

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


@dataclass(slots=True)
class _View:
    record: _Slim
    at: Progress
    target: ResumeTarget | None
    holds: tuple[str, int] | None = None
    needs_repair: bool = False
    inflight: list[TaskStateRecord] = field(default_factory=list)  # own writes not read back
    resolved: tuple[str, ...] = ()  # trigger ids whose event is accounted for (few: a tuple)

    def resolve(self, trigger_id: str) -> None:
        if trigger_id not in self.resolved:
            self.resolved = (*self.resolved, trigger_id)


@dataclass(slots=True)
class _Pending:
    event: TriggerEventRecord
    generation: int
    ref: Hashable | None


def _resume_run(
    queued: TaskStateRecord | _Slim, target: ResumeTarget, event: TriggerEventRecord
) -> RunTask:
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


def resumed_state(
    deferred: _Slim, target: ResumeTarget | None, event: TriggerEventRecord
) -> TaskStateRecord:
    """The state a deferred task moves to on an event of its trigger.

    ``cancelled`` → ``removed``; an event with ``task_outcome`` ends the task; otherwise the
    task resumes into ``next_method`` (``fired``) or :data:`FAIL_METHOD`: ``queued`` when
    the table knows how to run it, Airflow's ``scheduled`` with ``next_method`` when not.
    """
    base: dict[str, Any] = {
        "task": event.task,  # equal to the deferred record's: the event matched its try
        "trigger_id": event.trigger_id,
        "defer_seq": event.defer_seq,
        "event": event.payload,
        "event_id": event.event_id,
        "updated_at": event.emitted_at,
        "source": "scheduler",
        "resume": target,
        "queue": deferred.queue,
        "timeout_at": deferred.timeout_at,
    }
    if event.status == "cancelled":
        return TaskStateRecord(state="removed", reason=event.error or "trigger cancelled", **base)
    if event.status == "fired" and event.task_outcome is not None:
        return TaskStateRecord(
            state=event.task_outcome,
            reason=f"ended by trigger: {event.task_outcome}",
            xcoms=event.xcoms,
            **base,
        )
    next_method: str
    next_kwargs: dict[str, Any] | None
    reason: str | None = None
    if event.status == "fired":
        next_method = deferred.next_method or "execute_complete"
        next_kwargs = deferred.next_kwargs
    else:
        reason = (
            "Trigger/execution timeout"
            if event.status == "timed_out"
            else (f"Trigger failure: {event.error}" if event.error else "Trigger failure")
        )
        next_method = FAIL_METHOD
        next_kwargs = {"error": reason, "traceback": event.traceback, "status": event.status}
    return TaskStateRecord(
        state="queued" if target is not None else "scheduled",
        next_method=next_method,
        next_kwargs=next_kwargs,
        reason=reason,
        **base,
    )
