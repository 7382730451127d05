"""Verdicts of a trigger with no event yet: cancelled, requested, waiting for its moment or
for an owner."""

from __future__ import annotations

import datetime as dt

from deferline.schemas import (
    DecryptionError,
    DeferRequest,
    KwargsCipher,
    open_kwargs,
)

from ._fold import TriggerHistory
from ._live import GroupView
from ._records import ReplayRecord
from ._topics import TopicInfo, TopicRole
from ._verdict import Verdict, VerdictKind, _ago, _Case, _norm_queue, _span, _when


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
