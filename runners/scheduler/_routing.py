"""Which task partition each decision belongs to. No I/O.

A decision is written in the transaction of its task's partition (the partition its
``ti_key`` hashes to on the tasks topic, the same number on tasks.events): a task state and
a RunTask are keyed by the task, a CancelRequest by its trigger but written for its task, a
dead letter for the partition of the record it carries.
"""

from __future__ import annotations

from collections.abc import Iterable

from deferline.engine import Emit
from deferline.schemas import CancelRequest, DeadLetter
from deferline.topics import partition_for

from ._admission import PartitionBatch

__all__ = ["PartitionRouter"]


class PartitionRouter:
    """Splits decisions by task partition, remembering each key's partition (murmur2 in
    Python costs microseconds a key)."""

    __slots__ = ("_known", "partitions")

    def __init__(self, partitions: int = 0) -> None:
        self.partitions = partitions
        self._known: dict[str, int] = {}

    def partition_of(self, ti_key: str) -> int:
        """The task partition of ``ti_key``."""
        found = self._known.get(ti_key)
        if found is None:
            found = self._known[ti_key] = partition_for(ti_key.encode(), self.partitions)
        return found

    def route(
        self, out: Iterable[Emit], dead: Iterable[DeadLetter] = ()
    ) -> dict[int, PartitionBatch]:
        """``out`` and ``dead`` by task partition, each in the order given."""
        batches: dict[int, PartitionBatch] = {}
        known = self._known
        for emit in out:
            if emit.kind == "cancel_request":
                record = emit.record
                assert isinstance(record, CancelRequest)
                key = record.task.ti_key
            else:
                key = emit.key
            partition = known.get(key)
            if partition is None:
                partition = self.partition_of(key)
            batch = batches.get(partition)
            if batch is None:
                batch = batches[partition] = PartitionBatch()
            batch.out.append(emit)
        for letter in dead:
            batches.setdefault(letter.partition, PartitionBatch()).dead.append(letter)
        return batches

    def forget(self, partition: int) -> None:
        """Drop the keys known of ``partition`` (it went to another scheduler)."""
        self._known = {k: p for k, p in self._known.items() if p != partition}

    def trim(self, limit: int) -> None:
        """Forget every key once more than ``limit`` are known (keys of tasks no longer
        held; computed again when seen)."""
        if len(self._known) > limit:
            self._known.clear()
