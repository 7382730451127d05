"""Trigger events in: the loop that folds the owned tasks.events partitions.

:class:`EventIntake` owns the reading of the group member's fetches: each batch of a
partition that may write now is folded (counted per partition), its decisions handed to the
writers with the event offsets read, and, every ``commit_interval``, offsets that moved
without output are committed. The table is the fold's, the offsets
:class:`~._publishing.EventOffsets`', the partitions' stages :class:`~._ownership.Ownership`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.schemas import DeadLetter
from deferline.topics import known_position, trace_receive

from ..member import PartitionPhase
from ._fold import TaskFold
from ._ownership import Ownership
from ._publishing import EventOffsets, SchedulerError
from ._writers import PartitionWriters

__all__ = ["EventIntake"]

logger = logging.getLogger(__name__)


class EventIntake:
    """Folds the events of the owned partitions and hands their decisions over.

    Args:
        topic: the tasks.events topic (named in errors).
        fold: the scheduler's fold.
        writers: the owned partitions' chains, and the publish lock.
        ownership: which partitions may write now.
        offsets: how far each events partition is read.
        max_records: most records folded per fetch.
        commit_interval: seconds between offset commits without transactions (and between
            offsets-only transactions with them).
        dead: the dead letter of an unreadable record.
    """

    def __init__(
        self,
        topic: str,
        *,
        fold: TaskFold,
        writers: PartitionWriters,
        ownership: Ownership,
        offsets: EventOffsets,
        max_records: int,
        commit_interval: float,
        dead: Callable[[object, str], DeadLetter],
    ) -> None:
        self.topic = topic
        self.fold = fold
        self.writers = writers
        self.ownership = ownership
        self.offsets = offsets
        self.max_records = max_records
        self.commit_interval = commit_interval
        self._dead = dead

    async def run(self, events: AIOKafkaConsumer) -> None:
        """Fetch, fold, hand over; forever."""
        writers = self.writers
        last_commit = time.monotonic()
        counters = self.fold.table.counters
        folded: set[TopicPartition] = set()  # partitions folded since the last commit round
        while True:
            try:
                batches = await events.getmany(timeout_ms=1000, max_records=self.max_records)
            except KafkaError as exc:
                if not getattr(exc, "retriable", False):
                    raise SchedulerError(f"cannot read {self.topic}: {exc}") from exc
                logger.warning("events fetch failed; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)
                continue
            if batches:
                began = time.monotonic()
                async with writers.lock:
                    dead: list[DeadLetter] = []
                    read: dict[TopicPartition, int] = {}
                    for tp, messages in batches.items():
                        part = writers.get(tp.partition)
                        if not (messages and part and self.ownership.writable(tp.partition)):
                            continue  # not this member's to apply now: read again by its owner
                        reread = self.offsets.reread.get(tp, 0)
                        applied, duplicates = counters.events_applied, counters.events_duplicate
                        for message in messages:
                            trace_receive(tp.topic, message.value, message.headers)
                            bad = self.fold.event(
                                message.value,
                                ref=(tp, message.offset),
                                resend=message.offset < reread,
                            )
                            if bad is not None:
                                dead.append(self._dead(message, bad))
                        part.applied += counters.events_applied - applied
                        part.duplicates += counters.events_duplicate - duplicates
                        read[tp] = messages[-1].offset + 1
                    self.offsets.done.update(read)
                    folded.update(read)
                    out = self.fold.drain()
                    writers.publish(out, dead, offsets={tp.partition for tp in read})
                if writers.transactional:
                    last_commit = time.monotonic()  # the batches' transactions carry offsets
                logger.debug(
                    "events batch folded",
                    extra={
                        "events": sum(len(messages) for messages in batches.values()),
                        "out": len(out),
                        "fold_seconds": round(time.monotonic() - began, 4),
                    },
                )
            # The next batches are fetched and folded while these are sent (each partition's
            # after the one before it): the fold, not the broker's time to complete a
            # transaction, sets the pace. At most BATCHES_AHEAD folds are handed over and
            # unsent; a failed batch's error stops us (a fenced one drops its partition).
            await writers.await_handed()
            now = time.monotonic()
            if now - last_commit >= self.commit_interval:
                # Offsets that moved without output (orphans dropped, pending resolved).
                async with writers.lock:
                    owned = self.ownership.owned(PartitionPhase.ACTIVE)
                    await self._past_markers(events, owned, busy=folded)
                    if writers.transactional:
                        writers.publish([], [], offsets=set(owned))
                    else:
                        await writers.commit(events, owned)
                last_commit = now
                folded.clear()

    async def _past_markers(
        self, events: AIOKafkaConsumer, owned: Iterable[int], *, busy: set[TopicPartition]
    ) -> None:
        """Move how far each idle owned partition is read up to the consumer's position.

        Past a partition's last event come the markers of the transactions that wrote it
        (the triggerers write in transactions on Apache Kafka; one per writer whose
        transaction touched the partition): they take offsets but are no records, and the
        consumer's position has skipped them. Committed at the last event, the group would
        show that many records of lag forever (end offset less committed offset, as every
        tool computes it); committed at the position, 0 once everything is folded.

        Only partitions not folded since the last round (``busy``): a busy one's next batch
        carries its offsets, and an offsets-only transaction for its markers would cost a
        round trip for nothing. An active partition's position is past what its fetches
        returned, and all of that was folded (a rebalance seeks a kept partition back to
        how far it is folded): what lies between is markers or aborted records only.
        """
        done, committed = self.offsets.done, self.offsets.committed
        for p in owned:
            tp = TopicPartition(self.topic, p)
            if tp in busy:
                continue
            position = await known_position(events, tp)
            if position is not None and position > done.get(tp, committed.get(tp, -1)):
                done[tp] = position
