"""The scheduler: folds trigger events into task state and sends resumed tasks to workers.

Every scheduler is active: each is a member of the consumer group ``<prefix>scheduler``
subscribed to **tasks.events** (the events of every trigger queue, which triggerers copy
there keyed by task; it has the tasks topic's partition count and numbering), and owning
partition *p* of tasks.events means owning partition *p* of the **tasks** topic: the member
folds only its partitions and is the only writer of their decisions. Partitions are spread
by the triggerers' sticky assignor (a join takes about 1/N, only from existing members; a
leave moves only the leaver's) with optional static membership. One scheduler alone owns
every partition and behaves as the single scheduler always did.

On assignment of *p* (see :mod:`._ownership` for the lifecycle): the events partition is
paused; *p*'s producer starts first (on Apache Kafka its transactional id
``<group>.<p>`` fences the previous owner: see :mod:`._publisher`); *p*'s checkpoint is
restored and the tasks partition folded to its end, into a table of its own that then joins
the scheduler's; the decisions the state calls for are published; events of *p* are read
from the group's committed offset. On revocation every partition stops writing before
anything awaits, the batches in flight settle, offsets are committed (without
transactions), the checkpoints are written; the next assignment says which partitions were
kept (writing again at once) and which are gone (dropped without writing; their producers
closed). A partition whose producer is fenced (this member was paused past its session) is
dropped at once, and the member rejoins.

The parts, each owning its state: :class:`~._fold.TaskFold` (the table of the owned
partitions, no I/O), :class:`~._ownership.Ownership` (each partition's stage),
:class:`~._tasks_topic.TasksReader` (the tasks consumer and its positions),
:class:`~._checkpoint.Checkpoints` (one database per tasks partition) and
:class:`~._checkpointer.Checkpointer` (when the table may be checkpointed),
:class:`~._intake.EventIntake` (the events fetched, folded),
:class:`~._housekeeping.Housekeeping` (orphans, retention, lag),
:class:`~._writers.PartitionWriters` (per owned partition a producer and a chain of batches
sent one after another; the publish lock), :class:`~._publishing.EventOffsets`, and
:class:`~._admission.LedgerPoolAdmission` (pools, through the pool ledger), and
:class:`~._pools.PoolChannel` (the pools topic, followed by a loop of its own).
:class:`Scheduler` is the I/O shell that runs their loops and the rebalance listener; its
own lifecycle is :class:`~._phase.Phase`.

Pools are exact whatever the membership: tasks of limited pools are admitted through the
pool ledger (see :mod:`._pools`); the owner of partition 0 keeps the ledger and writes its
grants in that partition's transaction. One table for every owned partition (rather than
one per partition); a partition joins it whole (:meth:`TaskTable.absorb`, once the pools
topic is read to its end) and leaves it whole (:meth:`TaskTable.drop_where`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import KafkaError
from deferline.engine import LedgerAdmission, Pools, TaskTable
from deferline.schemas import DeadLetter
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    make_consumer,
    stop_client,
    topic_specs,
)
from prometheus_client import CollectorRegistry

from .._aiokafka import (
    client_of,
    group_generation,
    join_once,
    leave_from_generation_zero,
    request_rejoin,
)
from .._local_state import CheckpointError
from .._metrics import MetricsServer
from ..triggerer import LONG_POLL_MS, answers_fetches_early
from ..triggerer._sticky_assignor import StickyAssignor
from ._admission import LEDGER_PARTITION, LedgerPoolAdmission
from ._checkpoint import Checkpoints
from ._checkpointer import Checkpointer
from ._cli import scheduler_command
from ._fold import TaskFold
from ._housekeeping import Housekeeping
from ._intake import EventIntake
from ._metrics import SchedulerCollector
from ._ownership import Hold, Ownership
from ._phase import Phase, PhaseMachine
from ._pools import PoolChannel
from ._publisher import Outgoing, SchedulerFenced
from ._publishing import EventOffsets, SchedulerError
from ._records import dead_letter
from ._routing import PartitionRouter
from ._tasks_topic import TasksReader
from ._writers import PartitionWriters

__all__ = ["Scheduler", "SchedulerError", "SchedulerFenced", "scheduler_command"]

logger = logging.getLogger(__name__)


class Scheduler(Lifecycle):
    """Fold the owned partitions of the tasks and tasks.events topics into task state;
    publish their decisions.

    Args:
        settings: connection and topic layout.
        pools: slot counts per pool (default: ``default_pool`` with 128 slots, like Airflow).
        worker_queues: worker queues whose topics are created at start; others are created
            the first time a task names them.
        group_id: consumer group of the schedulers and their event offsets; the prefix of
            the transactional ids (``<group>.<partition>``); default ``<prefix>scheduler``.
        group_instance_id: static membership: a scheduler restarted with the same id within
            the session timeout gets its partitions back without a rebalance (it also does
            not leave the group when it stops: its partitions wait for the session to end).
        metrics_port: serve Prometheus metrics on this port (0: any free port; None: off).
        orphan_check_interval: how often events held pending are checked against the tasks
            topic's end; one that still has no deferral once the scheduler has read past it
            is dropped as an orphan (for instance a DeferRequest published by another system).
        commit_interval: seconds between offset commits of tasks.events when the broker
            has no transactions (with them, offsets go in every batch's transaction).
        max_records: most records folded per fetch (and so per published batch).
        session_timeout: group session timeout: how long a silent scheduler keeps its
            partitions before the others take them over.
        transactions: write in Kafka transactions (True), never (False), or when the broker
            has them (None).
        finished_retention: seconds (by record time) a finished task stays in memory.
        state_dir: directory of the local checkpoints of the task table, one database per
            tasks partition (see :mod:`._checkpoint`); an acquired partition is restored from
            its checkpoint and only the tail is folded. ``None``: no checkpoint. Schedulers
            on one host may share it: a partition's database is used by the one process that
            holds it (RocksDB locks it), the others fold that partition from the topic.
        checkpoint_interval: seconds between checkpoints (and one at a clean stop).
        checkpoint_max_age: an older checkpoint is discarded: compaction may have removed
            tombstones written since (keep it below the tasks topic's delete.retention.ms).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        pools: Pools | Mapping[str, int] | None = None,
        worker_queues: Sequence[str] = (),
        group_id: str | None = None,
        group_instance_id: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        orphan_check_interval: float = 5.0,
        commit_interval: float = 1.0,
        max_records: int = 10_000,
        session_timeout: float = 10.0,
        transactions: bool | None = None,
        finished_retention: float = 3600.0,
        state_dir: str | Path | None = None,
        checkpoint_interval: float = 10.0,
        checkpoint_max_age: float = 12 * 3600.0,
    ) -> None:
        if isinstance(pools, Mapping):
            pools = Pools(slots=dict(pools))
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.group_id = group_id or f"{settings.topic_prefix}scheduler"
        self.group_instance_id = group_instance_id
        self.max_records = max_records
        self.session_timeout = session_timeout
        self.router = PartitionRouter()
        self.pool_channel: PoolChannel | None = None  # made at start (it needs the partitions)
        self.fold = TaskFold(pools, ledger=LedgerAdmission(partition_of=self.router.partition_of))
        self.checkpoints = (
            Checkpoints(state_dir, interval=checkpoint_interval, max_age=checkpoint_max_age)
            if state_dir is not None
            else None
        )
        self.offsets = EventOffsets()
        self.ownership = Ownership()
        self.phase = PhaseMachine()
        self.writers = PartitionWriters(
            settings,
            group_id=self.group_id,
            fold=self.fold,
            offsets=self.offsets,
            router=self.router,
            transactions=transactions,
            writable=self.ownership.writable,
            pool_records=self._pool_records,
            on_fenced=self._drop_fenced,
        )
        self.checkpointer = Checkpointer(self.checkpoints, fold=self.fold, writers=self.writers)
        self.housekeeping = Housekeeping(
            fold=self.fold,
            router=self.router,
            offsets=self.offsets,
            writers=self.writers,
            group_id=self.group_id,
            interval=orphan_check_interval,
            finished_retention=finished_retention,
        )
        self.intake = EventIntake(
            self.names.task_events,
            fold=self.fold,
            writers=self.writers,
            ownership=self.ownership,
            offsets=self.offsets,
            max_records=max_records,
            commit_interval=commit_interval,
            dead=self._dead,
        )
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(self))
        self._metrics = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )
        self._worker_queues = {"default", *worker_queues}
        self._pool_reads = asyncio.Lock()  # one read of the pools topic at a time
        self._reader: TasksReader | None = None
        self._events: AIOKafkaConsumer | None = None
        self._assignor = StickyAssignor()
        # Apache Kafka answers a fetch once data arrives: a long wait only saves idle CPU.
        # Tansu holds every fetch for the whole wait: there it bounds the latency the
        # scheduler adds, so it stays short. Chosen at start from the brokers' API versions.
        self._fetch_wait_ms = 100
        self._main: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._acquisition: asyncio.Task[None] | None = None
        self._absorbing = False
        self._closing = False
        self._owner_moved = asyncio.Event()
        self._recovered_records = 0
        self.recovery_seconds: float | None = None  # the last acquisition's
        self.takeovers = 0  # partitions acquired
        self.takeover_seconds: float | None = None  # the last acquisition's
        self.rebalances = 0

    # -- figures ----------------------------------------------------------------------------

    @property
    def table(self) -> TaskTable:
        return self.fold.table

    @property
    def admission(self) -> LedgerPoolAdmission:
        """Pool admission through the pool ledger (once started)."""
        assert self.pool_channel is not None, "start the scheduler first"
        return LedgerPoolAdmission(self.pool_channel, self.router.partition_of)

    @property
    def bad_records(self) -> int:
        return self.fold.bad_records

    @property
    def published(self) -> int:
        return self.writers.published

    @property
    def recovered_records(self) -> int:
        return self._recovered_records

    @property
    def lag(self) -> dict[str, int]:
        """Records not yet read, per input."""
        return self.housekeeping.lag

    @property
    def events_lag(self) -> dict[int, int]:
        """Events not yet folded, per owned tasks.events partition."""
        return self.housekeeping.events_lag

    @property
    def restore_seconds(self) -> float | None:
        return self.checkpoints.restore_seconds if self.checkpoints is not None else None

    @property
    def restored_tasks(self) -> int:
        return self.checkpoints.restored_tasks if self.checkpoints is not None else 0

    @property
    def checkpoint_mismatches(self) -> int:
        return self.checkpoints.mismatches if self.checkpoints is not None else 0

    @property
    def owned(self) -> list[int]:
        """The task partitions this scheduler writes for now."""
        return self.ownership.owned(Hold.ACTIVE)

    def partition_counts(self) -> dict[int, tuple[int, int]]:
        """Per owned partition: events applied and duplicates dropped since it was acquired."""
        return self.writers.counts()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on, once started."""
        return self._metrics.port if self._metrics is not None else None

    @property
    def ready(self) -> bool:
        """True once the scheduler has joined the group and taken over what it was given."""
        return self.phase.is_(Phase.RUNNING)

    @property
    def active(self) -> bool:
        """True while this scheduler owns at least one partition and writes for it."""
        return bool(self.owned)

    @property
    def transactional(self) -> bool:
        """True when the scheduler writes in Kafka transactions (known once it owns one)."""
        return bool(self.writers.transactional)

    async def wait_ready(self) -> None:
        """Wait until :attr:`ready`; raises if the scheduler failed first."""
        await self._wait_until(lambda: self.ready)

    async def wait_active(self) -> None:
        """Wait until :attr:`active`; raises if the scheduler failed first."""
        await self._wait_until(lambda: self.active)

    async def wait_owning(self, count: int) -> None:
        """Wait until this scheduler writes for ``count`` partitions (and is ready)."""
        await self._wait_until(lambda: self.ready and len(self.owned) == count)

    async def _wait_until(self, done: Any) -> None:
        while not done():
            if self.phase.is_(Phase.FAILED, Phase.STOPPED) or (
                self._main is not None and self._main.done()
            ):
                if self._main is not None and self._main.done():
                    await self._main  # raises its error
                raise SchedulerError("the scheduler stopped first")
            moved = self._owner_moved
            watch: set[asyncio.Future[Any]] = {asyncio.ensure_future(moved.wait())}
            if self._main is not None:
                watch.add(self._main)
            try:
                await asyncio.wait(watch, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in watch:
                    if waiter is not self._main:
                        waiter.cancel()

    def _moved(self) -> None:
        self._owner_moved.set()
        self._owner_moved = asyncio.Event()

    async def start(self) -> None:
        """Create missing topics, connect, and join the group (returns before any
        partition is taken over)."""
        if self._main is not None:
            return
        try:
            await ensure_topics(
                self.settings, topic_specs(self.settings, worker_queues=self._worker_queues)
            )
            self.writers.ensured_queues |= self._worker_queues
            if self._metrics is not None:
                await self._metrics.start()
            if await answers_fetches_early(self.settings):
                self._fetch_wait_ms = LONG_POLL_MS
            tasks = self._consumer()
            self._reader = TasksReader(
                tasks, self.fold, max_records=self.max_records, dead=self._dead
            )
            await tasks.start()
            self.router.partitions = len(await self._tasks_partitions(tasks))
            self.pool_channel = PoolChannel(
                self.settings,
                pools=self.table.pools,
                partitions=self.router.partitions,
                partition_of=self.router.partition_of,
                consumer=make_consumer(
                    self.settings, group_id=None, fetch_max_wait_ms=self._fetch_wait_ms
                ),
            )
            await self.pool_channel.start()
            self._events = self._member()
            await self._events.start()
            leave_from_generation_zero(self._events)
            join_once(self._events)
        except KafkaError as exc:
            await self._close()
            raise SchedulerError(f"cannot connect the scheduler: {exc}") from exc
        except BaseException:
            await self._close()
            raise
        if self.checkpoints is not None:
            self.table.track_changes()
        self.phase.move(Phase.JOINING)
        self._main = asyncio.create_task(self._run(), name="deferline-scheduler")

    async def stop(self) -> None:
        """Stop writing, settle and commit what is published, checkpoint, leave the group,
        disconnect. Idempotent."""
        main, self._main = self._main, None
        try:
            if main is not None:
                await self._leave(main)
        finally:
            await self._close()

    async def wait(self) -> None:
        """Run until stopped; raises if a loop fails."""
        if self._main is not None:
            await self._main

    def _consumer(self) -> AIOKafkaConsumer:
        return make_consumer(
            self.settings,
            group_id=None,
            max_poll_records=None,
            fetch_max_wait_ms=self._fetch_wait_ms,
        )

    def _member(self) -> AIOKafkaConsumer:
        session_ms = int(self.session_timeout * 1000)
        return make_consumer(
            self.settings,
            group_id=self.group_id,
            max_poll_records=None,
            fetch_max_wait_ms=self._fetch_wait_ms,
            session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(100, session_ms // 10),  # a rebalance is seen sooner
            rebalance_timeout_ms=max(session_ms, 30_000),
            partition_assignment_strategy=(self._assignor, RoundRobinPartitionAssignor),
            group_instance_id=self.group_instance_id,
        )

    async def _close(self) -> None:
        self._closing = True
        events, self._events = self._events, None
        if events is not None:
            await stop_client(events, grace=5.0, name="scheduler group member")
        await self.writers.close_all()
        reader, self._reader = self._reader, None
        if reader is not None:
            await stop_client(reader.consumer, grace=5.0, name="scheduler tasks reader")
        if self.pool_channel is not None:
            self.pool_channel.resign()
            await self.pool_channel.stop()
        if self._metrics is not None:
            await self._metrics.stop()
        if self.checkpoints is not None:
            await self.checkpoints.settle()
            self.checkpoints.close()
        self.phase.move(Phase.STOPPED)
        self._moved()

    async def _tasks_partitions(self, consumer: AIOKafkaConsumer) -> set[int]:
        deadline = time.monotonic() + 30.0
        while True:
            partitions = consumer.partitions_for_topic(self.names.tasks)
            if partitions:
                return set(partitions)
            if time.monotonic() > deadline:
                raise SchedulerError(f"topic {self.names.tasks} has no partitions")
            await client_of(consumer).force_metadata_update()

    # -- loops ----------------------------------------------------------------------------

    async def _run(self) -> None:
        reader, events = self._reader, self._events
        assert reader is not None
        assert events is not None
        try:
            # Kafka leaves topics this principal may not describe out of the metadata: the
            # group would assign nothing, and the scheduler wait forever. Asked for by name,
            # a missing ACL is named (AuthorizationError) instead.
            await describe_topics(self.settings, [self.names.task_events], configs=False)
            async with asyncio.TaskGroup() as group:
                self._group = group
                events.subscribe([self.names.task_events], listener=_Listener(self))
                group.create_task(self.intake.run(events), name="scheduler-events")
                group.create_task(self._tasks_loop(reader), name="scheduler-tasks")
                group.create_task(
                    self.housekeeping.run(reader, events), name="scheduler-housekeeping"
                )
                group.create_task(self._pools_loop(), name="scheduler-pools")
                logger.info(
                    "scheduler joining group",
                    extra={
                        "group_id": self.group_id,
                        "group_instance_id": self.group_instance_id,
                        "topic": self.names.task_events,
                    },
                )
        except ExceptionGroup as group_error:
            self.phase.move(Phase.FAILED)
            self._moved()
            raise _first(group_error) from None
        except Exception:
            self.phase.move(Phase.FAILED)
            self._moved()
            raise
        finally:
            self._group = None

    async def _tasks_loop(self, reader: TasksReader) -> None:
        """Fold the owned tasks partitions; publish what they call for."""
        while True:
            await self.checkpointer.maybe(reader)
            moved, dead = await reader.fetch()
            if moved:
                async with self.writers.lock:
                    handed = self.writers.publish(self.fold.drain(), dead)
                await self.writers.await_batches(handed)
            reader.moved.set()

    async def _pools_loop(self) -> None:
        """Follow the pools topic: grants start the owned tasks they admit; as ledger owner,
        the wants read are granted in partition 0's transaction."""
        channel = self.pool_channel
        assert channel is not None
        while True:
            async with self._pool_reads:
                touched = await channel.poll(self._fetch_wait_ms)
            if touched or channel.leading:
                async with self.writers.lock:
                    handed = self.writers.publish(self.fold.drain(), [])
                await self.writers.await_batches(handed)

    # -- publishing -----------------------------------------------------------------------------

    def _pool_records(self) -> dict[int, list[Outgoing]]:
        return self.admission.records(self.table)

    async def _drop_fenced(self) -> None:
        """Drop every partition whose producer was fenced, without writing, and rejoin."""
        async with self.writers.lock:
            lost = self.writers.fenced()
            for p in lost:
                self.ownership.lose(p)
        for p in lost:
            if self._events is not None:
                self._events.pause(TopicPartition(self.names.task_events, p))
            await self._release(p)
        if lost:
            self._moved()
            logger.warning(
                "scheduler fenced: partitions taken over by another member dropped",
                extra={"group_id": self.group_id, "partitions": lost},
            )
            if self._events is not None:
                request_rejoin(self._events)

    async def settle(self) -> None:
        """Wait until every batch handed to the producers is acknowledged (or fenced)."""
        async with self.writers.lock:  # a fold in progress hands its batches over first
            pass
        await self.writers.settle()

    # -- rebalances -------------------------------------------------------------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Stop writing for every partition (before anything awaits), abandon an acquisition
        in progress, let the batches in flight settle, commit, checkpoint."""
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
        self._moved()
        for p in abandoned:
            await self._release(p)
        await self.writers.settle(quiesced)
        if not self.writers.transactional and quiesced:
            try:
                await self.writers.commit(self._events, self.ownership.owned(Hold.QUIESCED))
            except KafkaError as exc:  # the generation is over: the next owner reads again
                logger.warning("event offsets not committed at revocation: %s", exc)
        if self._reader is not None:
            await self.checkpointer.now(self._reader)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Kept partitions write again at once, gone ones are dropped, new ones are taken
        over in the background (paused until then)."""
        events = self._events
        if events is None or self._closing:
            return
        generation = group_generation(events)
        self._assignor.note_generation(generation)
        self.rebalances += 1
        mine = {tp.partition for tp in assigned if tp.topic == self.names.task_events}
        async with self.writers.lock:
            change = self.ownership.assign(mine)
            for p in change.kept:
                part = self.writers[p]
                done = self.offsets.done.get(part.events_tp)
                if done is not None:
                    events.seek(part.events_tp, done)
                self.writers.publish([], [], offsets=(p,))  # sends what was held while quiesced
            for p in change.acquired:
                self.writers.add(p)
        if change.acquired:
            events.pause(*(TopicPartition(self.names.task_events, p) for p in change.acquired))
        for p in change.released:
            await self._release(p)
        self._moved()
        logger.info(
            "scheduler partitions assigned",
            extra={
                "group_id": self.group_id,
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
            self._running()

    def _running(self) -> None:
        if self.phase.is_(Phase.JOINING):
            self.phase.move(Phase.RUNNING)
            logger.info(
                "scheduler ready",
                extra={"group_id": self.group_id, "partitions": self.owned},
            )
        self._moved()

    async def _acquire(self, numbers: tuple[int, ...]) -> None:
        """Take partitions over: fence their old owner, fold them to their end, join them to
        the table, publish what they call for, then read their events."""
        began = time.monotonic()
        reader, events = self._reader, self._events
        assert reader is not None
        assert events is not None
        parts = [self.writers[p] for p in numbers]
        try:
            # The producers first: each fences the partition's previous owner (its open
            # transaction is aborted), so the ends read next hold all it managed to commit.
            await self.writers.start_publishers(parts)
            channel = self.pool_channel
            assert channel is not None
            if LEDGER_PARTITION in numbers:
                await channel.lead()  # its producer fenced the previous ledger owner's grants
            fold = TaskFold(self.table.pools, ledger=self.table.ledger)
            if self.checkpoints is not None:
                fold.table.track_changes()
            consumer = self._consumer()
            await consumer.start()
            try:
                side = TasksReader(consumer, fold, max_records=self.max_records, dead=self._dead)
                await side.recover(
                    self.names.tasks,
                    set(numbers),
                    self.checkpoints,
                    prefix=self.settings.topic_prefix,
                    group=self.group_id,
                    total=self.router.partitions,
                )
                positions = dict(side.positions)
            finally:
                await stop_client(consumer, grace=5.0, name="scheduler partition reader")
            self._recovered_records += side.recovered_records
            events_tps = [part.events_tp for part in parts]
            committed = {tp: await events.committed(tp) for tp in events_tps}
            ends = await events.end_offsets(events_tps) if not self.writers.transactional else {}
            async with self._pool_reads:
                await channel.catch_up(self._fetch_wait_ms)  # no want published twice
        except CheckpointError as exc:
            raise SchedulerError(f"cannot open the scheduler checkpoint: {exc}") from exc
        except KafkaError as exc:
            raise SchedulerError(f"scheduler could not take over {numbers}: {exc}") from exc
        async with self.writers.lock:
            self._absorbing = True  # a revocation now waits for the end of this
            try:
                self.table.absorb(fold.table)
                await reader.take(positions)
                for part in parts:
                    channel.own(part.number, self.table)
                    self.ownership.acquired(part.number)
                    offset = committed[part.events_tp]
                    if offset is not None:
                        self.offsets.committed[part.events_tp] = offset
                    if part.events_tp in ends:
                        # Events below were read before, by a predecessor that may have died
                        # between a batch's task states and its RunTasks (no transactions):
                        # folding them again re-sends the RunTask of a task still queued
                        # on one of them (see TaskTable.apply(resend=...)).
                        self.offsets.reread[part.events_tp] = ends[part.events_tp]
                handed = self.writers.publish(self.fold.drain(), [])
                events.resume(*events_tps)
            finally:
                self._absorbing = False
        await self.writers.await_batches(handed)
        self.takeovers += len(numbers)
        self.takeover_seconds = time.monotonic() - began
        self.recovery_seconds = self.takeover_seconds
        logger.info(
            "scheduler partitions acquired",
            extra={
                "group_id": self.group_id,
                "partitions": list(numbers),
                "transactional": self.writers.transactional,
                "takeover_seconds": round(self.takeover_seconds, 3),
                "tasks": len(self.table),
            },
        )
        self._running()

    async def _release(self, p: int) -> None:
        """Drop partition ``p`` without writing: its tasks, offsets, reader position,
        checkpoint database and producer."""
        part = self.writers.pop(p)
        if self.pool_channel is not None:
            self.pool_channel.disown(p)
            if p == LEDGER_PARTITION:
                self.pool_channel.resign()
        self.table.drop_where(lambda key: self.router.partition_of(key) == p)
        self.router.forget(p)
        if part is None:
            return
        self.fold.forget_unread_writes()  # those of the partition are no longer awaited
        self.offsets.forget(part.events_tp)
        self.housekeeping.forget(p)
        if self._reader is not None:
            await self._reader.drop({p})
        if self.checkpoints is not None:
            await self.checkpoints.close_partition(p)
        await self.writers.close(part)

    async def _leave(self, main: asyncio.Task[None]) -> None:
        """At stop: capture a checkpoint now if the tasks loop waits between fetches
        (otherwise the last periodic one stands), stop the loops and writing, let every
        batch settle, commit, and write the checkpoint; the group is left after this."""
        reader = self._reader
        captured = (
            self.checkpointer.capture(reader)
            if reader is not None and reader.idle and not main.done()
            else None
        )
        acquisition = self._acquisition
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await main
        self._closing = True
        if acquisition is not None:
            await asyncio.wait({acquisition})
        with contextlib.suppress(SchedulerError, SchedulerFenced):
            await self.writers.settle()
        if main.done() and not main.cancelled() and main.exception() is not None:
            self.checkpointer.abandon()  # a publish may have failed halfway
        elif not self.writers.transactional:
            with contextlib.suppress(KafkaError, SchedulerError):
                await self.writers.commit(self._events, self.owned)
        await self.checkpointer.last(captured)

    # -- records ------------------------------------------------------------------------------

    def _dead(self, message: Any, error: str) -> DeadLetter:
        return dead_letter(message, error, member=self.group_id)


def _first(group: ExceptionGroup[Any]) -> BaseException:
    """The first error of a task group's failure, as the scheduler's own."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, KafkaError):
        return SchedulerError(f"scheduler lost the broker: {error}")
    return error


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.scheduler.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.scheduler.on_partitions_assigned(assigned)
