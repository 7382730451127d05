"""One lifecycle for every long-lived component: ``async with`` it, or ``start()`` / ``stop()``.

Client, Worker, Scheduler, Triggerer and the metrics server all hold connections or tasks
that must be released. Each implements :meth:`Lifecycle.start` and :meth:`Lifecycle.stop`
(idempotent, bounded by the component's own graceful timeout); the base gives them the
same ``async with`` behaviour, as temporalio's ``Worker`` and aiokafka's clients do.

It lives here, beside the client factories and broker launchers, because this is the lowest
layer that owns connected things and every other package (``client``, ``engine``,
``runners``, ``replay``) already imports it; ``schemas`` stays pure wire data.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

__all__ = ["Lifecycle", "run_closing"]

T = TypeVar("T")


class Lifecycle(abc.ABC):
    """A component that runs between :meth:`start` and :meth:`stop`.

    ``async with component:`` starts it and always stops it; a start that fails part-way is
    followed by :meth:`stop`, which must therefore release whatever was acquired so far.
    """

    __slots__ = ()

    @abc.abstractmethod
    async def start(self) -> None:
        """Acquire resources and begin work (a second call does nothing)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release everything, waiting at most the component's graceful timeout (idempotent)."""

    async def wait(self) -> None:
        """Wait until the component stops by itself, raising what stopped it.

        Only components that run a loop of their own (worker, scheduler, triggerer) have
        something to wait for.
        """
        raise NotImplementedError(f"{type(self).__name__} has nothing to wait for")

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def run_closing(
    main: Coroutine[Any, Any, T], *, grace: float = 2.0, debug: bool | None = None
) -> T:
    """``asyncio.run(main)`` for a command, closing every connection before the loop closes.

    A connection whose opening failed (a SASL login refused, a TLS certificate rejected) is
    closed by aiokafka without anyone waiting for it; over TLS the close takes a round trip
    (close_notify) and more turns of the loop. ``asyncio.run`` closes the loop as soon as
    ``main`` returns, so such a socket was left open (a ``ResourceWarning``, an fd held to
    the end of the process). Here the loop keeps turning until its sockets are closed, at
    most ``grace`` seconds, then aborts whatever is still open.
    """

    async def closing() -> T:
        try:
            return await main
        finally:
            await _sockets_closed(grace)

    return asyncio.run(closing(), debug=debug)


async def _sockets_closed(grace: float) -> None:
    loop = asyncio.get_running_loop()
    # The selector loop's fd -> transport map (CPython's, weak values); other loops: nothing.
    transports: Mapping[int, asyncio.BaseTransport] = getattr(loop, "_transports", {})

    def still_open() -> list[asyncio.BaseTransport]:
        return [t for t in list(transports.values()) if getattr(t, "_sock", None) is not None]

    # The command is over: whatever is open is closing (a TLS shutdown under way) or was
    # left open by mistake; either way it must not outlive the loop.
    deadline = loop.time() + grace
    while still_open() and loop.time() < deadline:  # noqa: ASYNC110 - no event says 'closed'
        await asyncio.sleep(0.005)
    for transport in still_open():
        if isinstance(transport, asyncio.Transport):
            transport.abort()
    await asyncio.sleep(0)  # abort() closes the socket on the loop's next turn
