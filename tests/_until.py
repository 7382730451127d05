"""Waiting in tests: poll a condition until it holds, failing the test at a deadline.

One helper for every tier (no broker imports here), so a timeout reads the same everywhere:
``timed out after 20 s waiting for: <what>``. The defaults suit a unit test's in-memory
condition (every 2 ms, for up to 5 s); a test against a broker or processes passes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

What = str | Callable[[], str] | None


async def until(
    predicate: Callable[[], object],
    *,
    within: float = 5.0,
    interval: float = 0.002,
    what: What = None,
    wake: asyncio.Event | None = None,
) -> Any:  # the predicate's value: overloads for sync and async break on Any-typed ones
    """Call ``predicate`` (sync or async) until it returns something truthy; return that.

    Args:
        within: seconds before the test fails with an AssertionError naming ``what``. The
            last check is made at the deadline; a check under way is not cut short.
        interval: seconds between checks.
        what: what is awaited, for the failure message; a callable is called only on failure
            (to report the state then). By default, the predicate's name (``describe``).
        wake: an event that ends the pause between checks early; it is cleared before each
            check, so a change made during one is not missed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if wake is not None:
            wake.clear()
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(_timed_out(within, what, predicate))
        if wake is None:
            await asyncio.sleep(min(interval, left))
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), min(interval, left))


def until_sync(
    predicate: Callable[[], T],
    *,
    within: float = 5.0,
    interval: float = 0.002,
    what: What = None,
) -> T:
    """``until`` for synchronous code (a sync fixture or test): blocks between checks."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(_timed_out(within, what, predicate))
        time.sleep(min(interval, left))


def _timed_out(within: float, what: What, predicate: Callable[[], object]) -> str:
    if what is None:
        described = describe(predicate)
    elif callable(what):
        described = what()
    else:
        described = what
    return f"timed out after {within:g} s waiting for: {described}"


def describe(predicate: Callable[[], object]) -> str:
    """A predicate's name; for a lambda, which has none, the file and line it is on."""
    code = getattr(predicate, "__code__", None)
    if code is None:
        return repr(predicate)
    if code.co_name != "<lambda>":
        return str(code.co_qualname)
    return f"the condition at {Path(code.co_filename).name}:{code.co_firstlineno}"
