"""The table's drafts of a resume (its state and RunTask, built without pydantic) are the
records the models give: the same bytes from the templates, the same values as models."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from deferline.engine import Emit, Pools, TaskTable
from deferline.engine.testing import Slim, tagged_value
from deferline.schemas import (
    CancelRequest,
    EventFields,
    ResumeTarget,
    RunTask,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
    to_tagged,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.schemas._values import aware_datetimes, kwargs_dicts, values
from tests.schemas.test_event import queues, task_keys, task_names

texts = st.text(max_size=30)  # any unicode but lone surrogates
targets = st.builds(
    ResumeTarget,
    operator=texts,
    op_kwargs=st.just({}) | kwargs_dicts,
    worker_queue=queues,
    pool=texts,
    pool_slots=st.integers(1, 2**40),
    priority_weight=st.integers(-(2**40), 2**40),
    retries=st.integers(0, 2**40),
)
states = st.builds(
    TaskStateRecord,
    task=task_keys,
    state=st.sampled_from(["scheduled", "queued", "running", "deferred", "success", "removed"]),
    trigger_id=st.none() | texts,
    defer_seq=st.integers(0, 2**40),
    next_method=st.none() | texts,
    next_kwargs=st.none() | kwargs_dicts,
    event=values,
    event_id=st.none() | texts,
    reason=st.none() | texts,
    updated_at=aware_datetimes,
    source=st.sampled_from(["worker", "scheduler", "triggerer", "client"]),
    resume=st.none() | targets,
    timeout_at=st.none() | aware_datetimes,
    queue=st.none() | queues,
    xcoms=st.none() | kwargs_dicts,
)


@settings(deadline=None, max_examples=300)
@given(states)
def test_any_state_encodes_from_its_template_as_the_model_does(record: TaskStateRecord) -> None:
    slim = Slim(record, record.resume)
    assert slim.encode() == encode(record)
    assert slim.full() == record


@st.composite
def deferrals(draw: st.DrawFn) -> tuple[TaskStateRecord, TriggerEventRecord]:
    """A deferred task (with or without a target) and an event of its trigger."""
    task = draw(task_keys)
    seq = draw(st.integers(0, 5))
    trigger_id = make_trigger_id(task, seq)
    deferred = TaskStateRecord(
        task=task,
        state="deferred",
        trigger_id=trigger_id,
        defer_seq=seq,
        next_method=draw(st.none() | task_names),
        next_kwargs=draw(st.none() | kwargs_dicts),
        updated_at=draw(aware_datetimes),
        source="worker",
        resume=draw(st.none() | targets),
        timeout_at=draw(st.none() | aware_datetimes),
        queue=draw(st.none() | queues),
    )
    event = TriggerEventRecord(
        event_id=draw(st.text(min_size=1, max_size=40)),
        trigger_id=trigger_id,
        task=task,
        defer_seq=seq,
        status=draw(st.sampled_from(["fired", "failed", "timed_out", "cancelled"])),
        payload=draw(values),
        task_outcome=draw(st.none() | st.sampled_from(["success", "failed", "skipped"])),
        xcoms=draw(st.none() | kwargs_dicts),
        error=draw(st.none() | texts),
        traceback=draw(st.none() | texts),
        emitted_at=draw(aware_datetimes),
        resumed_directly=draw(st.booleans()),
    )
    return deferred, event


def resume(deferred: TaskStateRecord, event: Any) -> tuple[TaskTable, list[Emit]]:
    table = TaskTable(pools=Pools(slots={}, default_slots=None))
    assert table.apply(deferred) == "applied"
    table.drain()
    assert table.apply(event) == "applied"
    return table, table.drain()


@settings(deadline=None, max_examples=300)
@given(deferrals())
def test_a_resumes_records_encode_from_templates_as_the_models_do(
    deferral: tuple[TaskStateRecord, TriggerEventRecord],
) -> None:
    deferred, event = deferral
    _, out = resume(deferred, EventFields.of(decode(encode(event))))  # type: ignore[arg-type]
    assert [emit.kind for emit in out][:1] == ["task_state"]
    for emit in out:
        record = emit.record  # the model, validated: every value the draft holds is valid
        assert emit.value() == encode(record)
        assert emit.kind == record.kind
        assert not isinstance(record, CancelRequest)
        assert emit.key == record.task.ti_key
        if isinstance(record, RunTask):
            assert (emit.worker_queue, emit.resumes) == (record.worker_queue, True)
        else:
            assert (emit.worker_queue, emit.resumes) == (None, False)


@settings(deadline=None, max_examples=200)
@given(deferrals())
def test_a_resume_read_as_fields_or_as_its_model_decides_the_same(
    deferral: tuple[TaskStateRecord, TriggerEventRecord],
) -> None:
    deferred, event = deferral
    _, from_fields = resume(deferred, EventFields.of(event))
    _, from_model = resume(deferred, event)
    assert [e.value() for e in from_fields] == [e.value() for e in from_model]


def test_a_resumes_own_state_read_back_is_an_echo_and_leaves_nothing_in_flight() -> None:
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    table, out = resume(deferred, event)
    state = out[0]
    assert table.apply(state.written) == "echo", "the draft itself, as the scheduler keeps it"
    assert table._views[task.ti_key].inflight == ()
    assert table.drain() == []


def test_own_states_read_back_behind_later_decisions_land_in_order_and_move_nothing() -> None:
    """The resume's state comes back after the task moved on (its try failed, the table
    scheduled and queued the next): each write lands in turn, the later ones stay in flight
    until read, and the state stays the newest decision."""
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    table, out = resume(deferred, event)
    failed = TaskStateRecord(
        task=task, state="up_for_retry", updated_at=event.emitted_at, source="worker"
    )
    assert table.apply(failed) == "applied"
    later = [emit for emit in table.drain() if emit.kind == "task_state"]
    assert [(e.record.state, e.record.task.try_number) for e in later] == [  # type: ignore[union-attr]
        ("scheduled", 2),
        ("queued", 2),
    ]
    newest = table.get(task.ti_key)
    for written, still in [(out[0], 2), (later[0], 1), (later[1], 0)]:
        assert table.apply(written.written) == "echo"
        assert len(table._views[task.ti_key].inflight) == still
        assert table.get(task.ti_key) == newest
    assert table.drain() == [], "nothing to repair: the last write read back is the state"


def test_own_state_read_back_after_a_workers_later_state_is_stale_and_repaired() -> None:
    """The worker's end landed before the resume's ``queued`` (it ran from a direct resume):
    the topic's last record of the task is then behind, and the state is written again."""
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    table, out = resume(deferred, event)
    done = TaskStateRecord(task=task, state="success", updated_at=event.emitted_at, source="worker")
    assert table.apply(done) == "applied"
    assert table.drain() == []
    assert table.apply(out[0].written) == "stale"
    [repair] = table.drain()
    assert repair.record == done


def test_a_resumes_state_read_back_decoded_is_an_echo_too() -> None:
    """After a step-down the scheduler forgets its own writes and decodes what it reads."""
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    table, out = resume(deferred, event)
    read_back = decode(out[0].value())
    assert isinstance(read_back, TaskStateRecord)
    assert table.apply(read_back) == "echo"
    assert table._views[task.ti_key].inflight == ()
    assert table.get(task.ti_key) == read_back


def test_a_draft_no_longer_awaited_is_folded_as_its_record() -> None:
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    table, out = resume(deferred, event)
    table.forget(task.ti_key)  # tombstoned meanwhile
    assert table.apply(out[0].written) == "applied"
    assert table.get(task.ti_key) == out[0].record


def test_a_usual_resume_is_encoded_without_building_a_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = TaskKey(dag_id="d", task_id="t", run_id="r")
    deferred, event = _deferral(task)
    _, out = resume(deferred, EventFields.of(event))
    expected = [encode(emit.record) for emit in out]

    def no_model(record: Any) -> bytes:
        raise AssertionError("encoded through the model")

    monkeypatch.setattr("deferline.engine._taskstate_values.encode", no_model)
    _, out = resume(deferred, EventFields.of(event))
    assert [emit.value() for emit in out] == expected
    assert [emit.kind for emit in out] == ["task_state", "run_task"]


def _deferral(task: TaskKey) -> tuple[TaskStateRecord, TriggerEventRecord]:
    at = dt.datetime(2026, 11, 25, tzinfo=dt.UTC)
    trigger_id = make_trigger_id(task, 0)
    deferred = TaskStateRecord(
        task=task,
        state="deferred",
        trigger_id=trigger_id,
        next_method="done",
        updated_at=at,
        source="worker",
        resume=ResumeTarget(operator="pkg.Op"),
    )
    event = TriggerEventRecord(
        event_id="e1", trigger_id=trigger_id, task=task, status="fired", payload=1, emitted_at=at
    )
    return deferred, event


@settings(deadline=None, max_examples=200)
@given(
    st.one_of(
        states,
        st.builds(
            RunTask,
            task=task_keys,
            mode=st.sampled_from(["start", "resume"]),
            operator=texts,
            worker_queue=queues,
        ),
        st.builds(CancelRequest, trigger_id=st.text(min_size=1, max_size=40), task=task_keys),
    ),
    st.none() | queues,
)
def test_an_emits_destination_attributes_are_what_its_record_says(
    record: TaskStateRecord | RunTask | CancelRequest, queue: str | None
) -> None:
    """Set once when the Emit is made (read per record by the router and the batches)."""
    emit = Emit(record, queue=queue)
    assert emit.kind == record.kind
    assert emit.key == (
        record.trigger_id if isinstance(record, CancelRequest) else record.task.ti_key
    )
    if isinstance(record, RunTask):
        assert (emit.worker_queue, emit.resumes) == (record.worker_queue, record.mode == "resume")
    else:
        assert (emit.worker_queue, emit.resumes) == (None, False)
    if not isinstance(record, CancelRequest):
        assert Emit(record, key=record.task.ti_key).key == emit.key


def test_a_moment_tagged_again_is_the_same_form_and_other_zones_are_not_mixed_up() -> None:
    """The last datetime payload's tagged form is reused while equal: an equal instant in
    another zone is another value to encode (its offset is in the JSON)."""
    utc = dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC)
    paris = utc.astimezone(dt.timezone(dt.timedelta(hours=1)))
    for moment in (utc, paris, paris, utc, utc.replace(microsecond=1)):
        assert tagged_value(moment) == to_tagged(moment)
    assert tagged_value(utc) is tagged_value(utc)
