"""The shared Lifecycle base: ``async with`` starts and always stops; a failed start stops."""

from __future__ import annotations

import pytest
from deferline.topics import Lifecycle


class Recorder(Lifecycle):
    def __init__(self, *, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("cannot start")

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_async_with_starts_returns_itself_and_stops() -> None:
    component = Recorder()
    async with component as entered:
        assert entered is component
        assert component.calls == ["start"]
    assert component.calls == ["start", "stop"]


async def test_async_with_stops_when_the_body_raises() -> None:
    component = Recorder()
    with pytest.raises(ValueError, match="body"):
        async with component:
            raise ValueError("body")
    assert component.calls == ["start", "stop"]


async def test_a_failed_start_is_followed_by_stop_and_raises() -> None:
    component = Recorder(fail_start=True)
    with pytest.raises(RuntimeError, match="cannot start"):
        async with component:
            pytest.fail("the body must not run")
    assert component.calls == ["start", "stop"]


async def test_wait_says_when_a_component_has_nothing_to_wait_for() -> None:
    with pytest.raises(NotImplementedError, match="Recorder has nothing to wait for"):
        await Recorder().wait()
