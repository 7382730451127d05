"""Verdicts of deferrals with no trigger records, or dead-lettered ones."""

from __future__ import annotations

from deferline.schemas import (
    DeadLetter,
    TaskStateRecord,
)

from ._fold import TriggerHistory
from ._records import ReplayRecord
from ._topics import TopicRole, classify_topic
from ._verdict import _DEAD_LETTER_KINDS, Verdict, VerdictKind, _ago, _Case
from ._verdict_progress import _scheduler_lag


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
    tail = _application_note(case, history, events)
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


def _application_note(case: _Case, history: TriggerHistory, events: list[ReplayRecord]) -> str:
    """Whether the scheduler has turned the trigger's outcome into task state yet."""
    if not events:
        return "; no failure event was emitted, so the task stays deferred until cleared"
    if case.deferred_here:
        lag = _scheduler_lag(case, history)
        return f"; the task is still deferred: {lag[1]}"
    state = case.state
    return f"; the task is {state.state} now" if state else ""
