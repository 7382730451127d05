"""Standby tables: the tasks partitions another scheduler owns, kept folded here.

A partition taken over is folded from the start of its history (or from a local checkpoint,
if this host wrote one): under load that takes seconds, and its tasks wait meanwhile. With a
standby (``deferline scheduler --standby``, as Kafka Streams keeps standby replicas), every
partition this scheduler does not own is folded as it is written, each into a table of its
own; an acquisition takes the table and folds only the tail written since. A scheduler with a
standby folds every partition before it joins the group, so a newcomer takes its share over
warm, and a leave or a failover finds the partitions already folded by those who stay. The
partitions this host holds a checkpoint of are folded only once it has joined: restoring
one is quicker than folding it from the start, and a lone scheduler restarting takes every
partition from its checkpoints, as it does without a standby. An acquisition takes whichever
of the table and the checkpoint is further along.

The folds are those a takeover makes (records read ``read_committed``, no decision taken: a
table's decisions are made when its owner drains it), so a table handed over is the one the
acquisition would have folded itself up to that position. A partition let go is folded again
from its start (the owner's table holds its own writes before they were committed: it is not
handed back). The cost is each scheduler's memory and CPU for the whole task table, not its
share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import LedgerAdmission, Pools, TaskTable
from deferline.topics import start_client, stop_client

from .._aiokafka import client_of
from ._fold import TaskFold

__all__ = ["Standby", "WarmTable"]

logger = logging.getLogger(__name__)

WarmTable = tuple[TaskTable, int]
"""A partition's standby table and the offset its tail starts at."""


class Standby:
    """Folds the tasks partitions it is told to follow, each into a table of its own.

    Args:
        consumer: makes the tasks-topic consumer, outside the group (``read_committed``).
        topic: the tasks topic.
        pools: the scheduler's pools (the tables are built as a takeover's are).
        ledger: the scheduler's pool ledger admission.
        max_records: most records folded per fetch.
        finished_retention: finished tasks older than this (record time) are forgotten, as
            the owner forgets them.
    """

    def __init__(
        self,
        consumer: Callable[[], AIOKafkaConsumer],
        *,
        topic: str,
        pools: Pools,
        ledger: LedgerAdmission | None,
        max_records: int,
        finished_retention: float,
    ) -> None:
        self._make_consumer = consumer
        self._consumer: AIOKafkaConsumer | None = None
        self.topic = topic
        self.max_records = max_records
        self.finished_retention = finished_retention
        self.records = 0  # folded since start
        self.handed = 0  # partitions handed to an acquisition
        self._pools = pools
        self._ledger = ledger
        self._folds: dict[int, TaskFold] = {}
        self._next: dict[int, int] = {}  # per partition: the offset after the last one folded
        self._live: dict[int, TaskFold] = {}  # the tables the consumer is positioned for
        self._later: set[int] = set()  # followed once the scheduler has joined
        self._following = asyncio.Event()  # set while there are partitions to follow

    @property
    def consumer(self) -> AIOKafkaConsumer:
        assert self._consumer is not None, "warm the standby first"
        return self._consumer

    @property
    def partitions(self) -> list[int]:
        """The partitions followed."""
        return sorted(self._folds)

    @property
    def tasks(self) -> int:
        return sum(len(fold.table) for fold in self._folds.values())

    async def warm(self, partitions: Iterable[int], *, later: Iterable[int] = ()) -> None:
        """Start, follow ``partitions`` from their start, and fold them up to their ends as
        of now. Those also in ``later`` are followed only once the scheduler has joined
        (:meth:`joined`): this host's checkpoint of each is a quicker takeover meanwhile,
        and a lone scheduler restarting takes them all."""
        began = time.monotonic()
        consumer = self._make_consumer()
        await start_client(consumer, grace=5.0, name="standby reader")  # closed if it fails
        self._consumer = consumer
        self._later = set(later)
        numbers = sorted(set(partitions) - self._later)
        tps = [TopicPartition(self.topic, p) for p in numbers]
        await client_of(consumer).set_topics([self.topic])  # see Membership._track
        ends = await consumer.end_offsets(tps) if tps else {}  # before any fetch (TasksReader)
        self.follow(numbers)
        await self._assign()
        while True:
            positions = {tp: await consumer.position(tp) for tp in tps}
            if all(positions[tp] >= end for tp, end in ends.items()):
                break
            await self._fetch(timeout_ms=200)
        logger.info(
            "standby tasks partitions folded",
            extra={
                "partitions": numbers,
                "later": sorted(self._later),
                "records_read": self.records,
                "tasks": self.tasks,
                "seconds": round(time.monotonic() - began, 3),
            },
        )

    async def run(self) -> None:
        """Fold what is written to the followed partitions, forever."""
        while True:
            await self._following.wait()
            await self._fetch(timeout_ms=1000)

    def joined(self, owned: Iterable[int]) -> None:
        """The scheduler took its first assignment over: follow the partitions left for
        later that it does not own."""
        later, self._later = self._later, set()
        self.follow(later - set(owned))

    def follow(self, partitions: Iterable[int]) -> None:
        """Fold ``partitions`` from their start (they are another scheduler's now); the
        consumer is moved at its next fetch (a rebalance does not wait for it)."""
        for p in partitions:
            self._later.discard(p)
            if p not in self._folds:
                self._folds[p] = TaskFold(self._pools, ledger=self._ledger)
                self._next[p] = 0
                self._following.set()

    def take(self, partitions: Iterable[int]) -> dict[int, WarmTable]:
        """Stop following ``partitions`` (they are acquired) and hand over the table of each
        that has anything folded, with the offset to fold its tail from. The consumer drops
        them at its next fetch."""
        warm: dict[int, WarmTable] = {}
        for p in partitions:
            self._later.discard(p)
            fold = self._folds.pop(p, None)
            start = self._next.pop(p, 0)
            self._live.pop(p, None)
            if fold is not None and start > 0:
                warm[p] = (fold.table, start)
        self.handed += len(warm)
        if not self._folds:
            self._following.clear()
        return warm

    async def stop(self) -> None:
        self._later.clear()
        self._folds.clear()
        self._next.clear()
        self._live.clear()
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await stop_client(consumer, grace=5.0, name="standby reader")

    async def _assign(self) -> None:
        """Assign the followed partitions: those read so far stay at their position, the
        others start from the beginning. A fetch made for the assignment before is dropped
        by the consumer."""
        consumer = self.consumer
        folds = dict(self._folds)  # take and follow may change them while this awaits
        kept = {
            tp: await consumer.position(tp)
            for tp in consumer.assignment()
            if tp.partition in folds
            and self._live.get(tp.partition) is folds[tp.partition]
            and self._next[tp.partition] > 0
        }
        followed = [TopicPartition(self.topic, p) for p in sorted(folds)]
        if not followed:  # assign([]) would track the metadata of every topic
            consumer.pause(*consumer.assignment())
            self._live = {}
            return
        consumer.assign(followed)
        for tp, offset in kept.items():
            consumer.seek(tp, offset)
        fresh = [tp for tp in followed if tp not in kept]
        if fresh:
            await consumer.seek_to_beginning(*fresh)
        self._live = {p: fold for p, fold in folds.items() if self._folds.get(p) is fold}

    async def _fetch(self, *, timeout_ms: int) -> None:
        assigned = {tp.partition for tp in self.consumer.assignment()}
        if self._live != self._folds or assigned != self._folds.keys():
            await self._assign()  # partitions were taken or let go since the last fetch
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=self.max_records)
        for tp, messages in batches.items():
            fold = self._folds.get(tp.partition)
            if fold is None or self._live.get(tp.partition) is not fold:
                continue  # taken (or taken and let go) while the fetch was on its way
            start = self._next[tp.partition]
            for message in messages:
                if message.offset < start:
                    continue
                fold.task(message.key, message.value, live=False)
            if messages:
                self._next[tp.partition] = max(start, messages[-1].offset + 1)
                self.records += len(messages)
                fold.table.forget_finished(self.finished_retention)
