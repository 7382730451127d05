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
from types import TracebackType
from typing import Self

__all__ = ["Lifecycle"]


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
