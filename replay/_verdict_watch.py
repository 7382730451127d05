"""Verdict of a standing watch (a WatchRequest on the defer topic): never a stuck deferral.

It stays until tombstoned, its trigger fires many times (each event a WatchEvent on the resume
topic, with no tombstone, no copy on tasks.events and no task state) and a run that returns or
fails is started again under a new run id. The cause says where it stands (``active``,
``no_live_triggerer``, ``ended``, ``dead_lettered``, ``no_request``).
"""

from __future__ import annotations

import orjson
from deferline.schemas import DeadLetter, WatchEvent, source_record

from ._fold import TriggerHistory, _later
from ._records import ReplayRecord, _short_run
from ._topics import TopicInfo, TopicRole
from ._verdict import Verdict, VerdictKind, _ago, _Case, _norm_queue


def _watched(case: _Case, history: TriggerHistory) -> Verdict:
    """Explain a standing watch: its request, runs and events, and whether it is active."""
    ctx = case.ctx
    where = " in the range read" if ctx.bounded else ""
    request_rec = history.watch
    request = history.watch_request
    tally = history.watch_tally
    events = history.watch_events.ordered()
    letter_rec = _dead_letter(history, request_rec)
    tomb = history.watch_tombstone
    case.add("the WatchRequest", request_rec)

    classpath = request.classpath if request is not None else _letter_classpath(letter_rec)
    if classpath is not None:
        case.facts["classpath"] = classpath
    if request is not None and request_rec is not None:
        case.facts.update(
            queue=_norm_queue(request_rec.queue) or "default",
            partition=request_rec.position.partition,
            requested_at=request.requested_at,
        )
        if request.assets:
            case.facts["assets"] = [asset.name for asset in request.assets]
    active = history.watch_active and letter_rec is None
    case.facts.update(
        active=active,
        runs=len(tally.runs),
        events=tally.events,
        fired=tally.fired,
        failed=tally.failed,
    )
    last_text = _last_event(case, events)

    cause: str
    if letter_rec is not None:
        cause, state, since = "dead_lettered", _letter_text(case, letter_rec), letter_rec.at
        case.add("tombstone: the watch was removed", tomb)
    elif request_rec is not None and active:
        cause, state = _active_text(case, request_rec, events)
        since = request.requested_at if request is not None else request_rec.at
    elif tomb is not None:
        case.add("tombstone: the watch was removed", tomb)
        cause, since = "ended", tomb.at
        state = f"ended, its WatchRequest was tombstoned {_ago(ctx.now, tomb.at)}"
        case.facts["tombstoned_at"] = tomb.at
    else:
        cause, since = "no_request", events[-1].at if events else None
        state = (
            "no WatchRequest for it in the range read"
            if ctx.bounded
            else "no WatchRequest for it is on the defer topic (removed long enough ago that "
            "its tombstone was compacted away too)"
        )
    what = f"a standing watch of {classpath}" if classpath else "a standing watch"
    assets = case.facts.get("assets")
    if assets:
        what += f" (assets: {', '.join(assets)})"
    sourced = [run for run in tally.runs if source_record(run, 1) is not None]
    runs = _plural(len(tally.runs) - len(sourced), "run")
    if sourced:
        runs += f" and {_plural(len(sourced), 'partition')} of the topic it reads"
    counts = f"{runs}, {_plural(tally.events, 'event')} read{where}"
    summary = f"{what}, not a deferral (no task waits on it): {state}; {counts}"
    if last_text:
        summary += f"; last event: {last_text}"
    return case.verdict(VerdictKind.WATCH, summary, cause=cause, since=since)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _last_event(case: _Case, events: list[ReplayRecord]) -> str:
    """Evidence and facts of the watch's first and last events read; the last, in words."""
    if not events:
        return ""
    if len(events) > 1:
        case.add("the first watch event read", events[0])
    last_rec = events[-1]
    last = last_rec.record
    assert isinstance(last, WatchEvent)
    case.add("the last watch event", last_rec)
    case.facts.update(
        last_event_id=last.event_id,
        last_event_at=last.emitted_at,
        last_status=last.status,
        last_member=last.member,
        last_run=last.run,
    )
    on = f" on {last.member}" if last.member else ""
    at = _ago(case.ctx.now, last.emitted_at)
    if last.status == "failed":
        case.facts["error"] = last.error
        if last.traceback:
            case.facts["traceback"] = last.traceback
        return f"run {_short_run(last.run)} failed {at}{on}: {last.error or 'no error text'}"
    record = source_record(last.run, last.seq)
    if record is not None:
        return f"the event of record {record[0]}@{record[1]} fired {at}{on}"
    return f"event {last.seq} of run {_short_run(last.run)} fired {at}{on}"


def _active_text(
    case: _Case, request_rec: ReplayRecord, events: list[ReplayRecord]
) -> tuple[str, str]:
    """(cause, sentence) of a watch still in the defer table; the live groups say who runs it."""
    pos = request_rec.position
    text = f"still active, its WatchRequest on {pos.topic}[{pos.partition}] is not tombstoned"
    last = events[-1].record if events else None
    if isinstance(last, WatchEvent) and last.status == "failed":
        text += " (its last run failed: the triggerer starts it again, with backoff)"
    live = case.ctx.live
    if live is None:
        return "active", text
    topic = TopicInfo(pos.topic, TopicRole.DEFER, request_rec.queue)
    groups = live.groups_for(topic)
    alive = [group for group, _ in groups if group.members]
    if not alive:
        known = ", ".join(f"{g.group_id} ({g.state})" for g, _ in groups) or "none"
        case.live_note(f"consumer groups of {topic.name}: {known}")
        return "no_live_triggerer", (
            f"{text}, but no triggerer group reading {topic.name} has live members "
            f"(groups: {known}), so no run of it goes on now"
        )
    owners = [member for group in alive for member in group.owners(pos.topic, pos.partition)]
    if not owners:
        return "active", text
    who = owners[0].client_id or owners[0].member_id
    case.facts["member"] = who
    case.live_note(f"{who} is assigned {pos.topic}[{pos.partition}] now")
    return "active", f"{text}, and {who} is assigned its partition now"


def _dead_letter(history: TriggerHistory, request_rec: ReplayRecord | None) -> ReplayRecord | None:
    """The latest dead letter of the watch written after its latest request, if any."""
    letters = history.dead_letters.ordered()
    if not letters:
        return None
    latest = letters[-1]
    return latest if request_rec is None or _later(latest, request_rec) else None


def _letter_text(case: _Case, letter_rec: ReplayRecord) -> str:
    letter = letter_rec.record
    assert isinstance(letter, DeadLetter)
    case.add(f"dead-lettered by {letter.member or 'the triggerer'}", letter_rec)
    case.facts.update(error_type=letter.error_type, error=letter.error, member=letter.member)
    return (
        f"ended, it could not be started and was dead-lettered "
        f"{_ago(case.ctx.now, letter.failed_at)} by {letter.member or 'the triggerer'} "
        f"({letter.error_type}: {letter.error}); publish its WatchRequest again once that "
        "is fixed"
    )


def _letter_classpath(letter_rec: ReplayRecord | None) -> str | None:
    """The classpath in a dead-lettered WatchRequest (its value), when it still decodes."""
    letter = letter_rec.record if letter_rec is not None else None
    if not isinstance(letter, DeadLetter) or letter.value is None:
        return None
    try:
        data = orjson.loads(letter.value)
    except orjson.JSONDecodeError:
        return None
    classpath = data.get("classpath") if isinstance(data, dict) else None
    return classpath if isinstance(classpath, str) else None
