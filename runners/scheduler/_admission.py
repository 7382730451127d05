"""Where pool admission is decided, behind one small interface.

Today the table admits scheduled tasks by its own pool book (:class:`LocalAdmission`): exact
while one scheduler owns every task partition (one scheduler alone, as before), and a
per-scheduler bound once several share them (each admits up to a pool's size from the
tasks it owns). A pool ledger shared through the broker takes its place here: it returns,
per task partition, the records (``want``/``grant``) that go into that partition's
transaction beside its decisions (see :class:`PartitionBatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deferline.engine import Emit
from deferline.schemas import DeadLetter

from ._publisher import Outgoing

__all__ = ["Admission", "LocalAdmission", "PartitionBatch"]


@dataclass(slots=True)
class PartitionBatch:
    """What one task partition writes in one transaction: decisions, dead letters, and the
    records pool admission asks for (none with :class:`LocalAdmission`)."""

    out: list[Emit] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    pool: list[Outgoing] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out or self.dead or self.pool)

    def extend(self, other: PartitionBatch) -> None:
        self.out += other.out
        self.dead += other.dead
        self.pool += other.pool


class Admission(Protocol):
    """Pool admission as the shell sees it."""

    def exact(self, owned: int, total: int) -> bool:
        """Whether pools are exact while this scheduler owns ``owned`` of ``total``
        partitions."""
        ...

    def records(self, partition: int, out: Sequence[Emit]) -> list[Outgoing]:
        """Pool records to write with ``partition``'s decisions ``out``."""
        ...


class LocalAdmission:
    """The table's own pool book admits; no records go out."""

    def exact(self, owned: int, total: int) -> bool:
        return owned == total

    def records(self, partition: int, out: Sequence[Emit]) -> list[Outgoing]:
        return []
