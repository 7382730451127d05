"""Why is it still deferred? One verdict per task or trigger, with the records that prove it.

Pure: the histories folded from the topics, an optional snapshot of the live consumer groups
and a "now" go in; a :class:`Verdict` (an enum and its evidence) comes out. The scheduler's
dedup decisions are replayed with the engine's own :class:`~deferline.engine.TaskTable`, so a
replay says "dropped as a duplicate" for exactly the events the scheduler drops.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from deferline.engine import FAIL_METHOD, TaskTable
from deferline.schemas import (
    DeadLetter,
    DecryptionError,
    DeferRequest,
    KwargsCipher,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    open_kwargs,
)

from ._errors import BadSubject
from ._fold import ReplayIndex, TaskHistory, TriggerHistory
from ._live import GroupView, LiveView
from ._records import Position, ReplayRecord, describe
from ._topics import TopicInfo, TopicRole, classify_topic

__all__ = [
    "Evidence",
    "ReplayContext",
    "Subject",
    "Verdict",
    "VerdictKind",
    "explain",
    "explain_task",
    "explain_trigger",
    "parse_subject",
    "scheduler_decisions",
]

_DIGITS = re.compile(r"^-?\d+$")
_TASKTABLE_LOGGER = "deferline.engine._taskstate"


class VerdictKind(StrEnum):
    """What a replay concludes about one deferral."""

    NOT_FOUND = "not_found"
    """No record on any topic names it (in the range read)."""
    NOT_DEFERRED = "not_deferred"
    """The task is not waiting on a trigger."""
    NEVER_REQUESTED = "never_requested"
    """The task was marked deferred but no DeferRequest was ever produced."""
    NO_LIVE_TRIGGERER = "no_live_triggerer"
    """Requested; no live triggerer reads (or is assigned) its defer partition."""
    NO_TRIGGERER_FOR_QUEUE = "no_triggerer_for_queue"
    """Requested on a trigger queue that no live triggerer serves (others are alive)."""
    RUNNING = "running"
    """Requested, owned by a live triggerer member, not fired yet."""
    WAITING = "waiting"
    """Requested, not fired; the live groups were not read, so the owner is unknown."""
    FIRED_NOT_APPLIED = "fired_not_applied"
    """Fired, but the task is not (or not yet) resumed by the scheduler."""
    TIMED_OUT = "timed_out"
    """The trigger reached its timeout."""
    TRIGGER_FAILED = "trigger_failed"
    """The trigger raised (traceback in the evidence)."""
    CLASSPATH_NOT_ALLOWED = "classpath_not_allowed"
    """Dead-lettered: the classpath is outside the allowed prefixes."""
    IMPORT_ERROR = "import_error"
    """Dead-lettered: the trigger class could not be imported."""
    UNDECRYPTABLE_KWARGS = "undecryptable_kwargs"
    """Dead-lettered: no configured key opens the sealed kwargs."""
    BAD_REQUEST = "bad_request"
    """Dead-lettered or undecodable for another reason (bad kwargs, schema, key)."""
    CANCELLED = "cancelled"
    """Cancelled (the task was cleared), or a cancel is requested and not yet acted on."""
    RESUME_NOT_PICKED_UP = "resume_not_picked_up"
    """Resumed by the scheduler; no worker has started the resumed task."""
    RESUMED = "resumed"
    """The deferral completed: the task was resumed and a worker picked it up."""
    FINISHED_WITHOUT_EVENT = "finished_without_event"
    """Tombstoned on the defer topic, but no event is on the resume topic."""


ENDINGS = frozenset(
    {
        VerdictKind.TIMED_OUT,
        VerdictKind.TRIGGER_FAILED,
        VerdictKind.CLASSPATH_NOT_ALLOWED,
        VerdictKind.IMPORT_ERROR,
        VerdictKind.UNDECRYPTABLE_KWARGS,
        VerdictKind.BAD_REQUEST,
        VerdictKind.CANCELLED,
    }
)
"""Verdicts that explain how a deferral ended (and so why a task failed or was removed)."""

_DEAD_LETTER_KINDS: Mapping[str, VerdictKind] = {
    "TriggerNotAllowed": VerdictKind.CLASSPATH_NOT_ALLOWED,
    "TriggerImportError": VerdictKind.IMPORT_ERROR,
    "ModuleNotFoundError": VerdictKind.IMPORT_ERROR,
    "ImportError": VerdictKind.IMPORT_ERROR,
    "DecryptionError": VerdictKind.UNDECRYPTABLE_KWARGS,
}


@dataclass(frozen=True, slots=True)
class Subject:
    """What a replay command is asked about: a trigger id, or a task instance."""

    text: str
    trigger_id: str | None = None
    ti_key: str | None = None
    try_number: int | None = None


def parse_subject(text: str) -> Subject:
    """``TRIGGER_ID`` or ``dag_id/task_id/run_id[/map_index][#try_number]``.

    dag and task ids cannot contain ``/``; the rest is the run id, and a last segment that is
    an integer is the map index (-1 when absent).
    """
    text = text.strip()
    if not text:
        raise BadSubject("empty task key or trigger id")
    if "/" not in text:
        return Subject(text, trigger_id=text)
    base, try_number = text, None
    head, sep, tail = text.rpartition("#")
    if sep and tail.isdigit():
        base, try_number = head, int(tail)
    parts = base.split("/")
    if len(parts) < 3 or not parts[0] or not parts[1] or not "/".join(parts[2:]):
        raise BadSubject(
            f"{text!r} is neither a trigger id nor dag_id/task_id/run_id[/map_index][#try]"
        )
    dag_id, task_id, rest = parts[0], parts[1], "/".join(parts[2:])
    run_id, map_index = rest, -1
    if len(parts) > 3 and _DIGITS.match(parts[-1]):
        run_id, map_index = "/".join(parts[2:-1]), int(parts[-1])
    return Subject(text, ti_key=f"{dag_id}/{task_id}/{run_id}/{map_index}", try_number=try_number)


@dataclass(frozen=True, slots=True)
class Evidence:
    """One fact behind a verdict: a record (with its position) or a live observation."""

    note: str
    at: dt.datetime | None = None
    position: Position | None = None
    kind: str | None = None
    detail: str | None = None

    @classmethod
    def of(cls, note: str, rec: ReplayRecord) -> Evidence:
        return cls(note, rec.at, rec.position, rec.kind, describe(rec))

    def to_json(self) -> dict[str, Any]:
        pos = self.position
        return {
            "note": self.note,
            "at": _iso(self.at),
            "topic": pos.topic if pos else None,
            "partition": pos.partition if pos else None,
            "offset": pos.offset if pos else None,
            "broker_timestamp": _iso(pos.timestamp) if pos else None,
            "kind": self.kind,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to "why": a kind, a cause within it, a sentence, and the evidence."""

    kind: VerdictKind
    subject: str
    summary: str
    cause: str | None = None
    task: TaskKey | None = None
    trigger_id: str | None = None
    state: str | None = None
    since: dt.datetime | None = None
    evidence: tuple[Evidence, ...] = ()
    facts: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "verdict": self.kind.value,
            "cause": self.cause,
            "summary": self.summary,
            "task": self.task.model_dump(mode="json") if self.task else None,
            "ti_key": self.task.ti_key if self.task else None,
            "trigger_id": self.trigger_id,
            "state": self.state,
            "since": _iso(self.since),
            "facts": {k: _jsonable(v) for k, v in self.facts.items()},
            "evidence": [e.to_json() for e in self.evidence],
        }


@dataclass(frozen=True, slots=True)
class ReplayContext:
    """What a verdict may assume besides the records.

    ``now`` is the reference time (ages, overdue timers); ``live`` is the consumer-group
    snapshot (None: not read, ownership unknown); ``cipher`` opens sealed kwargs to find a
    timer's due time; ``bounded`` says the read was limited by time or offsets, so an absent
    record may only be outside the range.
    """

    now: dt.datetime
    live: LiveView | None = None
    cipher: KwargsCipher | None = None
    bounded: bool = False


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _when(now: dt.datetime, then: dt.datetime | None) -> str:
    if then is None:
        return "an unknown time"
    return f"{then.isoformat(timespec='seconds')} ({_span((now - then).total_seconds())} ago)"


def _ago(now: dt.datetime, then: dt.datetime | None) -> str:
    return f"at {_when(now, then)}"


def _span(seconds: float) -> str:
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 120:
        return f"{sign}{s:.1f} s"
    if s < 7200:
        return f"{sign}{s / 60:.1f} min"
    if s < 172800:
        return f"{sign}{s / 3600:.1f} h"
    return f"{sign}{s / 86400:.1f} d"


def _norm_queue(queue: str | None) -> str | None:
    return None if queue in (None, "default") else queue


# -- scheduler decisions -----------------------------------------------------------------------


def scheduler_decisions(
    task: TaskHistory | None, triggers: Iterable[TriggerHistory]
) -> dict[Position, str]:
    """Replay the scheduler's fold over one task's records: what it did with each event.

    Records go through the engine's TaskTable in time order; each event position maps to
    ``applied``, ``duplicate``, ``pending`` (its deferral was never seen), ``direct`` or
    ``cancelled``. "applied" means the scheduler applies it on reading it, which says nothing
    about whether it has read it yet.
    """
    records: list[ReplayRecord] = []
    if task is not None:
        records.extend(r for r in task.states if isinstance(r.record, TaskStateRecord))
    for history in triggers:
        records.extend(r for r in history.events if isinstance(r.record, TriggerEventRecord))
    records.sort(key=ReplayRecord.sort_key)
    table = TaskTable()
    decisions: dict[Position, str] = {}
    tasklog = logging.getLogger(_TASKTABLE_LOGGER)
    quiet = tasklog.disabled
    tasklog.disabled = True  # the replayed fold's own log lines are not news
    try:
        for rec in records:
            record = rec.record
            if isinstance(record, TriggerEventRecord):
                decisions[rec.position] = table.apply(record)
            elif isinstance(record, TaskStateRecord):
                table.apply(record)
            table.drain()
    finally:
        tasklog.disabled = quiet
    return decisions


# -- explaining --------------------------------------------------------------------------------


def explain(index: ReplayIndex, subject: Subject, ctx: ReplayContext) -> Verdict:
    """The verdict for a trigger id or a task instance."""
    if subject.trigger_id is not None:
        return explain_trigger(index, subject.trigger_id, ctx)
    assert subject.ti_key is not None
    return explain_task(index, subject.ti_key, ctx, subject=subject.text)


def _resume_queued(state: TaskStateRecord) -> bool:
    """Queued (or scheduled) by the scheduler after an event, waiting for a worker."""
    return (
        state.state in ("queued", "scheduled")
        and state.trigger_id is not None
        and state.next_method is not None
    )


def explain_task(
    index: ReplayIndex, ti_key: str, ctx: ReplayContext, *, subject: str | None = None
) -> Verdict:
    """Explain a task instance through its current (or latest) deferral."""
    name = subject or ti_key
    task = index.tasks.get(ti_key)
    trigger_ids = list(task.trigger_ids) if task else []
    if not trigger_ids:
        trigger_ids = [
            tid for tid, h in index.triggers.items() if h.task and h.task.ti_key == ti_key
        ]
    state = task.state if task else None
    if task is None and not trigger_ids:
        return Verdict(
            VerdictKind.NOT_FOUND,
            name,
            f"no record names task {ti_key}" + (" in the range read" if ctx.bounded else ""),
        )
    if (
        state is not None
        and state.trigger_id
        and (state.state == "deferred" or _resume_queued(state))
    ):
        return explain_trigger(index, state.trigger_id, ctx, subject=name)
    latest_tid = _latest_trigger(index, task, trigger_ids)
    ending: Verdict | None = None
    if latest_tid is not None:
        ending = explain_trigger(index, latest_tid, ctx, subject=name)
        if state is None or (ending.kind in ENDINGS and state.state not in ("running",)):
            return ending
    if task is None or task.latest is None or state is None:
        return Verdict(
            VerdictKind.NOT_FOUND,
            name,
            f"no task state of {ti_key} on the tasks topic"
            + (" in the range read" if ctx.bounded else ""),
        )
    facts: dict[str, Any] = {"state": state.state, "try_number": state.task.try_number}
    evidence = [Evidence.of("current task state", task.latest)]
    if ending is not None:
        facts["last_deferral"] = ending.kind.value
        facts["last_trigger_id"] = ending.trigger_id
        evidence.extend(ending.evidence)
    return Verdict(
        VerdictKind.NOT_DEFERRED,
        name,
        f"not waiting on a trigger: the task is {state.state} "
        f"since {_when(ctx.now, state.updated_at)}",
        task=state.task,
        trigger_id=latest_tid,
        state=state.state,
        since=state.updated_at,
        evidence=tuple(evidence),
        facts=facts,
    )


def _latest_trigger(
    index: ReplayIndex, task: TaskHistory | None, trigger_ids: list[str]
) -> str | None:
    """The trigger of the task's most recent deferral."""
    best: tuple[tuple[float, int, float, str, int, int], str] | None = None
    if task is not None:
        for rec in task.states:
            r = rec.record
            if not isinstance(r, TaskStateRecord) or r.state != "deferred" or not r.trigger_id:
                continue
            if best is None or rec.sort_key() > best[0]:
                best = (rec.sort_key(), r.trigger_id)
    for tid in trigger_ids:
        history = index.triggers.get(tid)
        first = history.request if history else None
        if first is not None and (best is None or first.sort_key() > best[0]):
            best = (first.sort_key(), tid)
    if best is not None:
        return best[1]
    return trigger_ids[-1] if trigger_ids else None


@dataclass(slots=True)
class _Case:
    """Everything known about one trigger while its verdict is worked out."""

    name: str
    trigger_id: str
    ctx: ReplayContext
    index: ReplayIndex
    history: TriggerHistory | None
    task_key: TaskKey | None
    task: TaskHistory | None
    deferred: ReplayRecord | None  # the task's "deferred" record on this trigger
    evidence: list[Evidence] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> TaskStateRecord | None:
        return self.task.state if self.task else None

    @property
    def deferred_here(self) -> bool:
        state = self.state
        return (
            state is not None and state.state == "deferred" and state.trigger_id == self.trigger_id
        )

    def verdict(
        self,
        kind: VerdictKind,
        summary: str,
        *,
        cause: str | None = None,
        since: dt.datetime | None = None,
    ) -> Verdict:
        state = self.state
        task = self.task_key or (state.task if state else None)
        if state is not None:
            self.facts.setdefault("state", state.state)
        return Verdict(
            kind,
            self.name,
            summary,
            cause=cause,
            task=task,
            trigger_id=self.trigger_id,
            state=state.state if state else None,
            since=since,
            evidence=tuple(self.evidence),
            facts=dict(self.facts),
        )

    def add(self, note: str, rec: ReplayRecord | None) -> None:
        if rec is not None and not any(e.position == rec.position for e in self.evidence):
            self.evidence.append(Evidence.of(note, rec))

    def live_note(self, note: str) -> None:
        self.evidence.append(Evidence(note, self.ctx.live.taken_at if self.ctx.live else None))


def explain_trigger(
    index: ReplayIndex, trigger_id: str, ctx: ReplayContext, *, subject: str | None = None
) -> Verdict:
    """Explain one deferral: what happened to this trigger and where it stopped."""
    history = index.triggers.get(trigger_id)
    task_key = history.task if history else None
    task: TaskHistory | None = None
    if task_key is not None:
        task = index.tasks.get(task_key.ti_key)
    else:
        for candidate in index.tasks.values():
            if trigger_id in candidate.trigger_ids:
                task = candidate
                break
    deferred = _deferred_record(task, trigger_id)
    if task_key is None and deferred is not None:
        assert isinstance(deferred.record, TaskStateRecord)
        task_key = deferred.record.task
    case = _Case(subject or trigger_id, trigger_id, ctx, index, history, task_key, task, deferred)
    case.add("the task was marked deferred on this trigger", deferred)

    empty = history is None or not (
        history.requests
        or history.events
        or history.dead_letters
        or history.cancels
        or history.tombstones
        or history.undecodable
    )
    if empty:
        return _without_trigger_records(case)
    assert history is not None
    case.add("the DeferRequest", history.request)
    if history.request is not None and history.request.redriven:
        case.facts["redriven"] = True

    events = history.ordered_events()
    fired = [e for e in events if _event(e).status == "fired"]
    if history.dead_letters and not fired:
        return _dead_lettered(case, history, events)
    if history.undecodable and not events:
        bad = history.undecodable.ordered()[-1]
        case.add("a record under this trigger id does not decode", bad)
        return case.verdict(
            VerdictKind.BAD_REQUEST,
            f"a record under this trigger id does not decode: {bad.error}",
            cause="undecodable",
        )
    if events:
        return _with_events(case, history, events)
    return _without_events(case, history)


def _event(rec: ReplayRecord) -> TriggerEventRecord:
    assert isinstance(rec.record, TriggerEventRecord)
    return rec.record


def _deferred_record(task: TaskHistory | None, trigger_id: str) -> ReplayRecord | None:
    found: ReplayRecord | None = None
    for rec in task.states if task else ():
        r = rec.record
        if not isinstance(r, TaskStateRecord) or r.state != "deferred":
            continue
        if r.trigger_id == trigger_id and (found is None or rec.sort_key() > found.sort_key()):
            found = rec
    return found


def _without_trigger_records(case: _Case) -> Verdict:
    where = " in the range read" if case.ctx.bounded else ""
    if case.deferred is None:
        return case.verdict(
            VerdictKind.NOT_FOUND, f"no record names trigger {case.trigger_id}{where}"
        )
    assert isinstance(case.deferred.record, TaskStateRecord)
    deferred = case.deferred.record
    if case.deferred_here:
        case.facts["queue"] = deferred.queue
        return case.verdict(
            VerdictKind.NEVER_REQUESTED,
            f"the worker marked the task deferred {_ago(case.ctx.now, deferred.updated_at)}, "
            f"but no DeferRequest for trigger {case.trigger_id} is on the defer topic"
            f"{' of queue ' + deferred.queue if deferred.queue else ''}{where}: the worker stopped "
            "between its two writes (or produced to another cluster or prefix); "
            "clear the task to run it again",
            since=deferred.updated_at,
        )
    state = case.state
    case.add("current task state", case.task.latest if case.task else None)
    return case.verdict(
        VerdictKind.NOT_DEFERRED,
        f"the task was deferred on this trigger without a DeferRequest{where}, "
        f"and has moved on: it is {state.state if state else 'unknown'} now",
    )


def _dead_lettered(case: _Case, history: TriggerHistory, events: list[ReplayRecord]) -> Verdict:
    letter_rec = history.dead_letters.ordered()[-1]
    letter = letter_rec.record
    assert isinstance(letter, DeadLetter)
    case.add(f"dead-lettered by {letter.member or 'the triggerer'}", letter_rec)
    for ev in events:
        case.add("failure event telling the task why", ev)
    kind = _DEAD_LETTER_KINDS.get(letter.error_type, VerdictKind.BAD_REQUEST)
    case.facts.update(error_type=letter.error_type, error=letter.error, member=letter.member)
    request = history.defer_request
    if request is not None:
        case.facts["classpath"] = request.classpath
    what = {
        VerdictKind.CLASSPATH_NOT_ALLOWED: "its classpath is not under an allowed prefix",
        VerdictKind.IMPORT_ERROR: "its trigger class could not be imported",
        VerdictKind.UNDECRYPTABLE_KWARGS: "no configured key opens its sealed kwargs",
    }.get(kind, "the request is bad")
    tail = _application_note(case, events)
    case.facts["dead_letter_of"] = f"{letter.topic}[{letter.partition}]@{letter.offset}"
    origin = classify_topic(letter.topic, prefix=case.index.prefix)
    if origin is not None and origin.role is not TopicRole.DEFER:
        summary = (
            f"a record of it on {letter.topic} could not be applied and was dead-lettered "
            f"{_ago(case.ctx.now, letter.failed_at)} ({letter.error_type}: {letter.error}){tail}"
        )
    else:
        summary = (
            f"never started: {what} ({letter.error_type}: {letter.error}); dead-lettered "
            f"{_ago(case.ctx.now, letter.failed_at)}{tail}"
        )
    return case.verdict(kind, summary, cause=letter.error_type, since=letter.failed_at)


def _application_note(case: _Case, events: list[ReplayRecord]) -> str:
    """Whether the scheduler has turned the trigger's outcome into task state yet."""
    if not events:
        return "; no failure event was emitted, so the task stays deferred until cleared"
    if case.deferred_here:
        lag = _scheduler_lag(case, events[0])
        return f"; the task is still deferred: {lag[1]}"
    state = case.state
    return f"; the task is {state.state} now" if state else ""


def _with_events(case: _Case, history: TriggerHistory, events: list[ReplayRecord]) -> Verdict:
    first_rec = events[0]
    first = _event(first_rec)
    decisions = scheduler_decisions(case.task, [history])
    applied = _applied_state(case, history)
    case.add(f"event: {first.status} on {first.member or 'an unknown member'}", first_rec)
    for extra in events[1:]:
        decision = decisions.get(extra.position, "unknown")
        note = (
            "another event (dropped as a duplicate)"
            if decision == "duplicate"
            else (f"another event (scheduler: {decision})")
        )
        case.add(note, extra)
    case.facts.update(
        status=first.status,
        event_id=first.event_id,
        member=first.member,
        fired_at=first.emitted_at,
        events=len(events),
    )
    if first.due_at is not None:
        case.facts["fire_lag_s"] = (first.emitted_at - first.due_at).total_seconds()
    dups = sum(1 for e in events[1:] if decisions.get(e.position) == "duplicate")
    if dups:
        case.facts["duplicates_dropped"] = dups
    if applied is not None:
        case.add("the scheduler applied the event", applied)
    status = first.status
    at = _ago(case.ctx.now, first.emitted_at)
    if status == "cancelled":
        cancels = history.cancels.ordered()
        if cancels:
            case.add("cancel requested", cancels[-1])
        return case.verdict(
            VerdictKind.CANCELLED,
            f"cancelled {at} ({first.error or 'cancelled'}) by {first.member or 'the triggerer'}"
            + _application_note(case, events),
            since=first.emitted_at,
        )
    if status == "timed_out":
        request = history.defer_request
        deadline = request.timeout_at if request else first.due_at
        if deadline is not None:
            case.facts["timeout_at"] = deadline
        return case.verdict(
            VerdictKind.TIMED_OUT,
            f"timed out {at}"
            + (f" (timeout_at {deadline.isoformat(timespec='seconds')})" if deadline else "")
            + _application_note(case, events),
            since=first.emitted_at,
        )
    if status == "failed":
        if first.traceback:
            case.facts["traceback"] = first.traceback
        case.facts["error"] = first.error
        return case.verdict(
            VerdictKind.TRIGGER_FAILED,
            f"the trigger failed {at}: {first.error or 'no error text'}"
            + _application_note(case, events),
            since=first.emitted_at,
        )
    # fired
    if case.deferred_here:
        lag_cause, text = _scheduler_lag(case, first_rec)
        return case.verdict(
            VerdictKind.FIRED_NOT_APPLIED,
            f"fired {at} on {first.member or 'an unknown member'}, but the task is still "
            f"deferred on it: {text}",
            cause=lag_cause,
            since=first.emitted_at,
        )
    state = case.state
    if applied is None:
        if first.resumed_directly:
            return _resume_check(case, history, first_rec, state)
        now_text = _state_text(state)
        first_decision = decisions.get(first_rec.position)
        cause = "stale"
        if first_decision == "pending":
            cause = "no_deferral"
            now_text = "the task was never seen deferred on it"
        return case.verdict(
            VerdictKind.FIRED_NOT_APPLIED,
            f"fired {at}, but the task is no longer deferred on this trigger ({now_text}): "
            "the scheduler drops such an event as stale",
            cause=cause,
            since=first.emitted_at,
        )
    return _resume_check(case, history, first_rec, state)


def _state_text(state: TaskStateRecord | None) -> str:
    if state is None:
        return "its state is unknown"
    text = f"it is {state.state}, try {state.task.try_number}"
    if state.trigger_id:
        text += f", on trigger {state.trigger_id}"
    return text


def _applied_state(case: _Case, history: TriggerHistory) -> ReplayRecord | None:
    """The task state the scheduler wrote when it applied one of this trigger's events."""
    ids = {_event(e).event_id for e in history.events}
    found: ReplayRecord | None = None
    for rec in case.task.states if case.task else ():
        r = rec.record
        if (
            isinstance(r, TaskStateRecord)
            and r.source == "scheduler"
            and r.trigger_id == case.trigger_id
            and r.event_id in ids
            and r.state != "deferred"
            and (found is None or rec.sort_key() < found.sort_key())
        ):
            found = rec
    return found


def _resume_check(
    case: _Case,
    history: TriggerHistory,
    event_rec: ReplayRecord,
    state: TaskStateRecord | None,
) -> Verdict:
    event = _event(event_rec)
    at = _ago(case.ctx.now, event.emitted_at)
    waiting = state is not None and _resume_queued(state) and state.trigger_id == case.trigger_id
    if not waiting:
        latest = case.task.latest if case.task else None
        case.add("current task state", latest)
        how = (
            f"ended the task itself ({event.task_outcome})"
            if event.task_outcome
            else "the task was resumed"
        )
        return case.verdict(
            VerdictKind.RESUMED,
            f"fired {at} and {how}; {_state_text(state)} now",
            since=event.emitted_at,
        )
    assert state is not None
    if state.next_method == FAIL_METHOD:
        case.facts["resumed_into"] = FAIL_METHOD
    runs = [
        r
        for r in (*history.runs, *(case.task.runs if case.task else ()))
        if isinstance(r.record, RunTask)
        and r.record.mode == "resume"
        and (r.record.trigger_id == case.trigger_id or r.record.event_id == event.event_id)
    ]
    since = state.updated_at
    if not runs:
        case.facts["worker_queue"] = state.resume.worker_queue if state.resume else None
        return case.verdict(
            VerdictKind.RESUME_NOT_PICKED_UP,
            f"resumed by the scheduler {_ago(case.ctx.now, since)}, but no RunTask(resume) for it "
            "is on a worker queue's resumes topic",
            cause="not_enqueued",
            since=since,
        )
    run_rec = max(runs, key=ReplayRecord.sort_key)
    run = run_rec.record
    assert isinstance(run, RunTask)
    case.add("the resume was queued for a worker", run_rec)
    case.facts["worker_queue"] = run.worker_queue
    topic = TopicInfo(run_rec.position.topic, TopicRole.RESUMES, run_rec.queue)
    cause, text = _consumer_progress(case, topic, run_rec, "worker")
    summary = (
        f"resumed by the scheduler {_ago(case.ctx.now, since)} onto worker queue "
        f"{run.worker_queue!r}, but no worker has started it: {text}"
    )
    return case.verdict(VerdictKind.RESUME_NOT_PICKED_UP, summary, cause=cause, since=since)


def _consumer_progress(
    case: _Case, topic: TopicInfo, rec: ReplayRecord, who: str
) -> tuple[str, str]:
    """Has a live consumer group of ``topic`` read past ``rec``? (cause, sentence)."""
    live = case.ctx.live
    pos = rec.position
    if live is None:
        return "unknown", (
            f"whether the {who} has read it is unknown (live consumer groups not read)"
        )
    groups = live.groups_for(topic)
    alive = [(g, how) for g, how in groups if g.members]
    if not alive:
        known = ", ".join(f"{g.group_id} ({g.state}, no members)" for g, _ in groups) or "none"
        case.live_note(f"consumer groups of {topic.name}: {known}")
        return f"no_{who}", f"no live {who} reads {topic.name} (groups: {known})"
    end = live.end_offset(pos.topic, pos.partition)
    texts: list[str] = []
    for group, how in alive:
        committed = live.committed(group, pos.topic, pos.partition)
        members = ", ".join(m.client_id or m.member_id for m in group.members)
        case.live_note(
            f"group {group.group_id} ({how}): {len(group.members)} live member(s) [{members}], "
            f"committed offset on {pos.topic}[{pos.partition}] = {committed}"
        )
        if committed is not None and committed > pos.offset:
            case.facts[f"{who}_committed"] = committed
            return (
                "consumed_not_applied" if who == "scheduler" else "picked_up_not_started",
                f"{who} group {group.group_id} has read past it (committed offset {committed} > "
                f"{pos.offset}) without acting on it; look for event_id / task in its logs",
            )
        lag = (end - committed) if end is not None and committed is not None else None
        if lag is None and end is not None:
            lag = end - pos.offset
        case.facts[f"{who}_lag_records"] = lag
        texts.append(
            f"{who} group {group.group_id} has not read it yet "
            f"(committed {committed if committed is not None else 'nothing'}, record at "
            f"{pos.offset}, {lag if lag is not None else '?'} records behind)"
        )
    lag_cause = "scheduler_lag" if who == "scheduler" else "queue_lag"
    return lag_cause, "; ".join(texts)


def _scheduler_lag(case: _Case, event_rec: ReplayRecord) -> tuple[str, str]:
    topic = TopicInfo(event_rec.position.topic, TopicRole.RESUME, event_rec.queue)
    return _consumer_progress(case, topic, event_rec, "scheduler")


def _without_events(case: _Case, history: TriggerHistory) -> Verdict:
    ctx = case.ctx
    where = " in the range read" if ctx.bounded else ""
    cancels = history.cancels.ordered()
    if cancels:
        cancel = cancels[-1]
        case.add("cancel requested", cancel)
        if history.alive or case.deferred_here:
            owner = _owner_text(case, history)
            return case.verdict(
                VerdictKind.CANCELLED,
                f"a cancel was requested {_ago(ctx.now, cancel.at)}, and no 'cancelled' event "
                f"followed yet{where}; {owner}",
                cause="cancel_pending",
                since=cancel.at,
            )
    request_rec = history.request
    if request_rec is None:
        tomb = history.tombstone
        case.add("tombstone", tomb)
        if tomb is not None:
            return case.verdict(
                VerdictKind.FINISHED_WITHOUT_EVENT,
                f"only a tombstone is left for this trigger{where} and no event is on the "
                "resume topic (its DeferRequest was compacted away)",
                since=tomb.at,
            )
        return case.verdict(
            VerdictKind.NEVER_REQUESTED if case.deferred_here else VerdictKind.NOT_FOUND,
            f"no DeferRequest for this trigger{where}",
        )
    if not history.alive:
        tomb = history.tombstone
        case.add("tombstoned without an event", tomb)
        return case.verdict(
            VerdictKind.FINISHED_WITHOUT_EVENT,
            f"the triggerer tombstoned it {_ago(ctx.now, tomb.at if tomb else None)} but no "
            f"event is on the resume topic{where}: the event was lost or written elsewhere",
            since=tomb.at if tomb else None,
        )
    return _requested(case, history, request_rec)


def _timer_due(request: DeferRequest, cipher: KwargsCipher | None) -> dt.datetime | None:
    """When a timer trigger is due, from its ``moment`` (or ``delta`` after the request)."""
    try:
        kwargs = open_kwargs(request, cipher)
    except DecryptionError:
        return None
    moment = kwargs.get("moment")
    if isinstance(moment, str):  # plain JSON from a non-Python producer
        try:
            moment = dt.datetime.fromisoformat(moment)
        except ValueError:
            return None
    if isinstance(moment, dt.datetime) and moment.tzinfo is not None:
        return moment
    delta = kwargs.get("delta")
    if isinstance(delta, dt.timedelta):
        return request.requested_at + delta
    return None


def _requested(case: _Case, history: TriggerHistory, request_rec: ReplayRecord) -> Verdict:
    ctx = case.ctx
    request = request_rec.record
    assert isinstance(request, DeferRequest)
    pos = request_rec.position
    topic = TopicInfo(pos.topic, TopicRole.DEFER, request_rec.queue)
    queue = _norm_queue(request_rec.queue)
    case.facts.update(
        classpath=request.classpath,
        queue=queue or "default",
        partition=pos.partition,
        requested_at=request.requested_at,
    )
    timing = ""
    due = _timer_due(request, ctx.cipher)
    if due is not None:
        case.facts["due_at"] = due
        late = (ctx.now - due).total_seconds()
        if late > 0:
            case.facts["overdue_s"] = late
            timing = f"; timer was due {_ago(ctx.now, due)}: fire lag {_span(late)} so far"
        else:
            timing = f"; timer due at {due.isoformat(timespec='seconds')} (in {_span(-late)})"
    if request.timeout_at is not None:
        case.facts["timeout_at"] = request.timeout_at
        if request.timeout_at < ctx.now:
            timing += (
                f"; its timeout passed {_ago(ctx.now, request.timeout_at)} without a "
                "timed_out event"
            )
    since = request.requested_at
    seen = case.index.owners.owner_at(queue, pos.partition, ctx.now)
    if seen is not None:
        case.facts["last_seen_member"] = seen.member
        case.facts["last_seen_at"] = seen.last_seen
    live = ctx.live
    if live is None:
        hint = (
            f"; the last member seen emitting on that partition was {seen.member} "
            f"at {_when(ctx.now, seen.last_seen)}"
            if seen
            else ""
        )
        return case.verdict(
            VerdictKind.WAITING,
            f"requested {_ago(ctx.now, since)} on {pos.topic}[{pos.partition}] and not fired; "
            f"live consumer groups not read, owner unknown{hint}{timing}",
            since=since,
        )
    groups = [(g, how) for g, how in live.groups_for(topic)]
    alive = [(g, how) for g, how in groups if g.members]
    if not alive:
        elsewhere = [g for g in live.groups_for_role(TopicRole.DEFER) if g.members]
        known = ", ".join(f"{g.group_id} ({g.state})" for g, _ in groups) or "none"
        case.live_note(f"consumer groups of {topic.name}: {known}")
        if elsewhere:
            others = ", ".join(g.group_id for g in elsewhere)
            case.live_note(f"live triggerer groups on other queues: {others}")
            return case.verdict(
                VerdictKind.NO_TRIGGERER_FOR_QUEUE,
                f"requested {_ago(ctx.now, since)} on trigger queue {queue or 'default'!r} "
                f"({topic.name}), but no live triggerer serves that queue (live triggerers: "
                f"{others}); start one with --queues {queue or 'default'}",
                since=since,
            )
        return case.verdict(
            VerdictKind.NO_LIVE_TRIGGERER,
            f"requested {_ago(ctx.now, since)} on {topic.name}[{pos.partition}], but no "
            f"triggerer group has live members (groups of this topic: {known})",
            since=since,
        )
    owners = [(g, m) for g, _ in alive for m in g.owners(pos.topic, pos.partition)]
    known_assign = any(g.assignments_known for g, _ in alive)
    for group, how in alive:
        members = ", ".join(m.client_id or m.member_id for m in group.members)
        committed = live.committed(group, pos.topic, pos.partition)
        case.live_note(
            f"group {group.group_id} ({how}, {group.state}): {len(group.members)} live "
            f"member(s) [{members}]; committed offset on {pos.topic}[{pos.partition}] = {committed}"
        )
        if committed is not None and committed <= pos.offset:
            case.facts["triggerer_lag_records"] = (
                live.end_offset(pos.topic, pos.partition) or committed
            ) - committed
    if known_assign and not owners:
        return case.verdict(
            VerdictKind.NO_LIVE_TRIGGERER,
            f"requested {_ago(ctx.now, since)}; the triggerer group has live members but none "
            f"is assigned {pos.topic}[{pos.partition}] (a rebalance in progress, or more "
            "members than partitions stuck in a failed assignment)",
            cause="unassigned",
            since=since,
        )
    if owners:
        group, member = owners[0]
        who = member.client_id or member.member_id
        case.facts.update(member=who, member_id=member.member_id, group=group.group_id)
    else:
        group = alive[0][0]
        who = seen.member if seen is not None else f"a member of {group.group_id}"
        case.facts.update(group=group.group_id, assignment_reported=False)
    if seen is not None and seen.member == who and seen.first_seen > since:
        since = seen.first_seen
    lag = case.facts.get("triggerer_lag_records")
    backlog = (
        f"; not read by the group yet ({lag} records behind on that partition)"
        if lag is not None
        else ""
    )
    if owners:
        assignment = ""
    elif seen is not None:
        assignment = " (last member seen on that partition; the broker does not report assignments)"
    else:
        assignment = " (the broker does not report assignments)"
    return case.verdict(
        VerdictKind.RUNNING,
        f"assigned to {who}{assignment} on {pos.topic}[{pos.partition}] and running since "
        f"{_when(ctx.now, since)}, not fired yet{timing}{backlog}",
        since=since,
    )


def _owner_text(case: _Case, history: TriggerHistory) -> str:
    request = history.request
    live = case.ctx.live
    if request is None or live is None:
        return "the triggerer owning it has not acted on it"
    topic = TopicInfo(request.position.topic, TopicRole.DEFER, request.queue)
    alive: list[GroupView] = [g for g, _ in live.groups_for(topic) if g.members]
    if not alive:
        return f"no live triggerer reads {topic.name}"
    return f"live triggerer group(s): {', '.join(g.group_id for g in alive)}"
