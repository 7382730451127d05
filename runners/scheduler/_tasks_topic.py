"""The scheduler's tasks topic: each owned partition folded to its end when acquired, then
followed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.schemas import DeadLetter

from ._checkpoint import Checkpoints
from ._fold import TaskFold
from ._standby import WarmTable

__all__ = ["TasksReader"]

logger = logging.getLogger(__name__)

_POSITION_POLL = 0.05
"""Seconds between looks at the consumer's positions while waiting to be caught up."""


class TasksReader:
    """Reads tasks topic partitions into a :class:`TaskFold`, and knows how far.

    An acquisition reads its partitions to their end with a reader of its own
    (:meth:`recover`, into a fold of its own); the scheduler's reader then :meth:`take` s
    them at the positions reached, and :meth:`drop` s them when they go elsewhere.

    ``positions`` are the consumer's positions, not last offsets: transaction markers take
    offsets but are no records. ``idle`` is True while a fetch waits, between two batches:
    the table is then the fold of ``positions``.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        fold: TaskFold,
        *,
        max_records: int,
        dead: Callable[[object, str], DeadLetter],
    ) -> None:
        self.consumer = consumer
        self.fold = fold
        self.max_records = max_records
        self.tps: list[TopicPartition] = []
        self.positions: dict[TopicPartition, int] = {}
        self.moved = asyncio.Event()
        self.followed = asyncio.Event()  # set while there are partitions to follow
        self.idle = False
        self.recovered_records = 0
        self.from_standby: list[int] = []  # the partitions the last recover took warm
        self.recovery_seconds: float | None = None
        self._dead = dead

    async def recover(
        self,
        topic: str,
        partitions: set[int],
        checkpoints: Checkpoints | None,
        *,
        prefix: str,
        group: str,
        total: int,
        warm: Mapping[int, WarmTable] | None = None,
    ) -> None:
        """Fold the partitions up to their end as of now, before deciding anything: the
        tail of those with a ``warm`` (standby) table, from the local checkpoint's positions
        where one matches, else from the beginning. Of a warm table and a checkpoint, the one
        further along is taken (a standby still folding a partition from its start is
        behind the checkpoint this host wrote of it)."""
        began = time.monotonic()
        warm = dict(warm or {})
        self.tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        saved: dict[TopicPartition, int] = {}
        if checkpoints is not None:
            checkpoints.open(topic, partitions, total=total)
            further = await checkpoints.saved_positions(warm)
            cold = [
                tp
                for tp in self.tps
                if tp.partition not in warm or further.get(tp.partition, -1) > warm[tp.partition][1]
            ]
            saved = await checkpoints.restore(  # before any fetch starts
                self.fold, self.consumer, cold, prefix=prefix, group=group
            )
            for tp in saved:  # the checkpoint was further along than the standby table
                warm.pop(tp.partition, None)
            for p in warm:  # written whole at the next checkpoint (every key counts as changed)
                await checkpoints.discard(p)
        for p, (table, offset) in warm.items():
            self.fold.table.absorb(table)
            saved[TopicPartition(topic, p)] = offset
        self.from_standby = sorted(warm)
        # The ends before the first fetch: a broker answers a connection's requests in order,
        # so asked later they would wait behind a fetch it holds (fetch_max_wait_ms).
        ends = await self.consumer.end_offsets(self.tps)
        self.consumer.assign(self.tps)
        fresh = [tp for tp in self.tps if tp not in saved]
        if fresh:
            await self.consumer.seek_to_beginning(*fresh)
        for tp, offset in saved.items():
            self.consumer.seek(tp, offset)
        await self._sync()
        while any(self.positions[tp] < ends[tp] for tp in self.tps):
            batches = await self.consumer.getmany(timeout_ms=200, max_records=self.max_records)
            for messages in batches.values():
                for message in messages:
                    self.fold.task(message.key, message.value, live=False)
                    self.recovered_records += 1
            await self._sync()
        self.recovery_seconds = time.monotonic() - began
        logger.info(
            "tasks partitions folded",
            extra={
                "partitions": sorted(partitions),
                "from_checkpoint": sorted(tp.partition for tp in saved if tp.partition not in warm),
                "from_standby": self.from_standby,
                "records_read": self.recovered_records,
                "tasks": len(self.fold.table),
                "seconds": round(self.recovery_seconds, 3),
            },
        )

    async def fetch(self) -> tuple[bool, list[DeadLetter]]:
        """Fold the next batch: (whether anything was read, dead letters of bad records)."""
        self.idle = True
        try:
            await self.followed.wait()
            batches = await self.consumer.getmany(timeout_ms=1000, max_records=self.max_records)
        finally:
            self.idle = False
        dead: list[DeadLetter] = []
        for messages in batches.values():
            for message in messages:
                bad = self.fold.task(message.key, message.value, live=True)
                if bad is not None:
                    dead.append(self._dead(message, bad))
        await self._sync()
        return bool(batches), dead

    async def take(self, positions: dict[TopicPartition, int]) -> None:
        """Follow more partitions, from ``positions`` (folded elsewhere up to them)."""
        current = {tp: await self.consumer.position(tp) for tp in self.tps}
        self.tps = sorted({*self.tps, *positions})
        self.consumer.assign(self.tps)
        for tp, offset in {**current, **positions}.items():
            self.consumer.seek(tp, offset)
        await self._sync()
        self.followed.set()

    async def drop(self, partitions: set[int]) -> None:
        """Stop following ``partitions`` (they went to another scheduler)."""
        gone = [tp for tp in self.tps if tp.partition in partitions]
        if not gone:
            return
        current = {tp: await self.consumer.position(tp) for tp in self.tps if tp not in gone}
        self.tps = sorted(current)
        for tp in gone:
            self.positions.pop(tp, None)
        self.consumer.assign(self.tps)
        for tp, offset in current.items():
            self.consumer.seek(tp, offset)
        if not self.tps:
            self.followed.clear()

    def partition_positions(self) -> dict[int, int]:
        return {tp.partition: self.positions[tp] for tp in self.tps}

    async def caught_up(self) -> None:
        """Wait until the partitions are folded up to their (last stable) end as of now."""
        if not self.tps:
            return
        ends = await self.consumer.end_offsets(self.tps)
        # A partition dropped meanwhile has no position any more: nothing to wait for.
        while any(self.positions.get(tp, end) < end for tp, end in ends.items()):
            self.moved.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POSITION_POLL):
                    await self.moved.wait()
            # A partition whose last records are followed by a transaction's marker: the
            # consumer's position passes the marker on a fetch that returns no records, so
            # no fold says so.
            await self._sync()

    async def _sync(self) -> None:
        for tp in self.tps:
            self.positions[tp] = await self.consumer.position(tp)
