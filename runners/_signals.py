"""Run a process's component until it stops by itself or SIGTERM/SIGINT asks it to."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

from deferline.topics import Lifecycle

__all__ = ["STOP_SIGNALS", "run_until_signal", "stop_requested"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_requested(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[asyncio.Event]:
    """An event set by the first of ``signals``; the handlers are removed on the way out."""
    loop = asyncio.get_running_loop()
    requested = asyncio.Event()
    installed: list[int] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, requested.set)
            installed.append(sig)
    try:
        yield requested
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def run_until_signal(
    component: Lifecycle, *, signals: tuple[int, ...] = STOP_SIGNALS
) -> None:
    """Start ``component``, wait for it, and stop it on the first of ``signals``.

    Returns after a clean stop; raises what stopped the component when it stopped by itself.
    The signal handlers are removed again on the way out.
    """
    with stop_requested(signals) as requested:
        async with component:
            waiter = asyncio.ensure_future(component.wait())
            stopper = asyncio.ensure_future(requested.wait())
            try:
                done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
                if not waiter.done():
                    waiter.cancel()
            if waiter in done:
                waiter.result()  # stopped by itself: raise what stopped it
