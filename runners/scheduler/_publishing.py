"""The scheduler's outgoing side: per owned partition, batches of decisions sent one after
another through the member's producer, and the event offsets they may commit."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Sequence

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from deferline.engine import Emit
from deferline.schemas import DeadLetter, DeferlineError
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from ..member import MemberProducer, Outgoing
from ._fold import TaskFold
from ._records import committable, waves

__all__ = ["DecisionChain", "EventOffsets", "SchedulerError"]


class SchedulerError(DeferlineError):
    """The scheduler could not read or publish (broker unreachable, topic missing...)."""


class EventOffsets:
    """Per tasks.events partition: how far the fold has read (``done``), what the group has
    committed, and, after a takeover without transactions, where the partition ended then
    (``reread``: events below were read before, by a predecessor)."""

    __slots__ = ("committed", "done", "reread")

    def __init__(self) -> None:
        self.done: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.reread: dict[TopicPartition, int] = {}

    def clear(self) -> None:
        self.done.clear()
        self.committed.clear()

    def committable(
        self, pending: Iterable[Hashable], only: TopicPartition | None = None
    ) -> dict[TopicPartition, int]:
        """Offsets that may be committed (of ``only``, if given)."""
        found = committable(self.done, pending, self.committed)
        if only is not None:
            return {only: found[only]} if only in found else {}
        return found

    def forget(self, tp: TopicPartition) -> None:
        """The partition went to another scheduler."""
        self.done.pop(tp, None)
        self.committed.pop(tp, None)
        self.reread.pop(tp, None)


class DecisionChain:
    """Hands one task partition's batches of decisions to the member's producer, each after
    the one before it (the partitions' chains run side by side, and their batches handed
    over together share a transaction).

    A batch is encoded (and the task states it writes noted in the fold, to be read back
    without decoding) when it is handed over; it is sent once the batch before it is
    acknowledged, and nothing goes out past a batch that failed. A batch handed over while
    the one before it is still waiting to be sent joins it (its waves appended in order, its
    offsets taking the place of the earlier ones): a partition has at most one batch in
    flight and one waiting, so a slow transaction makes the next one larger, not the queue
    longer.
    """

    def __init__(
        self,
        settings: Settings,
        producer: MemberProducer,
        fold: TaskFold,
        offsets: EventOffsets,
        events_tp: TopicPartition,
        *,
        ensured_queues: set[str],
    ) -> None:
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.producer = producer
        self.fold = fold
        self.offsets = offsets
        self.events_tp = events_tp
        self.published = 0
        self.in_flight: asyncio.Task[None] | None = None
        self.ensured_queues = ensured_queues  # shared by the partitions' chains
        self._waiting: _Waiting | None = None  # the last batch handed over, not sending yet

    def start(
        self,
        out: Sequence[Emit],
        dead: Sequence[DeadLetter] = (),
        *,
        offsets: bool = False,
        extra: Sequence[Outgoing] = (),
    ) -> asyncio.Task[None] | None:
        """Hand ``out`` to the producer, after the batch in flight; returns its task.

        Synchronous up to the task, so a batch is encoded, and its event offsets are taken,
        at the moment of the drain that made it (an event still pending then is not
        committed past, even if a later fold resolves it). Records go out in waves:
        CancelRequests (the "removed" record that follows one is the proof it was sent),
        task states, then RunTasks (a worker's "running" must land after "queued"). In a
        transaction the waves and the event offsets commit together; without, each wave is
        acknowledged before the next. ``extra`` records (pool admission's) go with the task
        states. In a transaction a batch with records always carries an offset of the
        partition (its last committed one if nothing moved), so that the partition's next
        owner, reading its offsets, waits for the transaction to end (see
        :class:`~deferline.runners.member.MemberProducer`). Call with the publish lock."""
        transactional = self.producer.transactional
        commit = (
            self.offsets.committable(self.fold.table.pending_refs(), self.events_tp)
            if offsets and transactional
            else {}
        )
        if not out and not dead and not commit and not extra:
            return None
        if transactional and self.events_tp not in commit:
            commit[self.events_tp] = self.offsets.committed[self.events_tp]
        queues = {e.worker_queue for e in out if e.worker_queue is not None}
        batch = waves(self.names, out, dead, written=self.fold.written)
        batch[1].extend(extra)
        waiting = self._waiting
        if waiting is not None and not waiting.sending:
            for joined, wave in zip(waiting.batch, batch, strict=True):
                joined.extend(wave)
            waiting.queues |= queues
            waiting.commit.update(commit)  # later offsets, taken at this drain
            assert self.in_flight is not None
            return self.in_flight
        waiting = _Waiting(batch, queues, commit)
        task = asyncio.create_task(
            self._send_after(self.in_flight, waiting),
            name=f"scheduler-publish-{self.events_tp.partition}",
        )
        self._waiting = waiting
        self.in_flight = task
        return task

    async def publish(
        self, out: Sequence[Emit], dead: Sequence[DeadLetter] = (), *, offsets: bool = False
    ) -> None:
        """Publish ``out`` after every batch started before it. Call with the publish lock."""
        sent = self.start(out, dead, offsets=offsets)
        if sent is not None:
            await asyncio.shield(sent)  # cancelled or not, the batch goes out

    async def settle(self) -> None:
        """Wait until every batch handed over is sent (raises a failed one's error)."""
        if self.in_flight is not None:
            await asyncio.shield(self.in_flight)

    @property
    def sent(self) -> bool:
        """True when no batch is on its way to the broker and the last one did not fail."""
        batch = self.in_flight
        return batch is None or (
            batch.done() and not batch.cancelled() and batch.exception() is None
        )

    async def _send_after(self, previous: asyncio.Task[None] | None, waiting: _Waiting) -> None:
        try:
            if previous is not None:
                await asyncio.shield(previous)  # raises its error: nothing goes out past it
        finally:
            waiting.sending = True  # from here on, a new batch waits behind this one
        batch, queues, commit = waiting.batch, waiting.queues, waiting.commit
        for worker_queue in sorted(queues - self.ensured_queues):
            await ensure_topics(
                self.settings, topic_specs(self.settings, worker_queues=[worker_queue])
            )
            self.ensured_queues.add(worker_queue)
        try:
            await self.producer.write(batch, commit)
        except KafkaError as exc:
            raise SchedulerError(f"cannot publish scheduler decisions: {exc}") from exc
        self.offsets.committed.update(commit)
        self.published += sum(len(wave) for wave in batch)


class _Waiting:
    """A batch handed to a chain and not sending yet: later batches join it."""

    __slots__ = ("batch", "commit", "queues", "sending")

    def __init__(
        self,
        batch: tuple[list[Outgoing], list[Outgoing], list[Outgoing]],
        queues: set[str],
        commit: dict[TopicPartition, int],
    ) -> None:
        self.batch = batch
        self.queues = queues
        self.commit = commit
        self.sending = False
