"""DateTimeTrigger and TimeDeltaTrigger."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from deferline.engine import TaskSuccessEvent, TimerSpec, TriggerEvent
from deferline.engine.triggers import DateTimeTrigger, TimeDeltaTrigger

from ._support import first_event


def test_datetime_trigger_validates_and_normalises_to_utc() -> None:
    paris = dt.timezone(dt.timedelta(hours=2))
    trigger = DateTimeTrigger(dt.datetime(2030, 6, 1, 12, 0, tzinfo=paris))
    assert trigger.moment == dt.datetime(2030, 6, 1, 10, 0, tzinfo=dt.UTC)
    assert trigger.moment.tzinfo is dt.UTC
    assert DateTimeTrigger("2030-06-01T10:00:00Z").moment == trigger.moment
    with pytest.raises(ValueError, match="timezone-aware"):
        DateTimeTrigger(dt.datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="ISO-8601"):
        DateTimeTrigger("tomorrow")
    with pytest.raises(TypeError, match="moment must be a datetime"):
        DateTimeTrigger(1234)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="end_from_trigger"):
        DateTimeTrigger(trigger.moment, end_from_trigger="yes")  # type: ignore[arg-type]


def test_datetime_trigger_serializes_and_declares_a_timer() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    trigger = DateTimeTrigger(moment)
    assert trigger.serialize() == (
        "deferline.engine.triggers.DateTimeTrigger",
        {"moment": moment, "end_from_trigger": False},
    )
    assert trigger.as_timer() == TimerSpec(moment, TriggerEvent(moment))
    ending = DateTimeTrigger(moment, end_from_trigger=True)
    assert ending.as_timer() == TimerSpec(moment, TaskSuccessEvent())


async def test_datetime_trigger_run_yields_the_moment_once_due() -> None:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=20)
    events = [event async for event in DateTimeTrigger(moment).run()]
    assert events == [TriggerEvent(moment)]
    assert dt.datetime.now(dt.UTC) >= moment


async def test_datetime_trigger_run_end_from_trigger() -> None:
    moment = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    events = [event async for event in DateTimeTrigger(moment, end_from_trigger=True).run()]
    assert events == [TaskSuccessEvent()]


async def test_datetime_trigger_run_waits_without_blocking() -> None:
    trigger = DateTimeTrigger(dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    task = asyncio.create_task(first_event(trigger))
    await asyncio.sleep(0.01)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_timedelta_trigger_serializes_as_datetime_trigger_like_airflow() -> None:
    before = dt.datetime.now(dt.UTC)
    trigger = TimeDeltaTrigger(dt.timedelta(minutes=5))
    after = dt.datetime.now(dt.UTC)
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferline.engine.triggers.DateTimeTrigger"
    assert before + dt.timedelta(minutes=5) <= kwargs["moment"] <= after + dt.timedelta(minutes=5)
    assert abs(TimeDeltaTrigger(90).moment - (after + dt.timedelta(seconds=90))) < dt.timedelta(
        seconds=5
    )
    with pytest.raises(TypeError, match="delta"):
        TimeDeltaTrigger(True)
    with pytest.raises(TypeError, match="delta"):
        TimeDeltaTrigger("5m")  # type: ignore[arg-type]
