"""The task partitions this scheduler owns, and their writing.

:class:`PartitionWriters` owns, per owned partition, an :class:`OwnedPartition` (its chain
of batches, the decisions held while it cannot write, its event counts); the publish lock (a
fold and the hand-over of the batches it calls for are one step); the batches handed over
and not yet awaited; the worker queues whose topics exist. Every chain writes through the
member's one producer (:class:`~deferline.runners.member.MemberProducer`), which makes the
batches of all partitions handed over together one transaction. It routes a drain's
decisions to their partitions, holds them for a partition that may not write now, waits for
batches, and settles and commits.

Which partitions are owned, and in which stage, is :class:`~._ownership.Ownership`'s: this
object only asks it (``writable``). A fenced batch is reported to ``on_fenced``: dropping the
partition is the takeover's (:class:`~._membership.Membership`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from deferline.engine import Emit
from deferline.schemas import DeadLetter
from deferline.topics import Settings, TopicNames

from ..member import MemberFenced, MemberProducer, Outgoing
from ._admission import PartitionBatch
from ._fold import TaskFold
from ._publishing import DecisionChain, EventOffsets
from ._routing import PartitionRouter

__all__ = ["BATCHES_AHEAD", "OwnedPartition", "PartitionWriters"]

logger = logging.getLogger(__name__)

BATCHES_AHEAD = 3
"""Folds whose batches are handed to the producers and unsent before the fold waits."""


@dataclass(eq=False)
class OwnedPartition:
    """A task partition this scheduler owns: its chain of batches, and the decisions taken
    while it could not write (sent if it is kept, dropped if it goes)."""

    number: int
    events_tp: TopicPartition
    chain: DecisionChain
    held: PartitionBatch = field(default_factory=PartitionBatch)
    applied: int = 0
    duplicates: int = 0


class PartitionWriters:
    """The owned partitions' chains of batches, and the publish lock.

    Args:
        settings: connection and topic layout.
        producer: the member's producer, which every chain writes through.
        fold: the fold whose drains are published (its table is read at each call).
        offsets: the event offsets the batches commit.
        router: the task partition of each decision.
        writable: whether a partition's decisions may be written now (the ownership's say).
        pool_records: the pool admission records to write after a drain, by partition.
        on_fenced: called once a batch was fenced (another scheduler owns its partition).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        producer: MemberProducer,
        fold: TaskFold,
        offsets: EventOffsets,
        router: PartitionRouter,
        writable: Callable[[int], bool],
        pool_records: Callable[[], dict[int, list[Outgoing]]],
        on_fenced: Callable[[], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.producer = producer
        self.fold = fold
        self.offsets = offsets
        self.router = router
        self.ensured_queues: set[str] = set()  # worker queues whose topics exist
        self.lock = asyncio.Lock()  # the publish lock
        self._writable = writable
        self._pool_records = pool_records
        self._on_fenced = on_fenced
        self._parts: dict[int, OwnedPartition] = {}
        self._handed: deque[list[asyncio.Task[None]]] = deque()
        self._published_gone = 0
        self._popped: set[OwnedPartition] = set()  # popped, their last batch not yet ended

    @property
    def transactional(self) -> bool:
        """True when the batches commit in transactions (known once the producer started)."""
        return bool(self.producer.transactional)

    # -- the partitions ---------------------------------------------------------------------

    def __contains__(self, partition: int) -> bool:
        return partition in self._parts

    def __getitem__(self, partition: int) -> OwnedPartition:
        return self._parts[partition]

    def get(self, partition: int) -> OwnedPartition | None:
        return self._parts.get(partition)

    def parts(self) -> list[OwnedPartition]:
        """The owned partitions, in the order they were added."""
        return list(self._parts.values())

    @property
    def published(self) -> int:
        """Records published, by every partition owned now or before."""
        parts = [*self._parts.values(), *self._popped]
        return self._published_gone + sum(part.chain.published for part in parts)

    def counts(self) -> dict[int, tuple[int, int]]:
        """Per owned partition: events applied and duplicates dropped since it was acquired."""
        return {p: (part.applied, part.duplicates) for p, part in sorted(self._parts.items())}

    def add(self, p: int) -> OwnedPartition:
        """A partition assigned: its chain."""
        events_tp = TopicPartition(self.names.task_events, p)
        chain = DecisionChain(
            self.settings,
            self.producer,
            self.fold,
            self.offsets,
            events_tp,
            ensured_queues=self.ensured_queues,
        )
        part = self._parts[p] = OwnedPartition(p, events_tp, chain)
        return part

    def pop(self, p: int) -> OwnedPartition | None:
        """Forget partition ``p`` (its batch in flight goes on: :meth:`close` it)."""
        part = self._parts.pop(p, None)
        if part is not None:
            self._popped.add(part)  # still counted in published: its batch may be sending
        return part

    async def close(self, part: OwnedPartition) -> None:
        """Let a popped partition's batch in flight end."""
        if part.chain.in_flight is not None:
            await asyncio.wait({part.chain.in_flight})
        if part in self._popped:
            self._popped.discard(part)
            self._published_gone += part.chain.published

    def close_all(self) -> None:
        """Forget every partition, without waiting for batches (the scheduler is closing)."""
        self._parts.clear()

    # -- writing ----------------------------------------------------------------------------

    def publish(
        self,
        out: Iterable[Emit],
        dead: Iterable[DeadLetter],
        *,
        offsets: Iterable[int] = (),
    ) -> list[asyncio.Task[None]]:
        """Hand each partition's share of ``out`` and ``dead`` (and its event offsets, for
        the ``offsets`` partitions) to its chain; a partition that cannot write now holds
        them. Synchronous; call with the publish lock. Returns the batches started (also
        kept to be awaited by :meth:`await_handed`)."""
        batches = self.router.route(out, dead)
        pool = self._pool_records()
        writable = self._writable
        started: list[asyncio.Task[None]] = []
        unsent = {p for p, part in self._parts.items() if part.held and writable(p)}
        for p in sorted({*batches, *offsets, *pool, *unsent}):
            batch = batches.get(p, PartitionBatch())
            batch.pool = pool.get(p, [])
            part = self._parts.get(p)
            if part is None:
                if batch:  # a bug: decisions for a partition not owned are not written
                    logger.error("decisions for a partition not owned dropped", extra={"p": p})
                continue
            if not writable(p):
                part.held.extend(batch)
                continue
            if part.held:
                held, part.held = part.held, PartitionBatch()
                held.extend(batch)
                batch = held
            task = part.chain.start(batch.out, batch.dead, offsets=True, extra=batch.pool)
            if task is not None:
                started.append(task)
        if started:
            self._handed.append(started)
        return started

    async def await_batches(self, batches: Iterable[asyncio.Task[None]]) -> None:
        """Wait for batches handed over; a fenced one is reported to ``on_fenced`` (another
        scheduler owns its partition now), any other failure is raised."""
        fenced = False
        for batch in batches:
            try:
                await asyncio.shield(batch)  # cancelled or not, the batch goes out
            except MemberFenced:
                fenced = True
        if fenced:
            await self._on_fenced()

    async def await_handed(self) -> None:
        """Wait for the folds handed over and sent, and for the oldest ones while more than
        :data:`BATCHES_AHEAD` are unsent (a failed batch's error is raised)."""
        while self._handed and (
            len(self._handed) > BATCHES_AHEAD or all(t.done() for t in self._handed[0])
        ):
            await self.await_batches(self._handed.popleft())

    def fenced(self) -> list[int]:
        """The partitions whose last batch was fenced, in order. Call with the publish lock."""
        lost = []
        for p, part in sorted(self._parts.items()):
            batch = part.chain.in_flight
            if (
                batch is not None
                and batch.done()
                and not batch.cancelled()
                and isinstance(batch.exception(), MemberFenced)
            ):
                lost.append(p)
        return lost

    def in_flight(self) -> list[asyncio.Task[None]]:
        """The last batch of each partition that has one."""
        return [p.chain.in_flight for p in self._parts.values() if p.chain.in_flight]

    @property
    def settled(self) -> bool:
        """True when nothing is held, on its way to the broker, or failed."""
        return not any(part.held or not part.chain.sent for part in self._parts.values())

    async def settle(self, partitions: Iterable[int] | None = None) -> None:
        """Wait for the batches in flight of ``partitions`` (default: all; fenced ones are
        reported)."""
        batches: list[asyncio.Task[None]] = []
        for p in list(self._parts) if partitions is None else partitions:
            part = self._parts.get(p)
            if part is not None and part.chain.in_flight is not None:
                batches.append(part.chain.in_flight)
        if batches:
            await asyncio.wait(batches)
            await self.await_batches(batches)

    async def commit(self, events: AIOKafkaConsumer | None, partitions: Iterable[int]) -> None:
        """Commit event offsets of ``partitions`` through the group (brokers without
        transactions), once what they caused is sent."""
        partitions = list(partitions)
        wanted = {TopicPartition(self.names.task_events, p) for p in partitions}
        offsets = {
            tp: offset
            for tp, offset in self.offsets.committable(self.fold.table.pending_refs()).items()
            if tp in wanted
        }
        for p in partitions:
            part = self._parts.get(p)
            if part is not None:
                await part.chain.settle()  # what is folded is sent before it is committed
        if not offsets or events is None:
            return
        await events.commit(offsets)
        self.offsets.committed.update(offsets)
