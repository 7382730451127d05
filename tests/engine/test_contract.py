"""The trigger contract, and triggers written for Airflow running here unchanged."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from deferline.engine import (
    BaseTrigger,
    TaskFailedEvent,
    TaskFailureEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
    TriggerSupervisor,
    load_trigger,
)
from deferline.schemas import from_tagged, make_event_id, to_tagged

from tests._until import until

from . import airflow_triggers
from ._support import Sink

AIRFLOW_PREFIX = ["tests.engine.airflow_triggers"]


def test_trigger_event_shape() -> None:
    event = TriggerEvent({"a": 1})
    assert event.payload == {"a": 1}
    assert repr(event) == "TriggerEvent<{'a': 1}>"
    assert event == TriggerEvent({"a": 1})
    assert event != TriggerEvent({"a": 2})
    assert event.event_id("t") == make_event_id("t", "fired", {"a": 1})
    # Canonical payload: key order does not change the id.
    assert TriggerEvent({"b": 2, "a": 1}).event_id("t") == TriggerEvent({"a": 1, "b": 2}).event_id(
        "t"
    )
    assert TriggerEvent(1).event_id("t") != TriggerEvent(1).event_id("u")


def test_task_end_events() -> None:
    assert TaskSuccessEvent().payload == "success"
    assert TaskFailureEvent().task_instance_state == "failed"
    assert TaskFailedEvent is TaskFailureEvent  # Airflow's name
    skipped = TaskSkippedEvent(xcoms={"reason": "holiday"})
    assert skipped.payload == "skipped"
    assert skipped.xcoms == {"reason": "holiday"}
    assert TaskSuccessEvent(xcoms={"k": 1}) == TaskSuccessEvent(xcoms={"k": 1})
    assert TaskSuccessEvent() != TaskFailureEvent()
    with pytest.raises(ValueError, match="payload"):
        TaskSuccessEvent(payload="x")
    with pytest.raises(TypeError, match="xcoms"):
        TaskSuccessEvent(xcoms={1: "not a str key"})  # type: ignore[dict-item]


def test_base_trigger_repr_log_and_abstractness() -> None:
    trigger = airflow_triggers.MyItemTrigger(3)  # type: ignore[no-untyped-call]
    assert repr(trigger) == "<tests.engine.airflow_triggers.MyItemTrigger item=3>"
    assert trigger.log.name == "tests.engine.airflow_triggers.MyItemTrigger"
    assert trigger.trigger_id is None
    assert trigger.task_instance is None
    assert trigger.as_timer() is None
    with pytest.raises(TypeError):
        BaseTrigger()  # type: ignore[abstract]


def _rebuild(trigger: BaseTrigger) -> BaseTrigger:
    """Serialize, pass through the wire codec, and load back as a triggerer would."""
    classpath, kwargs = trigger.serialize()
    wire = from_tagged(to_tagged(kwargs))
    return load_trigger(classpath, wire, allowed_prefixes=AIRFLOW_PREFIX)


async def test_airflow_written_triggers_run_unchanged() -> None:
    sink = Sink()
    airflow_triggers.JobStatusTrigger.jobs["job-1"] = ["PENDING", "RUNNING", "SUCCEEDED"]
    moment = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    triggers = {
        "datetime": airflow_triggers.DateTimeTrigger(moment),  # type: ignore[no-untyped-call]
        "item": airflow_triggers.MyItemTrigger(21),  # type: ignore[no-untyped-call]
        "wait": airflow_triggers.WaitFiveHourTrigger(dt.timedelta(milliseconds=5)),
        "end": airflow_triggers.WaitFiveHourTrigger(
            dt.timedelta(milliseconds=5), end_from_trigger=True
        ),
        "job": airflow_triggers.JobStatusTrigger("job-1", poll_interval=0.001),
    }
    async with TriggerSupervisor(capacity=10, on_event=sink) as sup:
        for trigger_id, trigger in triggers.items():
            assert sup.add(trigger_id, _rebuild(trigger))
        await until(lambda: len(sup) == 0)
    assert sink.one("datetime").payload == moment
    assert sink.one("item").payload == {"result": 42}
    assert sink.one("wait").payload == {"duration": dt.timedelta(milliseconds=5)}
    assert (sink.one("end").payload, sink.one("end").task_outcome) == ("success", "success")
    assert sink.one("job").payload == {"status": "success", "job_id": "job-1"}
    assert all(o.status == "fired" and o.final for o in sink.outcomes)
    assert airflow_triggers.JobStatusTrigger.closed == ["job-1"]  # cleanup() awaited


async def test_airflow_trigger_logging_goes_through_self_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tests.engine.airflow_triggers")
    airflow_triggers.JobStatusTrigger.jobs["job-2"] = ["RUNNING", "FAILED"]
    sink = Sink()
    async with TriggerSupervisor(capacity=1, on_event=sink) as sup:
        sup.add("j2", airflow_triggers.JobStatusTrigger("job-2", poll_interval=0.001))
        await until(lambda: "j2" not in sup)
    assert sink.one("j2").payload == {"status": "error", "message": "Job job-2 failed"}
    assert any("Job job-2 is RUNNING" in r.getMessage() for r in caplog.records)


class Minimal(BaseTrigger):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.engine.test_contract.Minimal", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


async def test_default_cleanup_is_a_no_op_and_none_payload_is_fine() -> None:
    await Minimal().cleanup()
    sink = Sink()
    async with TriggerSupervisor(capacity=1, on_event=sink) as sup:
        sup.add("m", Minimal())
        await until(lambda: "m" not in sup)
    out = sink.one("m")
    assert out.payload is None
    assert out.event_id == make_event_id("m", "fired", None)
