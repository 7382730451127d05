"""How far the scheduler and the workers got: its dedup decisions replayed, applied states,
resumes, and consumer-group progress against a record."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from deferline.engine import FAIL_METHOD, TaskTable
from deferline.schemas import RunTask, TaskStateRecord, TriggerEventRecord

from ._fold import TaskHistory, TriggerHistory
from ._records import Position, ReplayRecord
from ._topics import TopicInfo, TopicRole
from ._verdict import (
    _TASKTABLE_LOGGER,
    Verdict,
    VerdictKind,
    _ago,
    _Case,
    _event,
    _resume_queued,
    _state_text,
)

__all__ = ["scheduler_decisions"]


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


def _scheduler_lag(case: _Case, history: TriggerHistory) -> tuple[str, str]:
    """Has the scheduler group read the copy of the trigger's event on tasks.events?"""
    copies = history.copies.ordered()
    if not copies and not case.ctx.events_copied:
        return "not_copied_here", (
            "events are not copied to tasks.events under this prefix "
            "(DEFERLINE_COPY_EVENTS_TO_TASKS=false): no deferline scheduler applies them"
        )
    if not copies:
        return "not_copied", "no copy of its event is on tasks.events, where the scheduler reads"
    topic = TopicInfo(copies[0].position.topic, TopicRole.TASK_EVENTS)
    return _consumer_progress(case, topic, copies[0], "scheduler")
