"""``on_kill()``: awaited before ``cleanup()`` when a user cancels a running trigger, only then."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from deferline.engine import TriggerEvent, TriggerSupervisor

from tests._until import until

from ._support import Sink, _TestTrigger


class ExternalJob(_TestTrigger):
    """Starts an external job and waits on it; ``on_kill()`` stops it, ``cleanup()`` releases."""

    def __init__(self, *, kill_fails: bool = False) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.started = asyncio.Event()
        self.kill_fails = kill_fails

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.calls.append("run")
        self.started.set()
        await asyncio.sleep(3600)
        yield TriggerEvent("job done")

    async def on_kill(self) -> None:
        self.calls.append("on_kill")
        if self.kill_fails:
            raise RuntimeError("the job's API is down")

    async def cleanup(self) -> None:
        self.calls.append("cleanup")


def utc_in(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


async def stopped(how: Callable[[TriggerSupervisor], Awaitable[object]]) -> list[str]:
    """Start an ExternalJob, stop it ``how``, and return the hooks it saw, in order."""
    trigger = ExternalJob()
    supervisor = TriggerSupervisor(capacity=10, on_event=Sink(), cleanup_timeout=1.0)
    async with supervisor:
        supervisor.add("job", trigger, timeout_at=utc_in(3600))
        await trigger.started.wait()
        await how(supervisor)
        await until(lambda: "job" not in supervisor)
    return trigger.calls


async def test_a_user_cancel_awaits_on_kill_before_cleanup() -> None:
    assert await stopped(lambda sup: sup.cancel("job", kill=True)) == ["run", "on_kill", "cleanup"]


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(lambda sup: sup.cancel("job"), id="cancel (fired elsewhere, multi-event)"),
        pytest.param(lambda sup: sup.cancel_many(["job"]), id="cancel_many (partition moved)"),
        pytest.param(lambda sup: sup.stop(), id="stop (triggerer stops)"),
    ],
)
async def test_other_stops_clean_up_without_on_kill(
    how: Callable[[TriggerSupervisor], Awaitable[object]],
) -> None:
    assert await stopped(how) == ["run", "cleanup"]


async def test_a_timeout_cleans_up_without_on_kill() -> None:
    trigger = ExternalJob()
    sink = Sink()
    async with TriggerSupervisor(capacity=10, on_event=sink, cleanup_timeout=1.0) as supervisor:
        supervisor.add("job", trigger, timeout_at=utc_in(0.05))
        await until(lambda: "job" not in supervisor)
    assert sink.one("job").status == "timed_out"
    assert trigger.calls == ["run", "cleanup"]


async def test_on_kill_that_raises_is_logged_and_cleanup_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trigger = ExternalJob(kill_fails=True)
    async with TriggerSupervisor(capacity=10, on_event=Sink(), cleanup_timeout=1.0) as supervisor:
        supervisor.add("job", trigger)
        await trigger.started.wait()
        with caplog.at_level(logging.WARNING):
            await supervisor.cancel("job", kill=True)
    assert trigger.calls == ["run", "on_kill", "cleanup"]
    assert any("on_kill() of" in r.getMessage() for r in caplog.records), caplog.records
