"""The scheduler's quick read of a trigger event gives what the model gives, or leaves it to it."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
from typing import Any

import orjson
import pytest
from deferline.schemas import (
    EventFields,
    SchemaError,
    TaskKey,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
    decode_event,
    encode,
    make_event_id,
    make_trigger_id,
)
from deferline.schemas.testing import WIRE_CONTEXT, quick_event_fields
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ._values import aware_datetimes, kwargs_dicts, same, values
from .test_deferral import ODD as DEFER_ODD

TASK = TaskKey(dag_id="etl", task_id="wait", run_id="manual__2026-11-25T00:00:00+00:00")
MOMENT = dt.datetime(2026, 11, 25, 12, 30, tzinfo=dt.UTC)
TRIGGER = make_trigger_id(TASK, 0)


def event(**changes: Any) -> TriggerEventRecord:
    fields: dict[str, Any] = {
        "event_id": make_event_id(TRIGGER, "fired", MOMENT),
        "trigger_id": TRIGGER,
        "task": TASK,
        "status": "fired",
        "payload": MOMENT,
        "due_at": MOMENT,
        "emitted_at": MOMENT + dt.timedelta(microseconds=1500),
        "member": "triggerer-1",
        "partition": 3,
    }
    return TriggerEventRecord(**(fields | changes))


def fields_equal(a: EventFields, b: EventFields) -> bool:
    """Field by field, values compared in type and value (NaN equals NaN, offsets kept)."""
    return all(
        same(getattr(a, f.name), getattr(b, f.name))
        if f.name not in ("task",)
        else getattr(a, f.name) == getattr(b, f.name)
        for f in dataclasses.fields(EventFields)
    )


def model_fields(raw: dict[str, Any]) -> EventFields | None:
    try:
        return EventFields.of(TriggerEventRecord.model_validate(raw, context=WIRE_CONTEXT))
    except ValidationError:
        return None


USUAL = [
    event(),
    event(payload=7, due_at=None),
    event(status="failed", payload=None, error="boom", traceback="Traceback ...\n  x\n"),
    event(status="timed_out", payload=None, defer_seq=2, queue="gpu-pool_2"),
    event(status="cancelled", payload=None, error="cleared"),
    event(task_outcome="success", xcoms={"return_value": {"at": MOMENT, "rows": (1, 2)}}),
    event(resumed_directly=True, payload={"status": "ok", "n": [1, 2.5, None]}),
    event(emitted_at=dt.datetime(2026, 11, 25, 18, 0, tzinfo=dt.timezone(dt.timedelta(hours=5)))),
    event(payload="déjà vu ✓ 日本", member="ünïcode-member"),
]


@pytest.mark.parametrize("record", USUAL, ids=range(len(USUAL)))
def test_usual_events_are_read_quickly_and_as_the_model_reads_them(
    record: TriggerEventRecord,
) -> None:
    raw = orjson.loads(encode(record))
    quick = quick_event_fields(raw)
    assert quick is not None
    expected = model_fields(raw)
    assert expected is not None
    assert fields_equal(quick, expected)
    assert quick.full() == decode(encode(record)), "the fields give the model's record back"


def test_a_bursts_events_share_their_due_moment_and_payload() -> None:
    """Read once for the burst, not once an event; an odd queue between them is still
    refused as the model refuses it."""
    first, second = (
        decode_event(encode(event(emitted_at=MOMENT + dt.timedelta(seconds=n)))) for n in (1, 2)
    )
    assert isinstance(first, EventFields)
    assert isinstance(second, EventFields)
    assert second.due_at is first.due_at
    assert first.due_at == MOMENT
    assert second.payload is first.payload
    assert first.payload == MOMENT
    assert second.emitted_at == MOMENT + dt.timedelta(seconds=2)
    odd = orjson.loads(encode(event(queue="default")))
    odd["queue"] = "no spaces allowed"
    assert quick_event_fields(odd) is None
    assert model_fields(odd) is None
    assert quick_event_fields(orjson.loads(encode(event(queue="default")))) is not None


task_names = st.from_regex(r"[A-Za-z0-9_.\-]{1,12}", fullmatch=True)
queues = st.from_regex(r"[A-Za-z0-9_\-]{1,64}", fullmatch=True)
run_ids = st.text(
    st.characters(min_codepoint=0x20, exclude_categories=["Cs"], exclude_characters="\x7f"),
    min_size=1,
)
task_keys = st.builds(
    TaskKey,
    dag_id=task_names,
    task_id=task_names,
    run_id=run_ids,
    map_index=st.integers(-1, 2**40),
    try_number=st.integers(0, 99),
)
events = st.builds(
    TriggerEventRecord,
    event_id=st.text(min_size=1, max_size=40),
    trigger_id=st.text(min_size=1, max_size=40),
    task=task_keys,
    defer_seq=st.integers(-(2**40), 2**40),
    status=st.sampled_from(["fired", "failed", "timed_out", "cancelled"]),
    payload=values,
    task_outcome=st.none() | st.sampled_from(["success", "failed", "skipped"]),
    xcoms=st.none() | kwargs_dicts,
    error=st.none() | st.text(max_size=30),
    traceback=st.none() | st.text(max_size=30),
    due_at=st.none() | aware_datetimes,
    emitted_at=aware_datetimes,
    member=st.none() | st.text(max_size=20),
    partition=st.none() | st.integers(0, 2**31),
    queue=st.none() | queues,
    resumed_directly=st.booleans(),
)


@settings(deadline=None, max_examples=400)
@given(events)
def test_any_event_reads_as_the_model_reads_it(record: TriggerEventRecord) -> None:
    data = encode(record)
    fields = decode_event(data)
    assert isinstance(fields, EventFields)
    model = decode(data)  # not always ``record``: an offset with seconds loses them
    assert isinstance(model, TriggerEventRecord)
    assert fields_equal(fields, EventFields.of(model))


# Values that the model reads as they are, coerces, or refuses: for each field, the quick read
# must either leave the record to the model or agree with it.
ODD: list[Any] = [
    *DEFER_ODD,
    "fired",
    "failed",
    "success",
    2**70,
    False,
    "2026-11-25T00:00:00+00:00:30",
    {"dag_id": "d", "task_id": "t", "run_id": "r\n"},
]

# Every field but the two that pick the model (a field added to the model is covered here).
FIELDS = [name for name in TriggerEventRecord.model_fields if name not in ("version", "kind")]
BASE = orjson.loads(encode(event()))


def agrees(raw: dict[str, Any]) -> bool:
    """The quick read took the record (and gave the model's values), or left it."""
    quick = quick_event_fields(raw)
    if quick is None:
        return False
    expected = model_fields(raw)
    assert expected is not None, raw
    assert fields_equal(quick, expected), raw
    return True


def test_each_field_odd_or_missing_is_read_as_the_model_reads_it() -> None:
    taken = 0
    for name in FIELDS:
        missing = copy.deepcopy(BASE)
        del missing[name]
        taken += agrees(missing)
        for value in ODD:
            raw = copy.deepcopy(BASE)
            raw[name] = copy.deepcopy(value)
            taken += agrees(raw)
    assert taken >= 40  # the usual values of every field are still read quickly


@settings(deadline=None, max_examples=400)
@given(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(ODD), max_size=4))
def test_any_mix_of_odd_fields_is_read_as_the_model_reads_it(changes: dict[str, Any]) -> None:
    agrees(copy.deepcopy(BASE) | copy.deepcopy(changes))


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(ODD), min_size=1, max_size=3))
def test_bad_events_fail_with_the_models_own_error(changes: dict[str, Any]) -> None:
    data = json.dumps(BASE | changes).encode()  # orjson writes no integer past 64 bits
    try:
        expected = decode(data)
    except SchemaError as exc:
        refused: SchemaError | None = exc
    else:
        refused = None
    if refused is not None:
        with pytest.raises(SchemaError) as quick:
            decode_event(data)
        assert (quick.value.reason, quick.value.field) == (refused.reason, refused.field)
    else:
        assert isinstance(expected, TriggerEventRecord)
        fields = decode_event(data)
        assert isinstance(fields, EventFields)
        assert fields_equal(fields, EventFields.of(expected))


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[1]", b'{"kind": "trigger_event"}', orjson.dumps(BASE | {"version": 2})],
)
def test_unreadable_events_fail_as_decode_fails(data: bytes) -> None:
    with pytest.raises(SchemaError) as quick:
        decode_event(data)
    with pytest.raises(SchemaError) as model:
        decode(data)
    assert (quick.value.reason, quick.value.field) == (model.value.reason, model.value.field)


def test_other_records_come_back_as_records() -> None:
    state = TaskStateRecord(task=TASK, state="queued", updated_at=MOMENT)
    assert decode_event(encode(state)) == state
