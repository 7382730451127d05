"""The pure pieces: subjects, topic roles, the fold, ownership, pre-filters and timelines."""

from __future__ import annotations

import datetime as dt

import pytest
from deferline.replay import (
    BadSubject,
    OwnershipLog,
    RawRecord,
    ReplayIndex,
    StuckScan,
    TopicInfo,
    TopicRole,
    build_timeline,
    classify_topic,
    parse_subject,
    scheduler_decisions,
    subject_filter,
)
from deferline.replay.testing import KEEP
from deferline.topics import TopicNames

from ._history import History, at, task_key


def fold(h: History) -> ReplayIndex:
    index = ReplayIndex(prefix=h.prefix)
    for rec in h.records():
        index.add(rec)
    return index


# -- subjects and topics -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "trigger_id", "ti_key", "try_number"),
    [
        ("6f1c2d0e-9a43", "6f1c2d0e-9a43", None, None),
        ("dag/task/run", None, "dag/task/run/-1", None),
        ("dag/task/run/3", None, "dag/task/run/3", None),
        ("dag/task/run/-1#2", None, "dag/task/run/-1", 2),
        (
            "dag/task/manual__2025-01-01T00:00:00+00:00",
            None,
            "dag/task/manual__2025-01-01T00:00:00+00:00/-1",
            None,
        ),
        ("dag/task/run/with/slash/7", None, "dag/task/run/with/slash/7", None),
    ],
)
def test_parse_subject(text, trigger_id, ti_key, try_number):
    subject = parse_subject(text)
    assert (subject.trigger_id, subject.ti_key, subject.try_number) == (
        trigger_id,
        ti_key,
        try_number,
    )


@pytest.mark.parametrize("text", ["", "  ", "dag/task", "/task/run", "dag//run"])
def test_parse_subject_rejects_bad_input(text):
    with pytest.raises(BadSubject):
        parse_subject(text)


def test_classify_topic_agrees_with_topic_names():
    names = TopicNames("p.")
    cases = {
        names.defer(): (TopicRole.DEFER, None),
        names.defer("gpu"): (TopicRole.DEFER, "gpu"),
        names.resume(): (TopicRole.RESUME, None),
        names.resume("gpu"): (TopicRole.RESUME, "gpu"),
        names.tasks: (TopicRole.TASKS, None),
        names.work(): (TopicRole.WORK, None),
        names.work("gpu"): (TopicRole.WORK, "gpu"),
        names.resumes(): (TopicRole.RESUMES, None),
        names.resumes("gpu"): (TopicRole.RESUMES, "gpu"),
        names.dead: (TopicRole.DEAD, None),
    }
    for name, (role, queue) in cases.items():
        assert classify_topic(name, prefix="p.") == TopicInfo(name, role, queue)
    for other in ("q.defer", "p.other", "p.tasks.x", "p.queue.a.b", "p.defer.a b"):
        assert classify_topic(other, prefix="p.") is None


# -- the fold ---------------------------------------------------------------------------------


def test_fold_links_records_to_triggers_and_tasks():
    h = History()
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    request = h.defer(task, 2)
    h.schedule(h.emit(request, 70))
    index = fold(h)
    history = index.triggers[request.trigger_id]
    assert history.task == task
    assert history.defer_request == request
    assert history.tombstone is not None
    assert not history.alive
    assert len(history.events) == 1
    assert len(history.runs) == 1  # the resume RunTask names the trigger
    tasks = index.tasks[task.ti_key]
    assert list(tasks.trigger_ids) == [request.trigger_id]
    assert tasks.state is not None
    assert tasks.state.state == "queued"
    assert index.counts["task_state"] == 5  # scheduled, queued, running, deferred, queued


def test_latest_state_follows_offsets_not_arrival_order():
    h = History()
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    records = h.records()
    index = ReplayIndex()
    for rec in reversed(records):
        index.add(rec)
    state = index.tasks[task.ti_key].state
    assert state is not None
    assert state.state == "running"


def test_kept_lists_are_bounded_and_count_what_they_drop():
    h = History()
    task = task_key()
    request = h.defer(task, 0)
    for n in range(KEEP + 50):
        h.emit(request, 1 + n, payload={"n": n}, tombstone=False)
    events = fold(h).triggers[request.trigger_id].events
    assert len(events) == KEEP
    assert events.dropped == 50
    ordered = events.ordered()
    assert ordered[0].at == at(1)  # the first is kept
    assert ordered[-1].at == at(KEEP + 50)  # and the latest


def test_undecodable_and_tombstones_are_kept_per_trigger():
    h = History()
    task = task_key()
    request = h.defer(task, 0)
    h.put(h.names.defer(), request.trigger_id, None)
    index = fold(h)
    assert len(index.triggers[request.trigger_id].tombstones) == 1


# -- ownership --------------------------------------------------------------------------------


def test_ownership_runs_merge_and_answer_at_a_moment():
    log = OwnershipLog()
    for second in (0, 10, 20):
        log.observe(None, 0, "a", at(second))
    for second in (40, 50):
        log.observe(None, 0, "b", at(second))
    assert len(log) == 2
    inside = log.owner_at(None, 0, at(15))
    assert inside is not None
    assert (inside.member, inside.exact) == ("a", True)
    between = log.owner_at(None, 0, at(30))
    assert between is not None
    assert (between.member, between.exact) == ("a", False)  # a before, b after
    after = log.owner_at(None, 0, at(99))
    assert after is not None
    assert after.member == "b"
    assert log.owner_at(None, 1, at(15)) is None
    assert log.owner_at("gpu", 0, at(15)) is None


def test_ownership_accepts_observations_out_of_order():
    log = OwnershipLog()
    log.observe(None, 0, "a", at(20))
    log.observe(None, 0, "a", at(5))
    log.observe(None, 0, "a", at(10))
    assert len(log) == 1
    guess = log.owner_at(None, 0, at(7))
    assert guess is not None
    assert guess.exact


# -- pre-filters ------------------------------------------------------------------------------


def _raw(h: History, index: int) -> RawRecord:
    w = h.writes[index]
    info = classify_topic(w.topic, prefix=h.prefix)
    assert info is not None
    return RawRecord(info, w.partition, 0, w.timestamp_ms, w.key, w.value)


def test_subject_filter_keeps_every_record_naming_the_subject():
    h = History()
    mine, other = task_key("mine"), task_key("other")
    for task in (mine, other):
        h.submit(task, 0)
        request = h.defer(task, 1)
        h.schedule(h.emit(request, 2))
    wants_task = subject_filter(ti_keys=[mine.ti_key])
    kept = [i for i in range(len(h.writes)) if wants_task(_raw(h, i))]
    records = h.records()
    about_mine = [
        i
        for i, rec in enumerate(records)
        if rec.task is not None and rec.task.ti_key == mine.ti_key
    ]
    assert set(about_mine) <= set(kept)
    kept_tasks = [records[i].task for i in kept]
    assert all(task is None or task.ti_key == mine.ti_key for task in kept_tasks)
    trigger = records[about_mine[-1]].trigger_id
    assert trigger is not None
    wants_trigger = subject_filter(trigger_ids=[trigger])
    tomb = next(i for i, r in enumerate(records) if r.tombstone and r.key == trigger)
    assert wants_trigger(_raw(h, tomb))


def test_stuck_scan_keeps_only_tasks_waiting_on_a_trigger():
    h = History()
    waiting, resumed, finished = task_key("w"), task_key("r"), task_key("f")
    for task in (waiting, resumed, finished):
        h.submit(task, 0)
        h.start(task, 1)
        h.defer(task, 2)
    h.schedule(h.emit(h.defer(resumed, 3, publish=False), 4))
    h.worker_state(finished, "success", 5)
    scan = StuckScan()
    for i in range(len(h.writes)):
        raw = _raw(h, i)
        if raw.topic.role is TopicRole.TASKS:
            scan.feed(raw)
    assert len(scan) == 2
    found = scan.waiting(now=at(3600), older_than=dt.timedelta(minutes=10))
    assert [(w.ti_key, w.state) for w in found] == [
        (waiting.ti_key, "deferred"),
        (resumed.ti_key, "queued"),
    ]
    assert found[0].since == at(2)
    assert scan.waiting(now=at(300), older_than=dt.timedelta(minutes=10)) == []


def test_stuck_scan_counts_bad_bytes_and_survives_them():
    scan = StuckScan()
    info = TopicInfo("deferline.tasks", TopicRole.TASKS)
    scan.feed(RawRecord(info, 0, 0, 0, b"k", b"{not json"))
    scan.feed(RawRecord(info, 0, 1, 0, b"k", b"[1, 2]"))
    scan.feed(RawRecord(info, 0, 2, 0, None, b'{"kind": "task_state", "task": {}}'))
    assert scan.undecodable == 2
    assert len(scan) == 0


# -- scheduler decisions and timelines --------------------------------------------------------


def test_scheduler_decisions_replay_the_engine_dedup():
    h = History()
    task = task_key()
    request = h.defer(task, 0)
    first = h.emit(request, 1, member="a")
    h.schedule(first)
    h.emit(request, 2, member="b", payload={"again": 1}, tombstone=False)
    index = fold(h)
    decisions = scheduler_decisions(index.tasks[task.ti_key], [index.triggers[request.trigger_id]])
    assert sorted(decisions.values()) == ["applied", "duplicate"]


def test_timeline_is_time_ordered_with_owners_and_decisions():
    h = History()
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    request = h.defer(task, 2)
    h.schedule(h.emit(request, 70, member="trig-a"))
    h.worker_state(task, "running", 71)
    index = fold(h)
    entries = build_timeline(index, parse_subject(task.ti_key))
    assert len(entries) == len(h.writes)
    assert [e.at for e in entries] == sorted(e.at for e in entries if e.at is not None)
    kinds = [e.kind for e in entries]
    assert kinds.index("trigger_event") < kinds.index("tombstone")
    event = entries[kinds.index("trigger_event")]
    assert (event.owner, event.owner_exact, event.decision) == ("trig-a", True, "applied")
    request_entry = entries[kinds.index("defer_request")]
    assert request_entry.owner == "trig-a"
    assert not request_entry.owner_exact  # only seen after it
    data = event.to_json()
    assert data["record"]["event_id"] == event.record.record.event_id  # type: ignore[union-attr]
    # By trigger id: the same trigger's records and its task's.
    by_trigger = build_timeline(index, parse_subject(request.trigger_id))
    assert {e.position for e in by_trigger} == {e.position for e in entries}


def test_timeline_filters_by_try_number():
    h = History()
    first = task_key()
    h.submit(first, 0)
    h.worker_state(first, "up_for_retry", 1)
    second = first.model_copy(update={"try_number": 2})
    h.submit(second, 2)
    entries = build_timeline(fold(h), parse_subject(f"{first.ti_key}#2"), try_number=2)
    assert [e.at for e in entries] == [at(2)]
