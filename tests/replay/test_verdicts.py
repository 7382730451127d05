"""Verdicts from crafted record lists (the pure fold; no broker)."""

from __future__ import annotations

import json

import pytest
from aiokafka import TopicPartition
from deferline.replay import (
    Evidence,
    GroupHints,
    GroupView,
    LiveView,
    MemberView,
    ReplayContext,
    ReplayIndex,
    TopicRole,
    Verdict,
    VerdictKind,
    build_timeline,
    explain,
    parse_subject,
)
from deferline.runners.scheduler.testing import orphan_letter
from deferline.schemas import DeferRequest, EventFields, KwargsCipher, seal
from deferline.topics import partition_for

from ._history import History, at, task_key

NOW = at(3600)
PREFIX = "deferline."


def fold(history: History) -> ReplayIndex:
    index = ReplayIndex(prefix=history.prefix)
    for rec in history.records():
        index.add(rec)
    return index


def why(history: History, subject: str, live: LiveView | None = None, **ctx: object) -> Verdict:
    context = ReplayContext(now=NOW, live=live, **ctx)  # type: ignore[arg-type]
    return explain(fold(history), parse_subject(subject), context)


def member(client_id: str, *assigned: tuple[str, int]) -> MemberView:
    return MemberView(member_id=f"{client_id}-mid", client_id=client_id, assignment=assigned)


def group(
    group_id: str, *members: MemberView, committed: dict[tuple[str, int], int] | None = None
) -> GroupView:
    return GroupView(group_id, "Stable" if members else "Empty", members, committed or {})


def live(history: History, *groups: GroupView) -> LiveView:
    ends: dict[tuple[str, int], int] = {}
    for write in history.writes:
        ends[(write.topic, write.partition)] = ends.get((write.topic, write.partition), 0) + 1
    return LiveView(
        taken_at=NOW, groups=groups, end_offsets=ends, hints=GroupHints.for_prefix(PREFIX)
    )


def notes(verdict: Verdict) -> list[str]:
    return [e.note for e in verdict.evidence]


def evidence_kinds(verdict: Verdict) -> list[str | None]:
    return [e.kind for e in verdict.evidence]


def deferred_task(h: History, **kwargs: object):
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    request = h.defer(task, 2, **kwargs)  # type: ignore[arg-type]
    return task, request


def part(trigger_id: str, partitions: int = 3) -> int:
    return partition_for(trigger_id.encode(), partitions)


# -- each verdict ------------------------------------------------------------------------------


def test_never_requested_names_the_deferred_state_record():
    h = History()
    task, request = deferred_task(h, publish=False)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.NEVER_REQUESTED
    assert verdict.trigger_id == request.trigger_id
    [ev] = verdict.evidence
    assert ev.kind == "task_state"
    assert ev.position is not None
    assert ev.position.topic == "deferline.tasks"
    assert ev.at == at(2)
    assert "no DeferRequest" in verdict.summary


def test_no_live_triggerer_when_no_group_has_members():
    h = History()
    task, request = deferred_task(h)
    view = live(h, group("deferline.triggerer"), group("deferline.scheduler", member("s1")))
    verdict = why(h, request.trigger_id, view)
    assert verdict.kind is VerdictKind.NO_LIVE_TRIGGERER
    assert evidence_kinds(verdict) == ["task_state", "defer_request", None]
    assert any("deferline.triggerer (Empty)" in n for n in notes(verdict))
    assert verdict.task == task


def test_no_triggerer_for_the_requests_queue():
    h = History()
    task, _ = deferred_task(h, queue="gpu")
    triggerer = group(
        "deferline.triggerer",
        member("trig-a", ("deferline.defer", 0)),
        committed={("deferline.defer", 0): 0},
    )
    verdict = why(h, task.ti_key, live(h, triggerer))
    assert verdict.kind is VerdictKind.NO_TRIGGERER_FOR_QUEUE
    assert verdict.facts["queue"] == "gpu"
    assert "--queues gpu" in verdict.summary
    assert any("deferline.triggerer" in n for n in notes(verdict))


def test_running_on_the_assigned_member_with_timer_fire_lag():
    h = History()
    task, request = deferred_task(h)
    p = part(request.trigger_id)
    triggerer = group(
        "deferline.triggerer",
        member("trig-a", ("deferline.defer", p)),
        member("trig-b", ("deferline.defer", (p + 1) % 3)),
    )
    verdict = why(h, task.ti_key, live(h, triggerer))
    assert verdict.kind is VerdictKind.RUNNING
    assert verdict.facts["member"] == "trig-a"
    assert verdict.facts["partition"] == p
    # The timer was due 60 s after the deferral at t=2; now is t=3600.
    assert verdict.facts["due_at"] == at(62)
    assert verdict.facts["overdue_s"] == pytest.approx(3600 - 62)
    assert "fire lag" in verdict.summary
    assert verdict.since == request.requested_at


def test_running_when_the_broker_does_not_report_assignments():
    h = History()
    other = task_key("other")
    h.submit(other, 0)
    h.start(other, 0.5)
    other_request = h.defer(other, 1)
    _, request = deferred_task(h)
    # Another trigger on the same partition fired on trig-a: the last seen owner.
    h.emit(other_request.model_copy(update={"trigger_id": request.trigger_id + "-x"}), 5)
    triggerer = group(
        "deferline.triggerer",
        MemberView(member_id="m1", client_id="trig-a"),
        committed={("deferline.defer", part(request.trigger_id)): 1},
    )
    verdict = why(h, request.trigger_id, live(h, triggerer))
    assert verdict.kind is VerdictKind.RUNNING
    assert verdict.facts["assignment_reported"] is False
    assert verdict.facts["group"] == "deferline.triggerer"


def test_waiting_when_live_groups_are_not_read():
    h = History()
    task, _ = deferred_task(h)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.WAITING
    assert "owner unknown" in verdict.summary


def test_timer_due_time_is_read_from_sealed_kwargs_with_the_key():
    key = KwargsCipher.generate_key()
    cipher = KwargsCipher([key])
    h = History()
    task = task_key()
    h.submit(task, 0)
    request = h.defer(task, 1, publish=False)
    h.put(h.names.defer(), request.trigger_id, seal(request, cipher))
    opened = why(h, task.ti_key, cipher=cipher)
    assert opened.facts["due_at"] == at(61)
    assert "due_at" not in why(h, task.ti_key).facts


def test_fired_not_applied_scheduler_lag():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70)
    p = part(task.ti_key)
    scheduler = group(
        "deferline.scheduler", member("sched-1"), committed={("deferline.tasks.events", p): 0}
    )
    verdict = why(h, task.ti_key, live(h, scheduler))
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "scheduler_lag"
    assert verdict.facts["scheduler_lag_records"] == 1
    assert verdict.facts["member"] == "triggerer-a"
    assert verdict.since == at(70)
    event = next(e for e in verdict.evidence if e.kind == "trigger_event")
    assert event.position is not None
    assert event.position.topic == "deferline.resume"
    assert event.position.partition == part(request.trigger_id)
    copy = next(e for e in verdict.evidence if "tasks.events" in e.note)
    assert copy.position is not None
    assert (copy.position.topic, copy.position.partition) == ("deferline.tasks.events", p)


def test_fired_not_applied_though_the_scheduler_read_past_it():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70)
    p = part(task.ti_key)
    scheduler = group(
        "deferline.scheduler", member("sched-1"), committed={("deferline.tasks.events", p): 1}
    )
    verdict = why(h, task.ti_key, live(h, scheduler))
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "consumed_not_applied"


def test_an_event_not_copied_to_tasks_events_while_its_trigger_is_alive():
    """The triggerer wrote the event and not (yet) its copy: it retries, and the partition's
    next owner copies it again before the tombstone."""
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70, copied=False, tombstone=False)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.EVENT_NOT_COPIED
    assert verdict.cause == "alive"
    assert "no copy of the event is on tasks.events" in verdict.summary
    assert "retries the copy" in verdict.summary
    assert verdict.since == at(70)
    assert "trigger_event" in evidence_kinds(verdict)


def test_an_event_not_copied_of_a_tombstoned_trigger_says_to_re_drive():
    """An event on the resume topic alone, its trigger tombstoned (written by a triggerer
    from before tasks.events): no triggerer will copy it; re-driving runs it again."""
    h = History()
    _, request = deferred_task(h)
    h.emit(request, 70, copied=False)
    verdict = why(h, request.trigger_id)
    assert verdict.kind is VerdictKind.EVENT_NOT_COPIED
    assert verdict.cause == "tombstoned"
    assert "redrive --force" in verdict.summary


def test_an_event_not_copied_where_events_are_not_copied_is_not_reported_as_missing():
    """A deployment whose triggerers copy no events (DEFERLINE_COPY_EVENTS_TO_TASKS=false):
    the copy is not missing, and the verdict says why no scheduler applied the event."""
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70, copied=False)
    verdict = why(h, task.ti_key, events_copied=False)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "not_copied_here"
    assert "DEFERLINE_COPY_EVENTS_TO_TASKS=false" in verdict.summary


def test_a_copied_event_is_not_reported_as_not_copied():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70, tombstone=False)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED


def test_the_timeline_shows_when_the_event_reached_the_tasks_partition():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70)
    index = fold(h)
    [copy] = index.triggers[request.trigger_id].copies
    entries = build_timeline(index, parse_subject(task.ti_key))
    landed = [e for e in entries if e.role is TopicRole.TASK_EVENTS]
    assert [e.position for e in landed] == [copy.position]
    assert landed[0].description.startswith("copy on the task's partition: event fired")
    assert landed[0].at == at(70)
    assert len(index.triggers[request.trigger_id].events) == 1, "a copy is not another event"


def _orphaned(h: History, request: DeferRequest, when: float) -> None:
    """The scheduler: the event matched no deferral; dead-lettered with the reason."""
    event = h.emit(request, when)
    topic = h.names.task_events
    p = part(request.task.ti_key)
    offset = sum(1 for w in h.writes if w.topic == topic and w.partition == p) - 1
    ref = (TopicPartition(topic, p), offset)
    letter = orphan_letter(EventFields.of(event), ref, now="x", member="sched")
    h.put(h.names.dead, request.trigger_id, letter.model_copy(update={"failed_at": at(when + 5)}))


def test_an_event_the_scheduler_dead_lettered_is_named():
    h = History()
    task, request = deferred_task(h)
    h.worker_state(task, "removed", 10)  # the deferral the event was for is gone
    _orphaned(h, request, 70)
    verdict = why(h, request.trigger_id)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "dead_lettered"
    assert "dead-lettered" in verdict.summary
    assert "OrphanEvent: no deferral on the tasks topic matches this event" in verdict.summary
    assert verdict.facts["error_type"] == "OrphanEvent"
    assert "dead_letter" in evidence_kinds(verdict)


def test_a_dead_lettered_event_of_a_task_deferred_now_says_to_re_drive():
    h = History()
    task, request = deferred_task(h)
    _orphaned(h, request, 70)
    verdict = why(h, task.ti_key)
    assert verdict.cause == "dead_lettered"
    assert "re-drive" in verdict.summary


def test_fired_with_no_scheduler_running():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 70)
    verdict = why(h, task.ti_key, live(h, group("deferline.scheduler")))
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "no_scheduler"


def test_fired_after_the_task_moved_on_is_stale():
    h = History()
    task, request = deferred_task(h)
    # The task was cleared and retried before the event arrived.
    h.worker_state(task, "removed", 10)
    retry = task.model_copy(update={"try_number": 2})
    h.submit(retry, 11)
    h.start(retry, 12)
    h.emit(request, 70)
    verdict = why(h, request.trigger_id)
    assert verdict.kind is VerdictKind.FIRED_NOT_APPLIED
    assert verdict.cause == "stale"
    assert "running, try 2" in verdict.summary


def test_second_event_is_dropped_as_duplicate():
    h = History()
    task, request = deferred_task(h)
    first = h.emit(request, 70, member="trig-a")
    h.schedule(first)
    h.worker_state(task, "running", 71)
    h.emit(request, 72, member="trig-b", payload={"again": True}, tombstone=False)
    verdict = why(h, request.trigger_id)
    assert verdict.kind is VerdictKind.RESUMED
    assert verdict.facts["duplicates_dropped"] == 1
    dropped = [e for e in verdict.evidence if "duplicate" in e.note]
    assert len(dropped) == 1
    assert "trig-b" in (dropped[0].detail or "")


def test_timed_out():
    h = History()
    task, request = deferred_task(h, timeout_at=at(30))
    event = h.emit(request, 30.5, status="timed_out", payload={"timeout": True})
    h.schedule(event)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.TIMED_OUT
    assert verdict.facts["timeout_at"] == at(30)
    assert verdict.since == at(30.5)
    assert "the scheduler applied the event" in notes(verdict)


def test_trigger_failed_carries_the_traceback():
    h = History()
    task, request = deferred_task(h)
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom'
    h.emit(request, 40, status="failed", error="ValueError: boom", traceback=tb, payload={"e": 1})
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.TRIGGER_FAILED
    assert verdict.facts["traceback"] == tb
    assert "boom" in verdict.summary
    assert "still deferred" in verdict.summary


@pytest.mark.parametrize(
    ("error_type", "kind"),
    [
        ("TriggerNotAllowed", VerdictKind.CLASSPATH_NOT_ALLOWED),
        ("TriggerImportError", VerdictKind.IMPORT_ERROR),
        ("DecryptionError", VerdictKind.UNDECRYPTABLE_KWARGS),
        ("TriggerKwargsError", VerdictKind.BAD_REQUEST),
    ],
)
def test_dead_lettered_requests(error_type, kind):
    h = History()
    task, request = deferred_task(h, classpath="evil.module.Trigger")
    h.dead_letter(request, 3, error_type=error_type, error="nope")
    verdict = why(h, task.ti_key)
    assert verdict.kind is kind
    assert verdict.cause == error_type
    letter = next(e for e in verdict.evidence if e.kind == "dead_letter")
    assert letter.position is not None
    assert letter.position.topic == "deferline.dead"
    assert verdict.facts["classpath"] == "evil.module.Trigger"
    assert verdict.facts["member"] == "triggerer-a"


def test_cancelled():
    h = History()
    _, request = deferred_task(h)
    h.cancel(request, 20)
    event = h.emit(
        request, 20.5, status="cancelled", payload={"reason": "cleared"}, error="cleared"
    )
    h.schedule(event)
    verdict = why(h, request.trigger_id)
    assert verdict.kind is VerdictKind.CANCELLED
    assert verdict.since == at(20.5)


def test_cancel_requested_but_not_yet_acted_on():
    h = History()
    task, request = deferred_task(h)
    h.cancel(request, 20)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.CANCELLED
    assert verdict.cause == "cancel_pending"
    assert "cancel_request" in evidence_kinds(verdict)


def test_resumed_but_no_worker_for_the_queue():
    h = History()
    task, request = deferred_task(h, worker_queue="gpu")
    h.schedule(h.emit(request, 70))
    verdict = why(h, task.ti_key, live(h, group("deferline.worker.gpu")))
    assert verdict.kind is VerdictKind.RESUME_NOT_PICKED_UP
    assert verdict.cause == "no_worker"
    assert verdict.facts["worker_queue"] == "gpu"
    run = next(e for e in verdict.evidence if e.kind == "run_task")
    assert run.position is not None
    assert run.position.topic == "deferline.queue.gpu.resumes"


def test_resumed_but_the_worker_queue_lags():
    h = History()
    task, request = deferred_task(h)
    h.schedule(h.emit(request, 70))
    workers = group(
        "deferline.worker.default",
        member("w1"),
        committed={("deferline.queue.resumes", 0): 0},
    )
    view = live(h, workers)
    verdict = why(h, task.ti_key, view)
    assert verdict.kind is VerdictKind.RESUME_NOT_PICKED_UP
    assert verdict.cause == "queue_lag"
    assert verdict.facts["worker_lag_records"] == 1


def test_resumed_but_the_resume_was_never_enqueued():
    h = History()
    task, request = deferred_task(h)
    event = h.emit(request, 70)
    h.schedule(event)
    h.writes = [w for w in h.writes if not w.topic.endswith(".resumes")]
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.RESUME_NOT_PICKED_UP
    assert verdict.cause == "not_enqueued"


def test_resumed_and_picked_up_is_not_stuck():
    h = History()
    task, request = deferred_task(h)
    h.schedule(h.emit(request, 70))
    h.worker_state(task, "running", 71)
    assert why(h, request.trigger_id).kind is VerdictKind.RESUMED
    by_task = why(h, task.ti_key)
    assert by_task.kind is VerdictKind.NOT_DEFERRED
    assert by_task.facts["last_deferral"] == "resumed"


def test_failed_task_is_explained_by_its_timed_out_trigger():
    h = History()
    task, request = deferred_task(h)
    h.schedule(h.emit(request, 30, status="timed_out", payload={"t": 1}))
    h.worker_state(task, "failed", 31)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.TIMED_OUT
    assert verdict.state == "failed"


def test_tombstoned_without_an_event():
    h = History()
    task, request = deferred_task(h)
    h.put(h.names.defer(), request.trigger_id, None)
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.FINISHED_WITHOUT_EVENT
    assert "tombstone" in evidence_kinds(verdict)


def test_not_found():
    h = History()
    deferred_task(h)
    assert why(h, "dag/other/run1").kind is VerdictKind.NOT_FOUND
    assert why(h, "no-such-trigger").kind is VerdictKind.NOT_FOUND


def test_undecodable_request_is_a_bad_request():
    h = History()
    task, request = deferred_task(h, publish=False)
    h.writes.append(
        type(h.writes[0])(
            "deferline.defer", part(request.trigger_id), request.trigger_id.encode(), b"{nope"
        )
    )
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.BAD_REQUEST
    assert verdict.cause == "undecodable"


# -- output ------------------------------------------------------------------------------------


def test_verdict_json_is_plain_json():
    h = History()
    task, request = deferred_task(h)
    h.emit(request, 40, status="failed", error="boom", traceback="tb", payload={"e": 1})
    data = why(h, task.ti_key).to_json()
    text = json.dumps(data)
    back = json.loads(text)
    assert back["verdict"] == "trigger_failed"
    assert back["ti_key"] == task.ti_key
    assert back["facts"]["traceback"] == "tb"
    assert {"note", "at", "topic", "partition", "offset", "kind", "detail"} <= set(
        back["evidence"][0]
    )


def test_evidence_without_a_record_has_no_position():
    assert Evidence("live group").to_json()["topic"] is None


def test_a_task_with_runs_but_no_state_is_not_found():
    h = History()
    task = task_key()
    h.start(task, 1)
    h.writes = [w for w in h.writes if w.topic != "deferline.tasks"]
    verdict = why(h, task.ti_key)
    assert verdict.kind is VerdictKind.NOT_FOUND
    assert "no task state" in verdict.summary
