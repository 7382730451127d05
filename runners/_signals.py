"""Run a process's component until it stops by itself or SIGTERM/SIGINT asks it to."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from deferline.topics import Lifecycle

__all__ = ["STOP_SIGNALS", "run_until_signal"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def run_until_signal(
    component: Lifecycle, *, signals: tuple[signal.Signals, ...] = STOP_SIGNALS
) -> None:
    """Start ``component``, wait for it, and stop it on the first of ``signals``.

    Returns after a clean stop; raises what stopped the component when it stopped by itself.
    The signal handlers are removed again on the way out.
    """
    loop = asyncio.get_running_loop()
    requested = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, requested.set)
            installed.append(sig)
    try:
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
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
