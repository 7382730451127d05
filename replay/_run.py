"""Run one trigger locally from its recorded DeferRequest, to see why it does not fire.

The trigger is built exactly as a triggerer builds it (kwargs opened with the configured keys,
the class loaded under the allowed prefixes) and run under the engine's supervisor, whose
watchdog names a trigger that blocks the event loop. Asyncio debug mode reports slow
callbacks and never-awaited coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deferline.engine import TriggerLoadError, TriggerOutcome, TriggerSupervisor, load_trigger
from deferline.schemas import DecryptionError, DeferRequest, KwargsCipher, open_kwargs

__all__ = ["LocalRun", "run_trigger"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalRun:
    """What a local run saw: its events, and why it ended."""

    outcomes: tuple[TriggerOutcome, ...]
    ended: str  # "event", "final", "timeout", "load_error"
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.ended == "load_error":
            return 2
        if self.ended == "timeout" and not self.outcomes:
            return 3
        if any(o.status != "fired" for o in self.outcomes):
            return 1
        return 0


def enable_asyncio_debug() -> None:
    """PYTHONASYNCIODEBUG for this process and its children; debug logging on the root."""
    os.environ["PYTHONASYNCIODEBUG"] = "1"
    logging.basicConfig(
        level=logging.DEBUG, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("asyncio").setLevel(logging.DEBUG)


async def run_trigger(
    request: DeferRequest,
    *,
    cipher: KwargsCipher | None,
    allowed_prefixes: Sequence[str],
    seconds: float,
    keep_timeout: bool = False,
    all_events: bool = False,
    echo: Callable[[str], None] = print,
) -> LocalRun:
    """Build and run the trigger; stop at its first event (or ``final`` with ``all_events``)."""
    try:
        kwargs = open_kwargs(request, cipher)
        trigger = load_trigger(request.classpath, kwargs, allowed_prefixes=allowed_prefixes)
    except (DecryptionError, TriggerLoadError) as exc:
        echo(f"cannot build the trigger: {type(exc).__name__}: {exc}")
        return LocalRun((), "load_error", f"{type(exc).__name__}: {exc}")
    trigger.trigger_id = request.trigger_id
    echo(f"trigger  {trigger!r}")
    timer = trigger.as_timer()
    if timer is not None:
        now = dt.datetime.now(dt.UTC)
        echo(
            f"timer    due at {timer.moment.isoformat()} "
            f"({(timer.moment - now).total_seconds():+.1f} s from now)"
        )
    timeout_at = request.timeout_at if keep_timeout else None
    if request.timeout_at is not None:
        echo(
            f"timeout  recorded timeout_at {request.timeout_at.isoformat()} "
            + ("(applied)" if keep_timeout else "(ignored; --keep-timeout applies it)")
        )
    outcomes: list[TriggerOutcome] = []
    done = asyncio.Event()

    def on_event(outcome: TriggerOutcome) -> None:
        outcomes.append(outcome)
        fired = outcome.fired_at.isoformat() if outcome.fired_at else "?"
        echo(
            f"event    {outcome.status} at {fired} payload={outcome.payload!r}"
            + (f" error={outcome.error}" if outcome.error else "")
            + (
                f" lag={(outcome.fired_at - outcome.due_at).total_seconds():.3f}s"
                if outcome.fired_at and outcome.due_at
                else ""
            )
        )
        if outcome.traceback:
            echo(outcome.traceback.rstrip())
        if outcome.final or not all_events:
            done.set()

    ended = "timeout"
    async with TriggerSupervisor(capacity=1, on_event=on_event, block_threshold=0.1) as sup:
        sup.add(
            request.trigger_id,
            trigger,
            timeout_at=timeout_at,
            max_events=None if all_events else 1,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await done.wait()
                ended = "final" if all_events else "event"
    if ended == "timeout":
        echo(f"no {'final ' if all_events else ''}event within {seconds:g} s")
    return LocalRun(tuple(outcomes), ended)
