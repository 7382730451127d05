"""Where pool admission is decided, behind one small interface.

Tasks of limited pools are admitted through the pool ledger shared through the broker
(:class:`LedgerPoolAdmission`): after each drain the table's wants (and want tombstones) go
into the transaction of their task partition, and, on the scheduler that owns task partition
0 (the ledger owner), the ledger's grants into partition 0's (see :class:`PartitionBatch`).
Pools are so exact whatever the membership. Tasks of unlimited pools are still admitted by
the table at once, and a resumed task keeps its slot: neither waits for the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deferline.engine import Emit, TaskTable
from deferline.schemas import DeadLetter

from ..member import Outgoing

if TYPE_CHECKING:
    from ._pools import PoolChannel

__all__ = ["LEDGER_PARTITION", "LedgerPoolAdmission", "PartitionBatch"]

LEDGER_PARTITION = 0
"""The task partition whose owner keeps the pool ledger and writes its grants."""


@dataclass(slots=True)
class PartitionBatch:
    """What one task partition writes in one transaction: decisions, dead letters, and the
    records pool admission asks for."""

    out: list[Emit] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    pool: list[Outgoing] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out or self.dead or self.pool)

    def extend(self, other: PartitionBatch) -> None:
        self.out += other.out
        self.dead += other.dead
        self.pool += other.pool


class LedgerPoolAdmission:
    """The pool ledger admits: the table's wants go to their task partition, the ledger
    owner's grants to partition 0."""

    def __init__(self, channel: PoolChannel, partition_of: Callable[[str], int]) -> None:
        self.channel = channel
        self.partition_of = partition_of

    def records(self, table: TaskTable) -> dict[int, list[Outgoing]]:
        """Pool records to write after a drain of ``table``, by task partition."""
        entries = table.take_pool_writes()
        out: dict[int, list[Outgoing]] = {}
        for entry, record in zip(entries, self.channel.want_records(entries), strict=True):
            out.setdefault(self.partition_of(entry.ti_key), []).append(record)
        grants = self.channel.grant_records()
        if grants:
            out.setdefault(LEDGER_PARTITION, []).extend(grants)
        return out
