"""run_until_signal: a process's component runs until it stops by itself or is signalled."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from deferline.runners.testing import run_until_signal
from deferline.topics import Lifecycle


class Component(Lifecycle):
    """Waits for ``finish`` (an error to raise, or None to end cleanly); records calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.finish: asyncio.Future[BaseException | None] | None = None
        self.waiting = asyncio.Event()

    async def start(self) -> None:
        self.calls.append("start")
        self.finish = asyncio.get_running_loop().create_future()

    async def stop(self) -> None:
        self.calls.append("stop")

    async def wait(self) -> None:
        assert self.finish is not None
        self.waiting.set()
        error = await self.finish
        if error is not None:
            raise error


async def test_sigterm_stops_the_component_and_returns() -> None:
    component = Component()
    runner = asyncio.create_task(run_until_signal(component))
    await component.waiting.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(runner, 10)
    assert component.calls == ["start", "stop"]
    assert not runner.cancelled()


async def test_an_error_that_stops_the_component_is_raised_after_stop() -> None:
    component = Component()
    runner = asyncio.create_task(run_until_signal(component, signals=()))
    await component.waiting.wait()
    assert component.finish is not None
    component.finish.set_result(RuntimeError("lost the broker"))
    with pytest.raises(RuntimeError, match="lost the broker"):
        await asyncio.wait_for(runner, 10)
    assert component.calls == ["start", "stop"]


async def test_a_component_that_ends_cleanly_returns_without_a_signal() -> None:
    component = Component()
    runner = asyncio.create_task(run_until_signal(component, signals=()))
    await component.waiting.wait()
    assert component.finish is not None
    component.finish.set_result(None)
    await asyncio.wait_for(runner, 10)
    assert component.calls == ["start", "stop"]
