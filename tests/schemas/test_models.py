"""Records on the wire: round-trips, errors that name the field, deterministic ids."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import orjson
import pytest
from deferline.schemas import (
    RECORD_TYPES,
    CancelRequest,
    DeadLetter,
    DeferRequest,
    RunTask,
    SchemaError,
    TaskKey,
    UnknownSchemaVersion,
    WatchEvent,
    decode,
    decode_as,
    encode,
    make_event_id,
    make_trigger_id,
    make_watch_event_id,
)
from deferline.schemas.testing import Record
from hypothesis import given, settings
from hypothesis import strategies as st

from ._examples import KWARGS, RECORDS, TASK, TRIGGER_ID, doc_block
from ._values import kwargs_dicts, same


def raw_defer(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = orjson.loads(encode(RECORDS[0]))
    raw.update(changes)
    return raw


def decode_error(raw: Any) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        decode(orjson.dumps(raw))
    return info.value


# -- round-trips -------------------------------------------------------------------------


def test_examples_cover_every_record_kind() -> None:
    assert {type(r) for r in RECORDS} == set(RECORD_TYPES.values())


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips(record: Record) -> None:
    data = encode(record)
    back = decode(data)
    assert type(back) is type(record)
    assert back == record
    assert decode_as(data, type(record)) == record
    assert encode(back) == data


def test_tagged_kwargs_keep_their_types_through_a_record() -> None:
    back = decode(encode(RECORDS[0]))
    assert isinstance(back, DeferRequest)
    assert same(back.kwargs, KWARGS)


@settings(deadline=None)
@given(kwargs_dicts, kwargs_dicts)
def test_any_kwargs_round_trip_in_a_defer_request(
    kwargs: dict[str, Any], nxt: dict[str, Any]
) -> None:
    request = DeferRequest(
        trigger_id="t", task=TASK, classpath="a.B", kwargs=kwargs, next_kwargs=nxt
    )
    back = decode_as(encode(request), DeferRequest)
    assert same(back.kwargs, kwargs)
    assert same(back.next_kwargs, nxt)


def test_defaults_fill_a_minimal_record() -> None:
    record = decode(
        b'{"kind":"cancel_request","version":1,"trigger_id":"t","task":{"dag_id":"d","task_id":"t","run_id":"r"}}'
    )
    assert isinstance(record, CancelRequest)
    assert record.task == TaskKey(dag_id="d", task_id="t", run_id="r", map_index=-1, try_number=1)
    assert record.reason == "cancelled"
    assert record.requested_at.tzinfo is not None


def test_unknown_fields_are_ignored_within_a_version() -> None:
    record = decode(
        orjson.dumps(raw_defer(added_in_1_5="x", task={**TASK.model_dump(), "extra": 1}))
    )
    assert record == RECORDS[0]


def test_dead_letter_bytes_are_standard_base64_and_url_safe_is_accepted() -> None:
    letter = DeadLetter(
        topic="t", partition=0, offset=0, key=b"\xfb\xff", value=None, error="e", error_type="E"
    )
    raw = orjson.loads(encode(letter))
    assert raw["key"] == "+/8="
    raw["key"] = "-_8="
    assert decode_as(orjson.dumps(raw), DeadLetter).key == b"\xfb\xff"


def test_the_protocol_doc_example_decodes_and_its_key_is_its_trigger_id() -> None:
    record = decode(doc_block("kcat-example", "json"))
    assert isinstance(record, DeferRequest)
    assert record.classpath == "deferline.engine.triggers.DateTimeTrigger"
    assert record.kwargs["moment"] == dt.datetime(2025, 1, 1, 0, 5, tzinfo=dt.UTC)
    assert record.trigger_id == make_trigger_id(record.task, record.defer_seq)
    assert "\n" not in doc_block("kcat-example", "json")


# -- errors name the field ----------------------------------------------------------------


def test_malformed_json() -> None:
    with pytest.raises(SchemaError, match="not JSON") as info:
        decode(b'{"kind": ')
    assert info.value.field is None


@pytest.mark.parametrize("data", [b"[]", b'"x"', b"3", b"null"])
def test_not_an_object(data: bytes) -> None:
    with pytest.raises(SchemaError, match="expected a JSON object"):
        decode(data)


def test_unknown_kind() -> None:
    error = decode_error(raw_defer(kind="defer_request_v2"))
    assert error.field == "kind"
    assert "defer_request_v2" in str(error)


def test_missing_kind() -> None:
    raw = raw_defer()
    del raw["kind"]
    assert decode_error(raw).field == "kind"


def test_unknown_version_is_its_own_error() -> None:
    with pytest.raises(UnknownSchemaVersion, match="version 2 is not supported") as info:
        decode(orjson.dumps(raw_defer(version=2)))
    assert info.value.field == "version"


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_version_must_be_an_integer(version: Any) -> None:
    error = decode_error(raw_defer(version=version))
    assert error.field == "version"
    assert not isinstance(error, UnknownSchemaVersion)


def test_missing_version() -> None:
    raw = raw_defer()
    del raw["version"]
    assert decode_error(raw).field == "version"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"task": {**TASK.model_dump(), "try_number": "two"}}, "task.try_number"),
        ({"task": {**TASK.model_dump(), "dag_id": "has space"}}, "task.dag_id"),
        ({"task": {**TASK.model_dump(), "run_id": "a\x1fb"}}, "task.run_id"),
        ({"task": "etl.daily"}, "task"),
        ({"trigger_id": ""}, "trigger_id"),
        ({"trigger_id": 5}, "trigger_id"),
        ({"classpath": None}, "classpath"),
        ({"defer_seq": -1}, "defer_seq"),
        ({"queue": "no/slashes"}, "queue"),
        ({"timeout_at": "2030-01-01T00:00:00"}, "timeout_at"),
        ({"requested_at": "yesterday"}, "requested_at"),
        ({"kwargs": [1, 2]}, "kwargs"),
        (
            {"kwargs": {"moment": {"__type": "datetime", "__var": "2030-01-01T00:00:00"}}},
            "kwargs.moment",
        ),
        ({"kwargs": {"rows": [1, {"__type": "nope", "__var": 1}]}}, "kwargs.rows[1]"),
        ({"next_kwargs": {"a": {"b": {"__type": "uuid", "__var": "x"}}}}, "next_kwargs.a.b"),
        (
            {"resume": {"operator": "x", "op_kwargs": {"d": {"__type": "date", "__var": 1}}}},
            "resume.op_kwargs.d",
        ),
        ({"resume": {"operator": "x", "pool_slots": 0}}, "resume.pool_slots"),
        ({"kwargs_token": "gAAAA..."}, "kwargs_token"),  # kwargs are set too
    ],
)
def test_wrong_values_name_the_field(changes: dict[str, Any], field: str) -> None:
    error = decode_error(raw_defer(**changes))
    assert error.field == field
    assert str(error).startswith(f"{field}: ")


def test_missing_required_field() -> None:
    raw = raw_defer()
    del raw["classpath"]
    error = decode_error(raw)
    assert error.field == "classpath"
    assert "required" in str(error).lower()


def test_several_errors_are_counted() -> None:
    error = decode_error(raw_defer(defer_seq=-1, classpath=None))
    assert "1 more error" in str(error)


def test_event_status_and_dead_letter_bytes_are_checked() -> None:
    event = orjson.loads(encode(RECORDS[2]))
    assert decode_error({**event, "status": "exploded"}).field == "status"
    letter = orjson.loads(encode(RECORDS[5]))
    assert decode_error({**letter, "value": "not base64!"}).field == "value"
    assert decode_error({**letter, "partition": "x"}).field == "partition"


def test_decode_as_rejects_another_kind() -> None:
    with pytest.raises(SchemaError, match="expected kind 'run_task'") as info:
        decode_as(encode(RECORDS[0]), RunTask)
    assert info.value.field == "kind"


def test_naive_datetime_in_kwargs_fails_at_encode_naming_the_field() -> None:
    request = DeferRequest(
        trigger_id="t", task=TASK, classpath="a.B", kwargs={"moment": dt.datetime(2030, 1, 1)}
    )
    with pytest.raises(SchemaError, match="naive datetime") as info:
        encode(request)
    assert info.value.field == "kwargs.moment"


def test_unencodable_value_in_a_nested_model_names_the_path() -> None:
    request = RECORDS[0]
    assert isinstance(request, DeferRequest)
    assert request.resume is not None
    bad = request.model_copy(
        update={"resume": request.resume.model_copy(update={"op_kwargs": {"x": [object()]}})}
    )
    with pytest.raises(SchemaError, match="cannot encode a value of type object") as info:
        encode(bad)
    assert info.value.field == "resume.op_kwargs.x[0]"


def test_naive_datetimes_are_rejected_in_record_fields() -> None:
    with pytest.raises(ValueError, match="timezone"):
        CancelRequest(trigger_id="t", task=TASK, requested_at=dt.datetime(2030, 1, 1))


def test_kwargs_must_be_an_object_in_python_too() -> None:
    with pytest.raises(ValueError, match="expected an object"):
        DeferRequest(trigger_id="t", task=TASK, classpath="a.B", kwargs=[1])


# -- ids -------------------------------------------------------------------------------------


def test_ti_key_and_str() -> None:
    assert TASK.ti_key == "etl.daily/wait-for_file/scheduled__2030-01-02/3"
    assert str(TASK) == "etl.daily/wait-for_file/scheduled__2030-01-02/3#2"


def test_trigger_id_fixed_vector() -> None:
    # The vector of docs/protocol.md: other implementations check themselves against it.
    task = TaskKey(
        dag_id="example_dag", task_id="wait_for_moment", run_id="manual__2025-01-01T00:00:00+00:00"
    )
    assert make_trigger_id(task, 0) == "95da8f8f-2ab4-5f96-9787-3fa094d531ca"


def test_trigger_id_is_uuid5_of_the_documented_name() -> None:
    name = "\x1f".join(["etl.daily", "wait-for_file", "scheduled__2030-01-02", "3", "2", "1"])
    expected = uuid.uuid5(uuid.UUID("6f1c2d0e-9a43-4f57-8f3e-1f0a4d2b7c55"), name)
    assert str(expected) == TRIGGER_ID
    assert uuid.UUID(TRIGGER_ID).version == 5


@settings(deadline=None)
@given(
    st.from_regex(r"[A-Za-z0-9_.\-]{1,20}", fullmatch=True),
    st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=30),
    st.integers(-1, 10**6),
    st.integers(0, 100),
    st.integers(0, 100),
)
def test_trigger_id_is_deterministic_and_sensitive_to_every_part(
    name: str, run_id: str, map_index: int, try_number: int, seq: int
) -> None:
    task = TaskKey(
        dag_id=name, task_id=name, run_id=run_id, map_index=map_index, try_number=try_number
    )
    same_task = TaskKey.model_validate(task.model_dump())
    tid = make_trigger_id(task, seq)
    assert tid == make_trigger_id(same_task, seq)
    assert tid != make_trigger_id(task, seq + 1)
    assert tid != make_trigger_id(task.model_copy(update={"try_number": try_number + 1}), seq)
    assert tid != make_trigger_id(task.model_copy(update={"map_index": map_index + 1}), seq)
    assert tid != make_trigger_id(task.model_copy(update={"run_id": run_id + "x"}), seq)


def test_event_id_fixed_vector() -> None:
    payload = {"moment": dt.datetime(2025, 1, 1, tzinfo=dt.UTC)}
    event_id = make_event_id("95da8f8f-2ab4-5f96-9787-3fa094d531ca", "fired", payload)
    assert event_id == "8ac0eac5cce138a8c6e80dc140e365f9"


@settings(deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.integers(), min_size=2, max_size=6), st.randoms())
def test_event_id_ignores_dict_key_order(payload: dict[str, int], rnd: Any) -> None:
    items = list(payload.items())
    rnd.shuffle(items)
    assert make_event_id("t", "fired", payload) == make_event_id("t", "fired", dict(items))


def test_event_id_ignores_key_order_of_non_str_dicts_and_sets() -> None:
    a = {"by_id": {1: "a", 2: "b", (3, 4): "c"}, "seen": {"x", "y", "z"}}
    b = {"seen": {"z", "x", "y"}, "by_id": {(3, 4): "c", 2: "b", 1: "a"}}
    assert make_event_id("t", "fired", a) == make_event_id("t", "fired", b)


def test_event_id_depends_on_trigger_status_and_payload() -> None:
    base = make_event_id("t", "fired", {"n": 1})
    assert base == make_event_id("t", "fired", {"n": 1})
    assert len(base) == 32
    assert base != make_event_id("u", "fired", {"n": 1})
    assert base != make_event_id("t", "failed", {"n": 1})
    assert base != make_event_id("t", "fired", {"n": 2})
    assert base != make_event_id("t", "fired", {"n": 1.0})
    assert make_event_id("t", "fired", None) != make_event_id("t", "fired", {})


def test_event_id_of_an_unencodable_payload_is_a_schema_error() -> None:
    with pytest.raises(SchemaError, match="naive datetime"):
        make_event_id("t", "fired", {"at": dt.datetime(2030, 1, 1)})


def test_a_watch_event_id_names_its_watch_run_and_place() -> None:
    event_id = make_watch_event_id("a:b", "3f2a9c1d0b7e4a65", 12)
    assert event_id == "a:b:3f2a9c1d0b7e4a65:12"
    assert event_id.rsplit(":", 2)[1:] == ["3f2a9c1d0b7e4a65", "12"]
    raw = orjson.loads(encode(next(r for r in RECORDS if isinstance(r, WatchEvent))))
    raw["seq"] = 3  # no longer the id's
    error = decode_error(raw)
    assert "make_watch_event_id" in str(error)
    raw.update(seq=2, run="a:b")  # a run id holding the separator
    assert decode_error(raw).field == "run"
