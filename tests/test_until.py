"""``until``: returns the first truthy value, awaits async predicates, fails naming what and
how long it waited."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests._until import describe, until, until_sync


class Answers:
    """A predicate giving its answers in turn, counting the calls."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        return self.answers.pop(0) if self.answers else None

    async def asked(self) -> object:
        await asyncio.sleep(0)  # a real suspension, as an I/O-bound predicate has
        return self()


async def test_returns_the_first_truthy_value() -> None:
    answers = Answers(None, 0, [], "done", "later")
    assert await until(answers, interval=0) == "done"
    assert answers.calls == 4


async def test_awaits_an_async_predicate() -> None:
    answers = Answers(False, {"n": 1})
    assert await until(answers.asked, interval=0) == {"n": 1}
    assert answers.calls == 2


async def test_fails_naming_what_and_how_long() -> None:
    with pytest.raises(AssertionError) as caught:
        await until(Answers(), within=0, what="the group settled")
    assert str(caught.value) == "timed out after 0 s waiting for: the group settled"


async def test_keeps_checking_until_the_deadline_then_fails() -> None:
    answers = Answers()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(AssertionError, match=r"timed out after 0\.05 s waiting for: x"):
        await until(answers, within=0.05, interval=0.01, what="x")
    assert loop.time() - started >= 0.05
    assert answers.calls >= 2


async def test_a_callable_what_reports_the_state_at_the_timeout() -> None:
    seen: list[int] = []

    def grows() -> bool:
        seen.append(len(seen))
        return False

    with pytest.raises(AssertionError, match=r"waiting for: 3 in \[0\]$"):
        await until(grows, within=0, what=lambda: f"3 in {seen}")


async def test_without_what_names_the_predicate() -> None:
    with pytest.raises(AssertionError, match=r"waiting for: the condition at test_until\.py:\d+$"):
        await until(lambda: False, within=0)
    assert describe(Answers().asked) == "Answers.asked"


async def test_an_error_in_the_predicate_propagates() -> None:
    def broken() -> bool:
        raise RuntimeError("no such table")

    with pytest.raises(RuntimeError, match="no such table"):
        await until(broken)


async def test_wake_ends_the_pause_between_checks() -> None:
    wake = asyncio.Event()
    state: list[str] = []

    def arrive() -> None:
        state.append("arrived")
        wake.set()

    loop = asyncio.get_running_loop()
    started = loop.time()
    loop.call_soon(arrive)
    # Checked once, then paused for at most 60 s: the record arriving ends the pause.
    assert await until(lambda: state, within=120, interval=60, wake=wake) == ["arrived"]
    assert loop.time() - started < 30


def test_until_sync_returns_the_value_or_fails() -> None:
    answers = Answers(None, "rows")
    assert until_sync(answers, interval=0) == "rows"
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^timed out after 0\.02 s waiting for: rows$"):
        until_sync(Answers(), within=0.02, interval=0.005, what="rows")
    assert time.monotonic() - started >= 0.02
