"""Why is it still deferred? One verdict per task or trigger, with the records that prove it.

Pure: the histories folded from the topics, an optional snapshot of the live consumer groups
and a "now" go in; a :class:`Verdict` (an enum and its evidence) comes out. The scheduler's
dedup decisions are replayed with the engine's own :class:`~deferline.engine.TaskTable`, so a
replay says "dropped as a duplicate" for exactly the events the scheduler drops.

A trigger id may name a standing watch instead: its verdict is always ``watch``
(:mod:`._verdict_watch`), never a stuck deferral.
"""

from __future__ import annotations

from typing import Any

from deferline.schemas import (
    TaskStateRecord,
)

from ._fold import ReplayIndex, TaskHistory
from ._records import ReplayRecord
from ._verdict import (
    ENDINGS,
    Evidence,
    ReplayContext,
    Subject,
    Verdict,
    VerdictKind,
    _Case,
    _event,
    _resume_queued,
    _when,
)
from ._verdict_ended import _dead_lettered, _without_trigger_records
from ._verdict_fired import _with_events
from ._verdict_waiting import _without_events
from ._verdict_watch import _watched

__all__ = ["explain", "explain_task", "explain_trigger"]


# -- explaining --------------------------------------------------------------------------------


def explain(index: ReplayIndex, subject: Subject, ctx: ReplayContext) -> Verdict:
    """The verdict for a trigger id or a task instance."""
    if subject.trigger_id is not None:
        return explain_trigger(index, subject.trigger_id, ctx)
    assert subject.ti_key is not None
    return explain_task(index, subject.ti_key, ctx, subject=subject.text)


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
    if history is not None and history.is_watch:
        return _watched(case, history)  # a standing watch: no task, never stuck

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


def _deferred_record(task: TaskHistory | None, trigger_id: str) -> ReplayRecord | None:
    found: ReplayRecord | None = None
    for rec in task.states if task else ():
        r = rec.record
        if not isinstance(r, TaskStateRecord) or r.state != "deferred":
            continue
        if r.trigger_id == trigger_id and (found is None or rec.sort_key() > found.sort_key()):
            found = rec
    return found
