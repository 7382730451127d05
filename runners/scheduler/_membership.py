"""The scheduler's part in its consumer group: rebalances, taking partitions over, letting
them go.

:class:`Membership` is the scheduler's partition processor (driven by the member core's
:class:`~deferline.runners.member.MemberListener`: ``quiesce`` at a revocation, ``assign``
with each generation's partitions). It moves each partition through :class:`~._ownership.Ownership`
(the one state machine of a partition's lifecycle), adds and drops the partitions'
writers (:class:`~._writers.PartitionWriters`), takes new partitions over in the background
(:meth:`Membership._acquire`: wait for the previous owner's last transaction to end, fold
the partition to its end, join it to the table, publish what it calls for, read its events),
releases partitions without writing, and drops those whose batches the group fenced.

It owns the acquisition in progress, the reader acquisitions fold with, whether it is
closing, and how many records its takeovers folded; takeovers and fenced partitions it counts
in the member's :class:`~deferline.runners.member.MemberFigures`. The clients it uses (the
group member, the tasks reader, the pools channel; the settings and group they connect with)
are :class:`~._clients.SchedulerClients`'; the table, routing and event offsets it reaches
through the :class:`~._writers.PartitionWriters`, which write from them. What the scheduler
around it hears of it goes through :class:`MembershipShell`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.topics import start_client, stop_client

from .._aiokafka import client_of, request_rejoin
from .._local_state import CheckpointError
from ..member import MemberFigures, PartitionPhase
from ._admission import LEDGER_PARTITION
from ._checkpoint import Checkpoints
from ._checkpointer import Checkpointer
from ._clients import SchedulerClients
from ._fold import TaskFold
from ._ownership import Ownership
from ._publishing import SchedulerError
from ._standby import Standby
from ._writers import PartitionWriters

__all__ = ["Membership", "MembershipShell"]

logger = logging.getLogger(__name__)

TAKEOVER_FETCH_WAIT_MS = 20


class MembershipShell(Protocol):
    """What the scheduler around a :class:`Membership` hears of it."""

    def ownership_moved(self) -> None:
        """Partitions changed hands or phase: whoever waits on what is owned looks again."""

    def assignment_taken_over(self) -> None:
        """The assignment is taken over whole (nothing was acquired, or the acquisition is
        done)."""

    def partition_released(self, partition: int) -> None:
        """``partition`` is no longer this member's: forget what was kept of it (its lag)."""


class Membership:
    """Rebalances and partition takeover: the scheduler's
    :class:`~deferline.runners.member.PartitionProcessor`.

    Args:
        clients: the group member, the tasks reader and the pools channel, once connected;
            the settings and group they connect with, and the readers of the tasks topic.
        writers: the owned partitions' chains of batches and the publish lock, with the
            scheduler's fold (its table is read at each call), router and event offsets.
        ownership: each partition's stage; this object is the one that moves it.
        checkpoints: the local checkpoints, if any.
        checkpointer: checkpoints at a revocation.
        standby: the standby tables of the partitions not owned, if kept.
        figures: the member's figures (takeovers and fenced partitions are counted here).
        shell: told when ownership moved, an assignment is taken over, a partition released.
    """

    def __init__(
        self,
        clients: SchedulerClients,
        *,
        writers: PartitionWriters,
        ownership: Ownership,
        checkpoints: Checkpoints | None,
        checkpointer: Checkpointer,
        standby: Standby | None,
        figures: MemberFigures,
        shell: MembershipShell,
    ) -> None:
        self.clients = clients
        self.writers = writers
        self.ownership = ownership
        self.checkpoints = checkpoints
        self.checkpointer = checkpointer
        self.standby = standby
        self.figures = figures
        self.recovered_records = 0  # tasks-topic records the takeovers folded
        self._shell = shell
        self._closing = False
        self._group: asyncio.TaskGroup | None = None
        self._acquisition: asyncio.Task[None] | None = None
        self._absorbing = False
        self._reader: AIOKafkaConsumer | None = None  # the takeover reader, once started

    def supervise(self, group: asyncio.TaskGroup | None) -> None:
        """Run acquisitions in ``group`` (their failure is the scheduler's); None: none."""
        self._group = group

    @property
    def acquisition(self) -> asyncio.Task[None] | None:
        """The takeover in progress, if any."""
        return self._acquisition

    # -- rebalances -------------------------------------------------------------------------

    async def quiesce(self, partitions: frozenset[int]) -> None:
        """Stop writing for every partition (before anything awaits), abandon an acquisition
        in progress, let the batches in flight settle, commit, checkpoint. (Every one: which
        stay is the next assignment's to say, whichever were revoked.)"""
        if self._closing:
            return
        acquisition = self._acquisition
        if acquisition is not None and not acquisition.done() and not self._absorbing:
            acquisition.cancel()  # one joining its partitions to the table finishes that first
        async with self.writers.lock:  # free unless a fold or that join is under way
            quiesced, abandoned = self.ownership.revoke()
        if acquisition is not None:
            await asyncio.wait({acquisition})  # its reader is closed before its databases
        self._acquisition = None
        self._shell.ownership_moved()
        for p in abandoned:
            await self.release(p)
        await self.writers.settle(quiesced)
        if not self.writers.transactional and quiesced:
            try:
                await self.writers.commit(
                    self.clients.events, self.ownership.owned(PartitionPhase.QUIESCED)
                )
            except KafkaError as exc:  # the generation is over: the next owner reads again
                logger.warning("event offsets not committed at revocation: %s", exc)
        if self.clients.reader is not None:
            await self.checkpointer.now(self.clients.reader)

    def quiesce_cut_short(self, partitions: frozenset[int]) -> None:
        """Never called: the scheduler's revocation is not bounded (its listener has no
        ``within``)."""

    async def assign(self, generation: int, partitions: frozenset[int]) -> None:
        """Kept partitions write again at once, gone ones are dropped, new ones are taken
        over in the background (paused until then)."""
        events = self.clients.events
        if events is None or self._closing:
            return
        mine = set(partitions)
        async with self.writers.lock:
            change = self.ownership.assign(mine)
            for p in change.kept:
                part = self.writers[p]
                done = self.writers.offsets.done.get(part.events_tp)
                if done is not None:
                    events.seek(part.events_tp, done)
                self.writers.publish([], [], offsets=(p,))  # sends what was held while quiesced
            for p in change.acquired:
                self.writers.add(p)
        if change.acquired:
            events.pause(
                *(TopicPartition(self.clients.names.task_events, p) for p in change.acquired)
            )
        for p in change.released:
            await self.release(p)
        self._shell.ownership_moved()
        logger.info(
            "scheduler partitions assigned",
            extra={
                "group_id": self.clients.group_id,
                "generation": generation,
                "partitions": sorted(mine),
                "kept": list(change.kept),
                "acquired": list(change.acquired),
                "lost": list(change.released),
            },
        )
        if change.acquired and self._group is not None and not self._closing:
            self._acquisition = self._group.create_task(
                self._acquire(change.acquired), name="scheduler-acquire"
            )
        elif not change.acquired:
            self._shell.assignment_taken_over()

    async def rejoined(self, member_id: str) -> None:
        """This scheduler joined again as a new member: none of its partitions is kept; each
        is dropped without writing, and taken over afresh if assigned again."""
        if self.clients.events is None or self._closing:
            return
        async with self.writers.lock:
            lost = self.ownership.owned()
            for p in lost:
                self.ownership.lose(p)
        if not lost:
            return
        logger.warning(
            "scheduler rejoined as a new member: its partitions are taken over afresh",
            extra={"group_id": self.clients.group_id, "member_id": member_id, "partitions": lost},
        )
        for p in lost:  # those assigned again are acquired, their events paused till then
            await self.release(p)

    # -- takeover ---------------------------------------------------------------------------

    async def _acquire(self, numbers: tuple[int, ...]) -> None:
        """Take partitions over: wait until their old owner's last transaction has ended,
        fold them to their end, join them to the table, publish what they call for, then read
        their events."""
        began = time.monotonic()
        clients = self.clients
        reader, events, channel = clients.reader, clients.events, clients.pool_channel
        assert reader is not None
        assert events is not None
        assert channel is not None
        parts = [self.writers[p] for p in numbers]
        events_tps = [part.events_tp for part in parts]
        transactional = self.writers.transactional
        try:
            if transactional:
                # The offsets first, once no transaction holds them: the previous owner's
                # last round has then ended (committed, or aborted by the group's fence or
                # the broker's timeout), so the ends read next hold all it committed.
                committed = await self.writers.producer.committed(events_tps)
            stable = time.monotonic()
            warm = self.standby.take(numbers) if self.standby is not None else {}
            table = self.writers.fold.table
            fold = TaskFold(table.pools, ledger=table.ledger)
            if self.checkpoints is not None:
                fold.table.track_changes()
            consumer = await self._takeover_reader()
            await self._track(consumer)
            try:
                # Read with this reader before it fetches: the other consumers may have a
                # fetch waiting at the broker, which answers a connection's requests in
                # order (a request behind it would wait up to fetch_wait_ms).
                ends = await consumer.end_offsets([channel.tp, *events_tps])
                if LEDGER_PARTITION in numbers:
                    await channel.lead(ends[channel.tp])  # the previous grants are decided
                side = clients.tasks_reader(consumer, fold)
                await side.recover(
                    self.clients.names.tasks,
                    set(numbers),
                    self.checkpoints,
                    prefix=self.clients.settings.topic_prefix,
                    group=self.clients.group_id,
                    total=self.writers.router.partitions,
                    warm=warm,
                )
                positions = dict(side.positions)
            finally:  # it fetches nothing until the next acquisition assigns it partitions
                consumer.pause(*consumer.assignment())  # (unsubscribe() can kill its fetcher)
            folded = time.monotonic()
            self.recovered_records += side.recovered_records
            if transactional:
                # Where the group's reading starts when nothing was committed: a round's
                # batches carry an offset of their partition (MemberProducer).
                unread = [tp for tp in events_tps if committed[tp] is None]
                if unread:
                    committed.update(await consumer.beginning_offsets(unread))
            else:
                committed = {tp: await events.committed(tp) for tp in events_tps}
            if channel.position < ends[channel.tp]:  # no want published twice
                async with clients.pool_reads:
                    await channel.catch_up(clients.fetch_wait_ms, end=ends[channel.tp])
            caught_up = time.monotonic()
        except CheckpointError as exc:
            raise SchedulerError(f"cannot open the scheduler checkpoint: {exc}") from exc
        except KafkaError as exc:
            raise SchedulerError(f"scheduler could not take over {numbers}: {exc}") from exc
        async with self.writers.lock:
            locked = time.monotonic()
            self._absorbing = True  # a revocation now waits for the end of this
            try:
                self.writers.fold.table.absorb(fold.table)
                await reader.take(positions)
                for part in parts:
                    channel.own(part.number, self.writers.fold.table)
                    self.ownership.acquired(part.number)
                    offset = committed[part.events_tp]
                    if offset is not None:
                        self.writers.offsets.committed[part.events_tp] = offset
                    if transactional:
                        assert offset is not None
                        events.seek(part.events_tp, offset)  # read from the stable offset
                    else:
                        # Events below were read before, by a predecessor that may have died
                        # between a batch's task states and its RunTasks (no transactions):
                        # folding them again re-sends the RunTask of a task still queued
                        # on one of them (see TaskTable.apply(resend=...)).
                        self.writers.offsets.reread[part.events_tp] = ends[part.events_tp]
                handed = self.writers.publish(self.writers.fold.drain(), [])
                events.resume(*events_tps)
            finally:
                self._absorbing = False
        resumed = time.monotonic()
        await self.writers.await_batches(handed)
        seconds = time.monotonic() - began
        self.figures.took_over(len(numbers), seconds)
        logger.info(
            "scheduler partitions acquired",
            extra={
                "group_id": self.clients.group_id,
                "partitions": list(numbers),
                "transactional": transactional,
                "takeover_seconds": round(seconds, 3),
                "tasks": len(self.writers.fold.table),
                "from_standby": side.from_standby,
                "records_folded": side.recovered_records,
                "phases": {
                    "stable_offsets": round(stable - began, 3),
                    "fold": round(folded - stable, 3),
                    "catch_up": round(caught_up - folded, 3),
                    "lock": round(locked - caught_up, 3),
                    "absorb": round(resumed - locked, 3),
                    "first_batch": round(time.monotonic() - resumed, 3),
                },
            },
        )
        self._shell.assignment_taken_over()

    async def prepare(self) -> None:
        """Start the takeover reader before joining, with the metadata of every topic it
        reads: the first acquisition waits for neither."""
        await self._track(await self._takeover_reader())

    async def _track(self, consumer: AIOKafkaConsumer) -> None:
        """Have the takeover reader know the partitions of the tasks, pools and events topics
        before it asks for their ends. Asked for the ends of a partition it does not know,
        aiokafka refreshes its metadata, then sleeps ``retry_backoff_ms`` (100 ms) before it
        asks again; and each assignment (of the tasks topic alone) narrows the topics it
        tracks, so a metadata refresh between two acquisitions forgets the others. Waits for
        one metadata request when a topic is not tracked, else for nothing."""
        channel = self.clients.pool_channel
        topics = [self.clients.names.tasks, self.clients.names.task_events]
        if channel is not None:
            topics.append(channel.tp.topic)
        await client_of(consumer).set_topics(topics)

    async def _takeover_reader(self) -> AIOKafkaConsumer:
        """The consumer acquisitions fold with, started once and kept (starting one costs a
        bootstrap and new connections: 0.1 to 0.4 s under load). Its empty fetches
        wait briefly: it reads up to ends it knows, and a fetch still waiting at the broker
        would hold the next acquisition's first request behind it."""
        if self._reader is None:
            consumer = self.clients.consumer(fetch_wait_ms=TAKEOVER_FETCH_WAIT_MS)
            await start_client(consumer, grace=5.0, name="takeover reader")  # closed if it fails
            self._reader = consumer
        return self._reader

    def stop_serving(self) -> None:
        """From now on, serve no assignment and start no takeover (the scheduler closes)."""
        self._closing = True

    async def close(self) -> None:
        """Stop the takeover reader (the scheduler is closing)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            await stop_client(reader, grace=5.0, name="takeover reader")

    # -- letting go -------------------------------------------------------------------------

    async def release(self, p: int) -> None:
        """Drop partition ``p`` without writing: its tasks, offsets, reader position,
        checkpoint database; the standby folds it again from its start."""
        part = self.writers.pop(p)
        channel = self.clients.pool_channel
        if channel is not None:
            channel.disown(p)
            if p == LEDGER_PARTITION:
                channel.resign()
        self.writers.fold.table.drop_where(lambda key: self.writers.router.partition_of(key) == p)
        self.writers.router.forget(p)
        if self.standby is not None:
            self.standby.follow([p])
        if part is None:
            return
        self.writers.fold.forget_unread_writes()  # those of the partition are no longer awaited
        self.writers.offsets.forget(part.events_tp)
        self._shell.partition_released(p)
        if self.clients.reader is not None:
            await self.clients.reader.drop({p})
        if self.checkpoints is not None:
            await self.checkpoints.close_partition(p)
        await self.writers.close(part)

    async def drop_fenced(self) -> None:
        """Drop every partition whose last batch was fenced, without writing, and rejoin."""
        async with self.writers.lock:
            # A partition a concurrent call is already dropping is not dropped twice.
            lost = [p for p in self.writers.fenced() if self.ownership.lose(p)]
        for p in lost:
            if self.clients.events is not None:
                self.clients.events.pause(TopicPartition(self.clients.names.task_events, p))
            await self.release(p)
        self.figures.fenced(len(lost))
        if lost:
            self._shell.ownership_moved()
            logger.warning(
                "scheduler fenced: partitions taken over by another member dropped",
                extra={"group_id": self.clients.group_id, "partitions": lost},
            )
            if self.clients.events is not None:
                request_rejoin(self.clients.events)
