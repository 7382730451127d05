"""Airflow's trigger rows as deferline records, and events back: pure, without Airflow."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from deferline.runners.airflow_bridge import bridge_trigger_id, parse_trigger_id
from deferline.runners.airflow_bridge.testing import (
    BridgeEvent,
    ClaimedRow,
    KwargsNotRendered,
    RejectedRow,
    RowRef,
    WatchApply,
    WatchRow,
    bridge_event,
    has_template,
    read_event,
    to_defer_request,
    to_watch_request,
)
from deferline.schemas import (
    DeferRequest,
    KwargsCipher,
    SchemaError,
    TaskKey,
    TriggerEventRecord,
    WatchEvent,
    WatchRequest,
    decode_as,
    encode,
    make_event_id,
    make_watch_event_id,
    open_kwargs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.schemas.test_event import BASE, FIELDS, ODD, TASK, USUAL

CREATED = dt.datetime(2026, 11, 25, 12, 0, 0, 123456, tzinfo=dt.UTC)
DATETIME = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
ALLOWED = ["airflow.providers.standard.triggers"]


def row(**overrides: Any) -> ClaimedRow:
    values: dict[str, Any] = {
        "ref": RowRef.of(7, CREATED),
        "classpath": DATETIME,
        "kwargs": {"moment": CREATED + dt.timedelta(hours=1), "end_from_trigger": False},
        "kwargs_error": None,
        "queue": None,
        "dag_id": "dag",
        "task_id": "wait",
        "run_id": "manual__2026-11-25T12:00:00+00:00",
        "map_index": -1,
        "try_number": 1,
        "trigger_timeout": None,
        "next_method": "execute_complete",
    }
    return ClaimedRow(**(values | overrides))


def test_the_trigger_id_names_the_row_and_its_creation() -> None:
    ref = RowRef.of(7, CREATED)
    assert bridge_trigger_id(ref) == f"airflow-7-{ref.created_micros}"
    assert parse_trigger_id(bridge_trigger_id(ref)) == ref
    # A naive created_date (some dialects) is UTC, the same row.
    assert RowRef.of(7, CREATED.replace(tzinfo=None)) == ref
    assert parse_trigger_id("6f1c2d0e-9a43-4f57-8f3e-1f0a4d2b7c55") is None


def test_a_row_made_anew_under_the_same_id_is_another_trigger() -> None:
    later = RowRef.of(7, CREATED + dt.timedelta(microseconds=1))
    assert bridge_trigger_id(later) != bridge_trigger_id(RowRef.of(7, CREATED))


def test_a_row_becomes_the_same_request_bytes_on_every_claim() -> None:
    timeout = CREATED + dt.timedelta(minutes=5)
    first = to_defer_request(row(trigger_timeout=timeout), allowed_prefixes=ALLOWED, cipher=None)
    again = to_defer_request(row(trigger_timeout=timeout), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(first, DeferRequest)
    assert isinstance(again, DeferRequest)
    assert encode(first) == encode(again)
    assert first.trigger_id == bridge_trigger_id(RowRef.of(7, CREATED))
    assert first.task == TaskKey(
        dag_id="dag", task_id="wait", run_id="manual__2026-11-25T12:00:00+00:00", try_number=1
    )
    assert first.timeout_at == timeout
    assert first.kwargs["moment"] == CREATED + dt.timedelta(hours=1)


def test_kwargs_are_sealed_with_deferlines_keys_when_set() -> None:
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    request = to_defer_request(row(), allowed_prefixes=ALLOWED, cipher=cipher)
    assert isinstance(request, DeferRequest)
    assert request.kwargs == {}
    assert request.kwargs_token is not None
    assert open_kwargs(request, cipher) == dict(row().kwargs or {})


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"classpath": "evil.Trigger"}, "is not under an allowed prefix"),
        (
            {"kwargs": None, "kwargs_error": ValueError("InvalidToken")},
            "cannot be read with Airflow's key",
        ),
        (
            {"kwargs": None, "kwargs_error": KwargsNotRendered("UndefinedError: 'x' is undefined")},
            "templated kwargs could not be rendered: UndefinedError: 'x' is undefined",
        ),
        ({"kwargs": {"thing": object()}}, "cannot travel to deferline"),
        ({"queue": "no spaces allowed"}, "queue name"),
        ({"dag_id": "bad dag id"}, "cannot be named in deferline"),
    ],
)
def test_a_row_that_cannot_run_is_rejected_with_its_reason(
    overrides: dict[str, Any], reason: str
) -> None:
    outcome = to_defer_request(row(**overrides), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(outcome, RejectedRow)
    assert reason in str(outcome.reason)


def test_a_prefix_allows_its_modules_not_its_lookalikes() -> None:
    lookalike = "airflow.providers.standard.triggersX.Trigger"
    outcome = to_defer_request(row(classpath=lookalike), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(outcome, RejectedRow)


def event(status: str, **fields: Any) -> TriggerEventRecord:
    trigger_id = bridge_trigger_id(RowRef.of(7, CREATED))
    payload = fields.pop("payload", None)
    return TriggerEventRecord(
        event_id=make_event_id(trigger_id, status, payload),
        trigger_id=trigger_id,
        task=TaskKey(dag_id="dag", task_id="wait", run_id="r"),
        status=status,
        payload=payload,
        **fields,
    )


def test_events_map_onto_what_airflow_writes() -> None:
    ref = RowRef.of(7, CREATED)
    assert bridge_event(event("fired", payload={"status": "ok"})) == BridgeEvent(
        ref, "fired", payload={"status": "ok"}
    )
    ended = bridge_event(event("fired", task_outcome="success", xcoms={"k": 1}))
    assert ended == BridgeEvent(ref, "fired", task_outcome="success", xcoms={"k": 1})
    failed = bridge_event(
        event("failed", error="RuntimeError: boom", traceback="Traceback:\n  x\nRuntimeError: boom")
    )
    assert failed == BridgeEvent(
        ref, "failed", traceback=["Traceback:\n", "  x\n", "RuntimeError: boom"]
    )
    bad = bridge_event(event("failed", error="TriggerImportError: no such class"))
    assert bad == BridgeEvent(ref, "failed", traceback=["TriggerImportError: no such class\n"])
    assert bridge_event(event("timed_out")) == BridgeEvent(ref, "timed_out")
    assert bridge_event(event("cancelled", payload={"reason": "cleared"})) is None


BRIDGE_ID = bridge_trigger_id(RowRef.of(7, CREATED))
READ = [
    encode(record.model_copy(update={"trigger_id": trigger_id}))
    for record in USUAL
    for trigger_id in (BRIDGE_ID, record.trigger_id)
]


@pytest.mark.parametrize("data", READ, ids=range(len(READ)))
def test_an_event_is_read_into_what_the_model_gives(data: bytes) -> None:
    assert bridge_event(read_event(data)) == bridge_event(decode_as(data, TriggerEventRecord))


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(ODD), min_size=1, max_size=3))
def test_an_odd_or_bad_event_is_read_or_refused_as_the_model_does(changes: dict[str, Any]) -> None:
    data = json.dumps(BASE | {"trigger_id": BRIDGE_ID} | changes).encode()
    try:
        expected: BridgeEvent | WatchApply | tuple[str, str | None] | None = bridge_event(
            decode_as(data, TriggerEventRecord)
        )
    except SchemaError as exc:
        expected = (exc.reason, exc.field)
    try:
        read: BridgeEvent | WatchApply | tuple[str, str | None] | None = bridge_event(
            read_event(data)
        )
    except SchemaError as exc:
        read = (exc.reason, exc.field)
    assert read == expected


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        encode(DeferRequest(trigger_id=BRIDGE_ID, task=TASK, classpath=DATETIME)),
        json.dumps({**BASE, "kind": "cancel_request", "task": 1}).encode(),
    ],
)
def test_what_is_not_an_event_is_refused_as_the_model_refuses_it(data: bytes) -> None:
    with pytest.raises(SchemaError) as refused:
        read_event(data)
    with pytest.raises(SchemaError) as model:
        decode_as(data, TriggerEventRecord)
    assert (refused.value.reason, refused.value.field) == (model.value.reason, model.value.field)


@pytest.mark.parametrize(
    ("kwargs", "templated"),
    [
        ({"target_time": "{{ ds }}"}, True),
        ({"cmd": "{% if x %}y{% endif %}"}, True),
        ({"nested": {"list": ["plain", ("{# note #}",)]}}, True),
        ({"target_time": "2026-01-01T00:00:00+00:00", "n": 3, "d": CREATED}, False),
        ({"braces": "{ not a template }"}, False),
    ],
)
def test_only_kwargs_with_a_jinja_marker_are_rendered(
    kwargs: dict[str, Any], templated: bool
) -> None:
    assert has_template(kwargs) is templated


FILE_DELETE = "airflow.providers.standard.triggers.file.FileDeleteTrigger"


def watch_row(**overrides: Any) -> WatchRow:
    values: dict[str, Any] = {
        "ref": RowRef.of(9, CREATED),
        "classpath": FILE_DELETE,
        "kwargs": {"filepath": "/in/flag", "poke_interval": 5.0},
        "kwargs_error": None,
        "queue": None,
        "assets": (("inbox", "file:///in"),),
    }
    return WatchRow(**(values | overrides))


def test_an_asset_watcher_row_becomes_the_same_watch_on_every_claim() -> None:
    request = to_watch_request(watch_row(), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(request, WatchRequest)
    assert request.trigger_id == bridge_trigger_id(RowRef.of(9, CREATED))
    assert request.kwargs == {"filepath": "/in/flag", "poke_interval": 5.0}
    assert [(a.name, a.uri) for a in request.assets] == [("inbox", "file:///in")]
    again = to_watch_request(watch_row(), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(again, WatchRequest)
    assert encode(again) == encode(request)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"classpath": "my.triggers.Watch"}, "not under an allowed prefix"),
        ({"kwargs": None, "kwargs_error": ValueError("bad token")}, "cannot be read"),
        ({"kwargs": {"thing": object()}}, "cannot travel to deferline"),
        ({"queue": "no spaces allowed"}, "queue name"),
    ],
)
def test_an_asset_watcher_row_that_cannot_run_is_refused_with_its_reason(
    overrides: dict[str, Any], reason: str
) -> None:
    outcome = to_watch_request(watch_row(**overrides), allowed_prefixes=ALLOWED, cipher=None)
    assert isinstance(outcome, RejectedRow)
    assert reason in str(outcome.reason)


def test_a_watch_event_maps_onto_an_asset_event_by_its_id() -> None:
    ref = RowRef.of(9, CREATED)
    trigger_id = bridge_trigger_id(ref)
    fired = WatchEvent(
        event_id=make_watch_event_id(trigger_id, "r1", 4),
        trigger_id=trigger_id,
        run="r1",
        seq=4,
        status="fired",
        payload=True,
    )
    assert read_event(encode(fired)) == fired
    assert bridge_event(fired) == WatchApply(ref, fired.event_id, "fired", True)
    failed = fired.model_copy(
        update={"event_id": make_watch_event_id(trigger_id, "r1", 5), "seq": 5}
    ).model_copy(update={"status": "failed", "payload": None, "error": "boom"})
    assert bridge_event(failed) == WatchApply(ref, failed.event_id, "failed", None, "boom")
    foreign = fired.model_copy(update={"trigger_id": "not-a-bridge-id"})
    assert bridge_event(foreign) is None
