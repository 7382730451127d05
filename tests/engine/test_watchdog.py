"""The blocked-loop watchdog names the trigger that blocked the loop, and for how long."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
from deferline.engine import TriggerEvent, TriggerSupervisor

from tests._until import until

from ._support import Sink, _TestTrigger


class BlockingTrigger(_TestTrigger):
    """A badly written trigger: a synchronous sleep inside run()."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def run(self) -> AsyncIterator[TriggerEvent]:
        time.sleep(self.seconds)  # noqa: ASYNC251 - the mistake under test
        yield TriggerEvent("finally")


def _named(
    caplog: pytest.LogCaptureFixture, text: str, trigger_id: str
) -> logging.LogRecord | None:
    """The watchdog record containing ``text`` that names ``trigger_id`` (other, unrelated
    stalls of a busy test machine may be reported too)."""
    for record in caplog.records:
        if text in record.getMessage() and record.__dict__.get("trigger_id") == trigger_id:
            return record
    return None


async def test_watchdog_names_the_blocking_trigger_and_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="deferline.engine")
    sink = Sink()
    async with TriggerSupervisor(capacity=5, on_event=sink, block_threshold=0.1) as sup:
        sup.add("sleepy", BlockingTrigger(0.4))
        await until(lambda: "sleepy" not in sup)
        await until(lambda: _named(caplog, "was blocked", "sleepy") is not None)
        metrics = sup.metrics
    assert sink.one("sleepy").status == "fired"
    assert metrics.blocked_loop >= 1
    assert metrics.blocked_seconds >= 0.35
    during = _named(caplog, "so far", "sleepy")
    assert during is not None
    assert (
        "trigger sleepy (tests.engine.test_watchdog.BlockingTrigger) in run()"
        in during.getMessage()
    )
    assert "test_watchdog.py" in during.getMessage()  # where it was blocked
    assert "must not block" in during.getMessage()
    after = _named(caplog, "was blocked", "sleepy")
    assert after is not None
    assert "trigger sleepy" in after.getMessage()
    assert 0.35 <= after.__dict__["blocked_seconds"] < 3.0


async def test_watchdog_names_a_task_that_is_not_a_trigger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="deferline.engine")

    async def offender() -> None:
        await asyncio.sleep(0)
        time.sleep(0.4)  # noqa: ASYNC251

    def named() -> bool:
        return any("task 'consumer-loop'" in r.getMessage() for r in caplog.records)

    async with TriggerSupervisor(capacity=1, on_event=Sink(), block_threshold=0.1) as sup:
        await asyncio.create_task(offender(), name="consumer-loop")
        await until(named)
        assert sup.metrics.blocked_loop >= 1


async def test_a_responsive_loop_reports_nothing() -> None:
    async with TriggerSupervisor(capacity=1, on_event=Sink(), block_threshold=0.5) as sup:
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert sup.metrics.blocked_loop == 0
