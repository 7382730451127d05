"""The blocked-loop watchdog names the trigger that blocked the loop, and for how long."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
from deferline.engine import TriggerEvent, TriggerSupervisor

from ._support import Sink, _TestTrigger, wait_until


class BlockingTrigger(_TestTrigger):
    """A badly written trigger: a synchronous sleep inside run()."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def run(self) -> AsyncIterator[TriggerEvent]:
        time.sleep(self.seconds)  # noqa: ASYNC251 - the mistake under test
        yield TriggerEvent("finally")


async def test_watchdog_names_the_blocking_trigger_and_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="deferline.engine")
    sink = Sink()
    async with TriggerSupervisor(capacity=5, on_event=sink, block_threshold=0.05) as sup:
        sup.add("sleepy", BlockingTrigger(0.3))
        await wait_until(lambda: "sleepy" not in sup)
        await wait_until(lambda: any("was blocked" in r.getMessage() for r in caplog.records))
        metrics = sup.metrics
    assert sink.one("sleepy").status == "fired"
    assert metrics.blocked_loop == 1
    assert metrics.last_blocked is not None
    assert metrics.last_blocked[0] == "sleepy"
    assert 0.25 <= metrics.blocked_seconds < 2.0
    during = next(r for r in caplog.records if "so far" in r.getMessage())
    assert (
        "trigger sleepy (tests.engine.test_watchdog.BlockingTrigger) in run()"
        in during.getMessage()
    )
    assert "test_watchdog.py" in during.getMessage()  # where it was blocked
    assert during.__dict__["trigger_id"] == "sleepy"
    after = next(r for r in caplog.records if "was blocked" in r.getMessage())
    assert "trigger sleepy" in after.getMessage()
    assert after.__dict__["blocked_seconds"] >= 0.25


async def test_watchdog_names_a_task_that_is_not_a_trigger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="deferline.engine")

    async def offender() -> None:
        await asyncio.sleep(0)
        time.sleep(0.2)  # noqa: ASYNC251

    async with TriggerSupervisor(capacity=1, on_event=Sink(), block_threshold=0.05) as sup:
        await asyncio.create_task(offender(), name="consumer-loop")
        await wait_until(lambda: sup.metrics.blocked_loop == 1)
        await wait_until(lambda: any("was blocked" in r.getMessage() for r in caplog.records))
    messages = [r.getMessage() for r in caplog.records]
    assert any("task 'consumer-loop'" in m for m in messages)


async def test_a_responsive_loop_reports_nothing() -> None:
    async with TriggerSupervisor(capacity=1, on_event=Sink(), block_threshold=0.05) as sup:
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert sup.metrics.blocked_loop == 0
