"""The defer topic's quick read gives what the DeferRequest model gives, or leaves it to it."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import orjson
import pytest
from deferline.schemas import (
    CancelRequest,
    DeferFields,
    DeferRequest,
    KwargsCipher,
    ResumeTarget,
    SchemaError,
    TaskKey,
    decode,
    decode_deferral,
    encode,
    make_trigger_id,
    seal,
)
from deferline.schemas.testing import WIRE_CONTEXT, quick_defer_fields
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

TASK = TaskKey(dag_id="etl", task_id="wait", run_id="manual__2026-11-25T00:00:00+00:00")
MOMENT = dt.datetime(2026, 11, 25, 12, 30, tzinfo=dt.UTC)


def request(**changes: Any) -> DeferRequest:
    fields: dict[str, Any] = {
        "trigger_id": make_trigger_id(TASK, 0),
        "task": TASK,
        "classpath": "deferline.engine.triggers.DateTimeTrigger",
        "kwargs": {"moment": MOMENT, "labels": ("a", 1), "plain": {"x": [1, 2.5, None]}},
    }
    return DeferRequest(**(fields | changes))


def model_fields(raw: dict[str, Any]) -> DeferFields | None:
    try:
        return DeferFields.of(DeferRequest.model_validate(raw, context=WIRE_CONTEXT))
    except ValidationError:
        return None


TARGET = ResumeTarget(
    operator="pkg.mod.Op", op_kwargs={"at": MOMENT, "n": 3}, worker_queue="gpu", pool_slots=2
)
USUAL = [
    request(),
    request(resume=TARGET),
    request(resume=ResumeTarget(operator="pkg.mod.Op"), next_kwargs={"at": MOMENT}),
    request(defer_seq=3, queue="gpu-pool_2", next_kwargs={"at": MOMENT}),
    request(timeout_at=MOMENT + dt.timedelta(hours=1), end_from_trigger=True),
    request(kwargs={}, kwargs_token="gAAAAA-token"),
    request(next_method="resume_here", kwargs={"moment": "2026-11-25T12:30:00+05:30"}),
]


@pytest.mark.parametrize("record", USUAL, ids=range(len(USUAL)))
def test_usual_requests_are_read_quickly_and_as_the_model_reads_them(record: DeferRequest) -> None:
    raw = orjson.loads(encode(record))
    quick = quick_defer_fields(raw)
    assert quick is not None
    assert quick == DeferFields.of(record) == model_fields(raw)


def test_a_sealed_request_read_quickly_opens_as_before() -> None:
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    sealed = seal(request(), cipher)
    fields = decode_deferral(encode(sealed))
    assert isinstance(fields, DeferFields)
    assert fields.kwargs == {}
    assert fields.kwargs_token == sealed.kwargs_token


# Values that the model reads as they are, coerces, or refuses: for each field, the quick read
# must either leave the record to the model or agree with it.
ODD: list[Any] = [
    None,
    "",
    "x",
    "default",
    "bad queue!",
    "default\n",
    "q" * 65,
    "t" * 200,
    "t" * 201,
    0,
    -1,
    7,
    True,
    1.5,
    "3",
    [],
    {},
    {"a": 1},
    {"__type": "datetime", "__var": "2026-11-25T00:00:00Z"},
    {"__type": "dict", "__var": [["a", 1]]},
    {"__type": "nope", "__var": 1},
    {"m": {"__type": "datetime", "__var": "not a time"}},
    {"m": {"__type": "datetime", "__var": "2026-11-25T00:00:00"}},
    "2026-11-25T00:00:00Z",
    "2026-11-25T00:00:00.5+05:30",
    "2026-11-25T23:59:59.999999-12:00",
    "2026-11-25T00:00:00",
    "2026-11-25 00:00:00Z",
    "2026-11-25T00:00:00.1234567Z",
    "2026-11-25T24:00:00Z",
    "2026-02-30T00:00:00Z",
    "0000-01-01T00:00:00Z",
    "9999-12-31T23:59:59-23:59",
    "2026-11-25T00:00:60Z",
    "20261125T000000Z",
    "2026-11-25T00:00:00+2400",
    1_764_000_000,
    {"operator": "pkg.mod.Op"},
    {"operator": "pkg.mod.Op", "op_kwargs": {"at": {"__type": "bytes", "__var": "!"}}},
    {"operator": "pkg.mod.Op", "worker_queue": "bad queue!", "pool": "p"},
    {"operator": "pkg.mod.Op", "pool_slots": 0, "retries": 2, "priority_weight": -5},
    {"operator": "pkg.mod.Op", "retries": -1},
    {"operator": "pkg.mod.Op", "priority_weight": True},
    {"operator": "pkg.mod.Op", "pool_slots": "2"},
    {"operator": 7},
    {"dag_id": "d", "task_id": "t", "run_id": "r"},
    {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "2"},
    {"dag_id": "d/x", "task_id": "t", "run_id": "r"},
]

# Every field but the two that pick the model (a field added to the model is covered here).
FIELDS = [name for name in DeferRequest.model_fields if name not in ("version", "kind")]
BASE = orjson.loads(encode(request()))


def agrees(raw: dict[str, Any]) -> bool:
    """The quick read took the record (and gave the model's values), or left it."""
    quick = quick_defer_fields(raw)
    if quick is None:
        return False
    assert quick == model_fields(raw), raw
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


def test_each_resume_target_field_odd_or_missing_is_read_as_the_model_reads_it() -> None:
    base = orjson.loads(encode(request(resume=TARGET)))
    taken = 0
    for name in ResumeTarget.model_fields:
        missing = copy.deepcopy(base)
        del missing["resume"][name]
        taken += agrees(missing)
        for value in ODD:
            raw = copy.deepcopy(base)
            raw["resume"][name] = copy.deepcopy(value)
            taken += agrees(raw)
    assert taken >= 10


@settings(deadline=None, max_examples=400)
@given(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(ODD), max_size=4))
def test_any_mix_of_odd_fields_is_read_as_the_model_reads_it(changes: dict[str, Any]) -> None:
    agrees(copy.deepcopy(BASE) | copy.deepcopy(changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"requested_at": "yesterday"},
        {"task": {"dag_id": "d"}},
        {"kwargs": {"m": {"__type": "datetime", "__var": "2026-11-25T00:00:00"}}},
        {"kwargs": {}, "kwargs_token": "tok", "next_kwargs": []},
        {"queue": "bad queue!"},
        {"version": 2},
    ],
)
def test_bad_requests_fail_with_the_models_own_error(changes: dict[str, Any]) -> None:
    data = orjson.dumps(BASE | changes)
    with pytest.raises(SchemaError) as quick:
        decode_deferral(data)
    with pytest.raises(SchemaError) as model:
        decode(data)
    assert (quick.value.reason, quick.value.field) == (model.value.reason, model.value.field)


def test_other_records_of_a_defer_topic_come_back_as_records() -> None:
    cancel = CancelRequest(trigger_id=make_trigger_id(TASK, 0), task=TASK)
    assert decode_deferral(encode(cancel)) == cancel
