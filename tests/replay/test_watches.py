"""Standing watches on replay: their records decode and read well, and a watch is explained as
a watch (its runs, events and whether it is active), never as a stuck or orphaned deferral."""

from __future__ import annotations

import datetime as dt

from deferline.replay import (
    GroupHints,
    GroupView,
    LiveView,
    MemberView,
    ReplayContext,
    ReplayIndex,
    ReportItem,
    StuckScan,
    TopicRole,
    Verdict,
    VerdictKind,
    build_timeline,
    describe,
    explain,
    parse_subject,
    plan_redrive,
    render_html,
)
from deferline.replay.testing import KEEP, render_verdict
from deferline.schemas import DeadLetter, WatchEvent, WatchRequest, encode
from deferline.topics import partition_for
from rich.console import Console

from ._history import WATCHER, History, at, task_key

NOW = at(3600)
WATCH_ID = "airflow-7-1893553445678901"
RUN_A = "3f2a9c1d0b7e4a65"
RUN_B = "77c0de5a91b24f08"


def fold(h: History) -> ReplayIndex:
    index = ReplayIndex(prefix=h.prefix)
    for rec in h.records():
        index.add(rec)
    return index


def why(h: History, subject: str, live: LiveView | None = None) -> Verdict:
    return explain(fold(h), parse_subject(subject), ReplayContext(now=NOW, live=live))


def two_runs(h: History) -> WatchRequest:
    """A watch whose first run fired twice then failed, and whose second run fired twice."""
    request = h.watch(WATCH_ID, 10, assets=("inbox", "outbox"))
    h.watch_event(request, 20, run=RUN_A, seq=1)
    h.watch_event(request, 30, run=RUN_A, seq=2)
    h.watch_event(
        request, 40, run=RUN_A, seq=3, status="failed", error="OSError: gone", traceback="tb"
    )
    h.watch_event(request, 50, run=RUN_B, seq=1, member="triggerer-b")
    h.watch_event(request, 60, run=RUN_B, seq=2, member="triggerer-b")
    return request


def live(h: History, *groups: GroupView) -> LiveView:
    ends: dict[tuple[str, int], int] = {}
    for write in h.writes:
        ends[(write.topic, write.partition)] = ends.get((write.topic, write.partition), 0) + 1
    return LiveView(
        taken_at=NOW, groups=groups, end_offsets=ends, hints=GroupHints.for_prefix(h.prefix)
    )


# -- the records -------------------------------------------------------------------------------


def test_watch_records_decode_and_describe_themselves():
    h = History()
    request = h.watch(WATCH_ID, 10, assets=("a", "b"), queue="slow-io")
    h.watch_event(request, 20, run=RUN_A, seq=3, member="m1")
    h.watch_event(request, 30, run=RUN_A, seq=4, status="failed", error="boom\nValueError: x")
    h.unwatch(request, 40)
    asked, fired, failed, tombstone = h.records()
    p = partition_for(WATCH_ID.encode(), h.partitions)

    assert isinstance(asked.record, WatchRequest)
    assert (asked.kind, asked.trigger_id, asked.task, asked.at) == (
        "watch_request",
        WATCH_ID,
        None,
        at(10),
    )
    assert describe(asked) == f"watch requested: {WATCHER} (assets: a, b) queue=slow-io"

    assert isinstance(fired.record, WatchEvent)
    assert (fired.kind, fired.trigger_id, fired.task, fired.at) == (
        "watch_event",
        WATCH_ID,
        None,
        at(20),
    )
    assert describe(fired) == f"watch event 3 of run 3f2a9c1d… fired (member m1, partition {p})"
    assert describe(failed) == (
        f"watch run 3f2a9c1d… failed: ValueError: x (event 4, member triggerer-a, partition {p})"
    )
    assert tombstone.tombstone
    assert tombstone.trigger_id == WATCH_ID
    assert tombstone.at == at(40)
    # Time order puts a request before an event of the same instant, as for deferrals.
    assert asked.sort_key() < fired.sort_key() < failed.sort_key()


def test_the_fold_counts_runs_and_events_past_what_it_keeps():
    h = History()
    request = h.watch(WATCH_ID, 0)
    for n in range(1, KEEP + 51):
        h.watch_event(request, n, run=RUN_A, seq=n)
    h.watch_event(request, KEEP + 60, run=RUN_B, seq=1, status="failed", error="boom")
    history = fold(h).triggers[WATCH_ID]
    assert history.is_watch
    assert history.watch_active
    assert history.watch_request == request
    assert history.task is None
    assert history.request is None  # no DeferRequest: not a deferral
    assert len(history.watch_events) == KEEP
    assert history.watch_tally.runs == {RUN_A: KEEP + 50, RUN_B: 1}
    assert (history.watch_tally.fired, history.watch_tally.failed) == (KEEP + 50, 1)
    assert history.watch_tally.events == KEEP + 51


# -- explained as a watch ----------------------------------------------------------------------


def test_a_watch_over_two_runs_is_a_standing_watch_not_a_stuck_deferral():
    h = History()
    two_runs(h)
    verdict = why(h, WATCH_ID)
    assert verdict.kind is VerdictKind.WATCH
    assert verdict.cause == "active"
    assert verdict.task is None
    assert verdict.trigger_id == WATCH_ID
    assert verdict.since == at(10)
    facts = verdict.facts
    assert facts["active"] is True
    assert (facts["runs"], facts["events"], facts["fired"], facts["failed"]) == (2, 5, 4, 1)
    assert facts["classpath"] == WATCHER
    assert facts["assets"] == ["inbox", "outbox"]
    assert facts["last_event_at"] == at(60)
    assert facts["last_member"] == "triggerer-b"
    assert facts["last_run"] == RUN_B
    assert facts["last_event_id"] == f"{WATCH_ID}:{RUN_B}:2"
    summary = verdict.summary
    assert summary.startswith(f"a standing watch of {WATCHER} (assets: inbox, outbox)")
    assert "not a deferral" in summary
    assert "still active" in summary
    assert "2 runs, 5 events read" in summary
    assert "last event: event 2 of run 77c0de5a… fired at" in summary
    assert "on triggerer-b" in summary
    assert [e.kind for e in verdict.evidence] == ["watch_request", "watch_event", "watch_event"]
    assert [e.at for e in verdict.evidence] == [at(10), at(20), at(60)]


def test_a_watch_is_never_a_stuck_task_and_its_events_tell_who_owns_the_partition():
    h = History()
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    deferral = h.defer(task, 2)
    p = partition_for(deferral.trigger_id.encode(), h.partitions)
    watch_id = next(
        tid
        for tid in (f"watch-{n}" for n in range(100))
        if partition_for(tid.encode(), h.partitions) == p
    )
    request = h.watch(watch_id, 10)
    h.watch_event(request, 20, run=RUN_A, seq=1, member="triggerer-b")
    # The stuck scan lists tasks waiting on a trigger: the watch, with no task, is not one.
    scan = StuckScan()
    for raw in h.raw_records():
        if raw.topic.role is TopicRole.TASKS:
            scan.feed(raw)
    waiting = scan.waiting(now=NOW, older_than=dt.timedelta(0))
    assert [w.trigger_id for w in waiting] == [deferral.trigger_id]
    # The deferral's verdict is its own; the watch's event says who owned their partition.
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.WAITING
    assert verdict.trigger_id == deferral.trigger_id
    assert verdict.facts["last_seen_member"] == "triggerer-b"
    assert [e.kind for e in verdict.evidence] == ["task_state", "defer_request"]
    assert why(h, watch_id).kind is VerdictKind.WATCH


def test_a_watchs_timeline_has_no_scheduler_decisions_and_renders():
    h = History()
    request = two_runs(h)
    h.unwatch(request, 70)
    index = fold(h)
    subject = parse_subject(WATCH_ID)
    timeline = build_timeline(index, subject)
    assert [e.kind for e in timeline] == ["watch_request", *["watch_event"] * 5, "tombstone"]
    assert all(e.decision is None for e in timeline)  # no task state: nothing to apply
    assert [e.owner for e in timeline[1:6]] == ["triggerer-a"] * 3 + ["triggerer-b"] * 2
    assert all(e.owner_exact for e in timeline[1:6])
    verdict = explain(index, subject, ReplayContext(now=NOW))
    console = Console(record=True, width=240)
    render_verdict(console, verdict, timeline)
    text = console.export_text()
    assert "watch (ended)" in text
    assert "watch run 3f2a9c1d… failed: OSError: gone" in text
    html = render_html("watch", [ReportItem(verdict, timeline)], now=NOW)
    assert '<span class="badge ok">watch (ended)</span>' in html


def test_a_tombstoned_watch_reads_as_ended():
    h = History()
    request = two_runs(h)
    h.unwatch(request, 70)
    verdict = why(h, WATCH_ID)
    assert verdict.kind is VerdictKind.WATCH
    assert verdict.cause == "ended"
    assert verdict.facts["active"] is False
    assert verdict.facts["tombstoned_at"] == at(70)
    assert verdict.since == at(70)
    assert "ended, its WatchRequest was tombstoned at" in verdict.summary
    assert "still active" not in verdict.summary
    assert "2 runs, 5 events read" in verdict.summary
    assert verdict.evidence[-1].kind == "tombstone"


def test_a_watch_requested_again_after_its_tombstone_is_active():
    h = History()
    request = two_runs(h)
    h.unwatch(request, 70)
    h.watch(WATCH_ID, 80)
    verdict = why(h, WATCH_ID)
    assert verdict.cause == "active"
    assert verdict.facts["active"] is True


def test_a_watch_whose_request_is_gone_is_still_a_watch():
    h = History()
    two_runs(h)
    h.writes = [w for w in h.writes if w.topic != "deferline.defer"]
    verdict = why(h, WATCH_ID)
    assert verdict.kind is VerdictKind.WATCH
    assert verdict.cause == "no_request"
    assert verdict.facts["active"] is False
    assert "no WatchRequest for it" in verdict.summary


def test_a_watch_whose_last_run_failed_says_it_is_started_again():
    h = History()
    request = h.watch(WATCH_ID, 10)
    h.watch_event(request, 20, run=RUN_A, seq=1, status="failed", error="OSError: gone")
    verdict = why(h, WATCH_ID)
    assert verdict.cause == "active"
    assert verdict.facts["error"] == "OSError: gone"
    assert "its last run failed: the triggerer starts it again" in verdict.summary
    assert "last event: run 3f2a9c1d… failed at" in verdict.summary


def test_a_dead_lettered_watch_ended_even_when_its_request_is_compacted_away():
    h = History()
    request = h.watch(WATCH_ID, 10)
    topic = h.names.defer()
    p = partition_for(WATCH_ID.encode(), h.partitions)
    letter = DeadLetter(
        topic=topic,
        partition=p,
        offset=0,
        key=WATCH_ID.encode(),
        value=encode(request),
        error="pkg.triggers is not under an allowed prefix",
        error_type="TriggerNotAllowed",
        member="triggerer-a",
        failed_at=at(11),
        trigger_id=WATCH_ID,
    )
    h.put(h.names.dead, WATCH_ID, letter)
    h.unwatch(request, 11)
    verdict = why(h, WATCH_ID)
    assert verdict.kind is VerdictKind.WATCH
    assert verdict.cause == "dead_lettered"
    assert verdict.facts["error_type"] == "TriggerNotAllowed"
    assert "dead-lettered" in verdict.summary
    h.writes = [w for w in h.writes if w.value is None or w.topic != topic]
    compacted = why(h, WATCH_ID)
    assert compacted.kind is VerdictKind.WATCH
    assert compacted.cause == "dead_lettered"
    assert compacted.facts["classpath"] == WATCHER


def test_an_active_watch_with_the_live_groups():
    h = History()
    two_runs(h)
    p = partition_for(WATCH_ID.encode(), h.partitions)
    member = MemberView(
        member_id="b-mid", client_id="triggerer-b", assignment=(("deferline.defer", p),)
    )
    running = why(h, WATCH_ID, live(h, GroupView("deferline.triggerer", "Stable", (member,))))
    assert running.cause == "active"
    assert running.facts["member"] == "triggerer-b"
    assert "triggerer-b is assigned its partition now" in running.summary
    idle = why(h, WATCH_ID, live(h, GroupView("deferline.triggerer", "Empty")))
    assert idle.cause == "no_live_triggerer"
    assert idle.facts["active"] is True
    assert "no run of it goes on now" in idle.summary


def test_a_watch_is_not_re_driven():
    h = History()
    two_runs(h)
    plan = plan_redrive(fold(h), WATCH_ID, ReplayContext(now=NOW), force=True)
    assert plan.action == "skip"
    assert "standing watch" in plan.reason
    assert plan.verdict.kind is VerdictKind.WATCH
