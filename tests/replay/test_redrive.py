"""Re-drive plans: publish only what can resume the task, refuse the rest with a reason."""

from __future__ import annotations

from deferline.replay import ReplayContext, ReplayIndex, plan_redrive
from deferline.topics import partition_for

from ._history import History, at, task_key

CTX = ReplayContext(now=at(3600))


def plan(h: History, trigger_id: str, *, force: bool = False):
    index = ReplayIndex(prefix=h.prefix)
    for rec in h.records():
        index.add(rec)
    return plan_redrive(index, trigger_id, CTX, force=force)


def deferred(h: History, **kwargs):
    task = task_key()
    h.submit(task, 0)
    h.start(task, 1)
    return task, h.defer(task, 2, **kwargs)


def test_a_lost_trigger_is_republished_under_its_own_id_and_partition():
    h = History()
    _, request = deferred(h)
    p = plan(h, request.trigger_id)
    assert p.action == "publish"
    assert p.request == request
    assert p.topic == "deferline.defer"
    assert p.partition == partition_for(request.trigger_id.encode(), h.partitions)
    assert "still active" in p.reason


def test_tombstoned_without_an_event_is_republished():
    h = History()
    _, request = deferred(h)
    h.put(h.names.defer(), request.trigger_id, None)
    p = plan(h, request.trigger_id)
    assert p.action == "publish"
    assert "still active" not in p.reason


def test_a_passed_timeout_is_called_out():
    h = History()
    _, request = deferred(h, timeout_at=at(30))
    assert "time out at once" in plan(h, request.trigger_id).reason


def test_never_requested_has_nothing_to_republish():
    h = History()
    _, request = deferred(h, publish=False)
    p = plan(h, request.trigger_id, force=True)
    assert p.action == "skip"
    assert "no DeferRequest" in p.reason


def test_refused_when_the_task_is_no_longer_deferred_on_it():
    h = History()
    task, request = deferred(h)
    h.worker_state(task, "removed", 5)
    p = plan(h, request.trigger_id, force=True)
    assert p.action == "skip"
    assert "not deferred on this trigger" in p.reason


def test_an_existing_event_needs_force():
    h = History()
    _, request = deferred(h)
    h.emit(request, 70)
    assert plan(h, request.trigger_id).action == "skip"
    assert plan(h, request.trigger_id, force=True).action == "publish"


def test_a_dead_letter_needs_force():
    h = History()
    _, request = deferred(h)
    h.dead_letter(request, 3, error_type="TriggerImportError", error="no module")
    p = plan(h, request.trigger_id)
    assert p.action == "skip"
    assert "dead-lettered" in p.reason
    assert plan(h, request.trigger_id, force=True).action == "publish"


def test_a_cancel_is_never_undone():
    h = History()
    _, request = deferred(h)
    h.cancel(request, 10)
    p = plan(h, request.trigger_id, force=True)
    assert p.action == "skip"
    assert "cancel" in p.reason


def test_unknown_trigger():
    p = plan(History(), "nope")
    assert p.action == "skip"
    assert p.to_json()["verdict"] == "not_found"
