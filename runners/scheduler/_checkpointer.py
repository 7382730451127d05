"""When the scheduler's table may be checkpointed, and the writing of it.

A checkpoint is the table together with the tasks-topic positions it is the fold of, so it
is captured only at a consistent point (see :mod:`._checkpoint`): between two fetches of the
tasks reader, no fold in progress, nothing drained and unsent or held, no batch on its way
to the broker, and no failed batch. :class:`Checkpointer` owns that rule; the databases and
their interval are :class:`~._checkpoint.Checkpoints`'s, the batches
:class:`~._writers.PartitionWriters`'s.
"""

from __future__ import annotations

import asyncio

from deferline.engine import TableDelta

from ._checkpoint import Checkpoints
from ._fold import TaskFold
from ._tasks_topic import TasksReader
from ._writers import PartitionWriters

__all__ = ["Checkpointer"]

Captured = tuple[TableDelta, dict[int, int]]


class Checkpointer:
    """Captures the table at consistent points and writes it (``checkpoints`` None: off)."""

    def __init__(
        self, checkpoints: Checkpoints | None, *, fold: TaskFold, writers: PartitionWriters
    ) -> None:
        self.checkpoints = checkpoints
        self.fold = fold
        self.writers = writers

    def capture(self, reader: TasksReader) -> Captured | None:
        """The checkpoint to write if now is a consistent point. Does not yield."""
        if (
            self.checkpoints is None
            or not reader.tps
            or self.writers.lock.locked()
            or self.fold.table.unpublished
            or not self.writers.settled
        ):
            return None
        return self.checkpoints.capture(self.fold.table, reader.partition_positions())

    async def maybe(self, reader: TasksReader) -> None:
        """Checkpoint if the interval has passed (called by the tasks loop between fetches)."""
        if self.checkpoints is None or not self.checkpoints.due():
            return
        async with self.writers.lock:
            pass  # let a fold in progress finish
        in_flight = self.writers.in_flight()
        if in_flight:
            await asyncio.wait(in_flight)  # and the batches it handed over; the capture
            # below does not yield, and skips this turn if another batch went out meanwhile
        captured = self.capture(reader)
        self.checkpoints.tried()
        if captured is not None:
            await self.checkpoints.write(self.fold.table, *captured)

    async def now(self, reader: TasksReader) -> None:
        """Checkpoint now if this is a consistent point with the tasks loop between fetches
        (a revocation); otherwise the last periodic checkpoint stands."""
        if self.checkpoints is None or not reader.idle:
            return
        captured = self.capture(reader)
        if captured is not None:
            await self.checkpoints.write(self.fold.table, *captured)

    def abandon(self) -> None:
        """No more checkpoints: a publish may have failed halfway."""
        if self.checkpoints is not None:
            self.checkpoints.off = True

    async def last(self, captured: Captured | None) -> None:
        """At stop, once every batch settled: let writes in progress end, then write
        ``captured`` (taken while the tasks loop still waited between fetches)."""
        if self.checkpoints is None or not await self.checkpoints.settle():
            return
        if captured is not None:
            await self.checkpoints.write(self.fold.table, *captured)
