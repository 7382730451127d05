"""Verdicts of a trigger that emitted events: fired, applied, resumed, or waiting on a consumer."""

from __future__ import annotations

from deferline.schemas import DeadLetter

from ._fold import TriggerHistory
from ._records import ReplayRecord
from ._topics import TopicRole, classify_topic
from ._verdict import Verdict, VerdictKind, _ago, _Case, _event, _state_text
from ._verdict_ended import _application_note
from ._verdict_progress import _applied_state, _resume_check, _scheduler_lag, scheduler_decisions


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
    placed = _dead_lettered_event(case, history)
    if placed is not None and applied is None:
        return placed
    copies = history.copies.ordered()
    if copies:
        case.add("the event reached the task's partition (tasks.events)", copies[0])
    elif case.deferred_here and applied is None and case.ctx.events_copied:
        return _not_copied(case, history, first_rec)
    if status == "cancelled":
        cancels = history.cancels.ordered()
        if cancels:
            case.add("cancel requested", cancels[-1])
        return case.verdict(
            VerdictKind.CANCELLED,
            f"cancelled {at} ({first.error or 'cancelled'}) by {first.member or 'the triggerer'}"
            + _application_note(case, history, events),
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
            + _application_note(case, history, events),
            since=first.emitted_at,
        )
    if status == "failed":
        if first.traceback:
            case.facts["traceback"] = first.traceback
        case.facts["error"] = first.error
        return case.verdict(
            VerdictKind.TRIGGER_FAILED,
            f"the trigger failed {at}: {first.error or 'no error text'}"
            + _application_note(case, history, events),
            since=first.emitted_at,
        )
    # fired
    if case.deferred_here:
        lag_cause, text = _scheduler_lag(case, history)
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


def _not_copied(case: _Case, history: TriggerHistory, event_rec: ReplayRecord) -> Verdict:
    """The event is on the resume topic, the task still deferred on it, and no copy of it is
    on tasks.events: the scheduler owning the task never sees it."""
    event = _event(event_rec)
    at = _ago(case.ctx.now, event.emitted_at)
    if history.alive:
        advice = (
            "the trigger is still in the defer table, so its triggerer retries the copy (look "
            "for 'produce failed' on tasks.events in its log: a missing topic or ACL), and "
            "the next owner of its partition writes it again before the tombstone"
        )
    else:
        advice = (
            "the trigger is tombstoned, so no triggerer will copy it (written by a triggerer "
            "from before tasks.events, or the copy is past retention): re-drive the trigger "
            "with `deferline replay redrive --force` to run it again"
        )
    return case.verdict(
        VerdictKind.EVENT_NOT_COPIED,
        f"{event.status} {at} on {event.member or 'an unknown member'}, but no copy of the "
        f"event is on tasks.events, where the task's scheduler reads; {advice}",
        cause="alive" if history.alive else "tombstoned",
        since=event.emitted_at,
    )


def _dead_lettered_event(case: _Case, history: TriggerHistory) -> Verdict | None:
    """The scheduler could not place an event of this trigger and dead-lettered it: no
    deferral on the tasks topic matched it once it had read that topic to its end."""
    letters = [
        rec
        for rec in history.dead_letters.ordered()
        if isinstance(rec.record, DeadLetter)
        and (origin := classify_topic(rec.record.topic, prefix=case.index.prefix)) is not None
        and origin.role in (TopicRole.RESUME, TopicRole.TASK_EVENTS)
    ]
    if not letters:
        return None
    letter = letters[-1].record
    assert isinstance(letter, DeadLetter)
    case.add(f"dead-lettered by {letter.member or 'the scheduler'}", letters[-1])
    case.facts.update(
        error_type=letter.error_type,
        error=letter.error,
        dead_letter_of=f"{letter.topic}[{letter.partition}]@{letter.offset}",
    )
    if case.deferred_here:
        advice = (
            "the task is deferred on it now (its deferral was written or read after the "
            "event): re-drive the trigger with --force to run it again"
        )
    else:
        advice = _state_text(case.state)
    return case.verdict(
        VerdictKind.FIRED_NOT_APPLIED,
        f"its event could not be placed by the scheduler and was dead-lettered "
        f"{_ago(case.ctx.now, letter.failed_at)} ({letter.error_type}: {letter.error}); " + advice,
        cause="dead_lettered",
        since=letter.failed_at,
    )
