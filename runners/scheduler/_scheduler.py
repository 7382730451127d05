"""The scheduler: folds trigger events into task state and sends resumed tasks to workers.

Every scheduler is active: each is a member of the consumer group ``<prefix>scheduler``
subscribed to **tasks.events** (the events of every trigger queue, which triggerers copy
there keyed by task; it has the tasks topic's partition count and numbering), and owning
partition *p* of tasks.events means owning partition *p* of the **tasks** topic: the member
folds only its partitions and is the only writer of their decisions. Partitions are spread
by the triggerers' sticky assignor (a join takes about 1/N, only from existing members; a
leave moves only the leaver's) with optional static membership. One scheduler alone owns
every partition and behaves as the single scheduler always did.

Every owned partition writes through the member's one producer
(:class:`~deferline.runners.member.MemberProducer`): on Apache Kafka the batches handed over
together, whichever partitions they are for, commit in one transaction with the event
offsets they consumed, carrying the group's generation, so the group fences a member it
went on without.

On assignment of *p* (see :mod:`._ownership` for the lifecycle): the events partition is
paused; on Apache Kafka *p*'s committed offset is read once no transaction holds it (the
previous owner's last round has ended); *p*'s checkpoint is restored and the tasks partition
folded to its end, into a table of its own that then joins the scheduler's; the decisions
the state calls for are published; events of *p* are read from the group's committed
offset. On revocation every partition stops writing before anything awaits, the batches in
flight settle, offsets are committed (without transactions), the checkpoints are written;
the next assignment says which partitions were kept (writing again at once) and which are
gone (dropped without writing). The partitions of a round the group fenced (this member was
paused past its session) are dropped at once, and the member rejoins.

Pools are exact whatever the membership: tasks of limited pools are admitted through the
pool ledger (see :mod:`._pools`); the owner of partition 0 keeps the ledger and writes its
grants in that partition's transaction. One table for every owned partition (rather than
one per partition); a partition joins it whole (:meth:`TaskTable.absorb`, once the pools
topic is read to its end) and leaves it whole (:meth:`TaskTable.drop_where`).

:class:`Scheduler` is a thin shell: it connects the clients, runs the loops in one task
group and wires parts that each own their state. Who writes what:

=================================  ======================================================
state                              written by
=================================  ======================================================
the task table, own writes         :class:`~._fold.TaskFold` (no I/O)
each partition's stage             :class:`~._ownership.Ownership` (moved by Membership)
tasks-topic positions              :class:`~._tasks_topic.TasksReader`
event offsets (read, committed)    :class:`~._publishing.EventOffsets`
owned partitions' chains, held      :class:`~._writers.PartitionWriters`
decisions, counts; publish lock
rounds, transactions               :class:`~deferline.runners.member.MemberProducer`
acquisition, takeover reader       :class:`~._membership.Membership` (the rebalance
                                   listener's processor)
membership figures                 :class:`~deferline.runners.member.MemberFigures`
                                   (rebalances: the listener; rounds: the producer;
                                   takeovers, fenced partitions: Membership)
consistent-point checkpoints       :class:`~._checkpointer.Checkpointer` (databases:
                                   :class:`~._checkpoint.Checkpoints`)
folding fetched events             :class:`~._intake.EventIntake`
orphans, retention, lag figures    :class:`~._housekeeping.Housekeeping`
pools topic, the pool ledger       :class:`~._pools.PoolChannel`
other partitions' tables (opt.)    :class:`~._standby.Standby`
clients, loops, phase, metrics     :class:`Scheduler` (its lifecycle: :class:`~._phase.Phase`)
=================================  ======================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from deferline.engine import LedgerAdmission, Pools, TaskTable
from deferline.schemas import DeadLetter
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    topic_specs,
)
from prometheus_client import CollectorRegistry

from .._aiokafka import GroupMetadata, group_metadata
from .._metrics import MetricsServer
from ..member import (
    MemberCollector,
    MemberFenced,
    MemberFigures,
    MemberListener,
    MemberProducer,
    Outgoing,
    PartitionPhase,
    StickyAssignor,
)
from ._admission import LedgerPoolAdmission
from ._checkpoint import Checkpoints
from ._checkpointer import Checkpointer
from ._clients import SchedulerClients
from ._fold import TaskFold
from ._housekeeping import Housekeeping
from ._intake import EventIntake
from ._membership import Membership
from ._metrics import MEMBER_METRICS, SchedulerCollector
from ._ownership import Ownership
from ._phase import Phase, PhaseMachine
from ._pools import PoolChannel
from ._publishing import EventOffsets, SchedulerError
from ._records import dead_letter
from ._routing import PartitionRouter
from ._standby import Standby
from ._tasks_topic import TasksReader
from ._writers import PartitionWriters

__all__ = ["Scheduler", "SchedulerError"]

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
        standby: keep every tasks partition this scheduler does not own folded (see
            :mod:`._standby`): it folds them before it joins the group (those this host
            holds a checkpoint of once it has joined), and a partition it acquires then
            folds only its tail. Costs each scheduler the memory and CPU of the whole task
            table.
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
        standby: bool = False,
    ) -> None:
        if isinstance(pools, Mapping):
            pools = Pools(slots=dict(pools))
        self.settings = settings
        self.names = TopicNames(settings.topic_prefix)
        self.group_id = group_id or f"{settings.topic_prefix}scheduler"
        self.group_instance_id = group_instance_id
        self.router = PartitionRouter()
        self.fold = TaskFold(pools, ledger=LedgerAdmission(partition_of=self.router.partition_of))
        self.checkpoints = (
            Checkpoints(state_dir, interval=checkpoint_interval, max_age=checkpoint_max_age)
            if state_dir is not None
            else None
        )
        self.offsets = EventOffsets()
        self.ownership = Ownership()
        self.phase = PhaseMachine()
        self.figures = MemberFigures(owned=lambda: len(self.owned))
        """This member's membership figures (read by the metrics)."""
        self.producer = MemberProducer(
            settings,
            group_id=self.group_id,
            name=uuid.uuid4().hex,
            member=self._group_member,
            figures=self.figures,
            transactions=transactions,
            transaction_timeout=session_timeout,
        )
        self.writers = PartitionWriters(
            settings,
            producer=self.producer,
            fold=self.fold,
            offsets=self.offsets,
            router=self.router,
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
        self._assignor = assignor = StickyAssignor()
        self.clients = SchedulerClients(
            settings,
            group_id=self.group_id,
            group_instance_id=group_instance_id,
            session_timeout=session_timeout,
            max_records=max_records,
            fold=self.fold,
            router=self.router,
            assignor=assignor,
            dead=self._dead,
        )
        self.standby = (
            Standby(
                self.clients.consumer,
                topic=self.names.tasks,
                pools=self.table.pools,
                ledger=self.table.ledger,
                max_records=max_records,
                finished_retention=finished_retention,
            )
            if standby
            else None
        )
        self.membership = Membership(
            self.clients,
            writers=self.writers,
            ownership=self.ownership,
            checkpoints=self.checkpoints,
            checkpointer=self.checkpointer,
            standby=self.standby,
            figures=self.figures,
            shell=self,
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
        members = MemberCollector(MEMBER_METRICS)
        members.add(self.figures)
        self.registry.register(members)
        self._metrics = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )
        self._worker_queues = {"default", *worker_queues}
        self._main: asyncio.Task[None] | None = None

    # -- figures ----------------------------------------------------------------------------

    @property
    def table(self) -> TaskTable:
        return self.fold.table

    @property
    def pool_channel(self) -> PoolChannel | None:
        """The pools topic and the pool ledger (once started)."""
        return self.clients.pool_channel

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
        return self.membership.recovered_records

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
        return self.ownership.owned(PartitionPhase.ACTIVE)

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
        """True when the scheduler writes in Kafka transactions (known once started)."""
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

    async def _wait_until(self, done: Callable[[], bool]) -> None:
        await self.phase.wait_until(done, lambda: self._main)

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
            await self.producer.start()
            if self.producer.transactional:
                logger.info(
                    "scheduler writes in transactions",
                    extra={"transactional_id": self.producer.transactional_id},
                )
            await self.clients.connect()
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

    async def settle(self) -> None:
        """Wait until every batch handed to the producers is acknowledged (or fenced)."""
        async with self.writers.lock:  # a fold in progress hands its batches over first
            pass
        await self.writers.settle()

    async def _close(self) -> None:
        self.membership.stop_serving()
        await self.clients.stop_member()
        await self.membership.close()
        self.writers.close_all()
        await self.producer.stop()
        await self.clients.stop_readers()
        if self.standby is not None:
            await self.standby.stop()
        if self._metrics is not None:
            await self._metrics.stop()
        if self.checkpoints is not None:
            await self.checkpoints.settle()
            self.checkpoints.close()
        self.phase.move(Phase.STOPPED)
        self.phase.changed()

    async def _leave(self, main: asyncio.Task[None]) -> None:
        """At stop: capture a checkpoint now if the tasks loop waits between fetches
        (otherwise the last periodic one stands), stop the loops and writing, let every
        batch settle, commit, and write the checkpoint; the group is left after this."""
        reader = self.clients.reader
        captured = (
            self.checkpointer.capture(reader)
            if reader is not None and reader.idle and not main.done()
            else None
        )
        acquisition = self.membership.acquisition
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await main
        self.membership.stop_serving()
        if acquisition is not None:
            await asyncio.wait({acquisition})
        with contextlib.suppress(SchedulerError, MemberFenced):
            await self.writers.settle()
        if main.done() and not main.cancelled() and main.exception() is not None:
            self.checkpointer.abandon()  # a publish may have failed halfway
        elif not self.writers.transactional:
            with contextlib.suppress(KafkaError, SchedulerError):
                await self.writers.commit(self.clients.events, self.owned)
        await self.checkpointer.last(captured)

    # -- loops ----------------------------------------------------------------------------

    async def _run(self) -> None:
        reader, events = self.clients.reader, self.clients.events
        assert reader is not None
        assert events is not None
        try:
            # Kafka leaves topics this principal may not describe out of the metadata: the
            # group would assign nothing, and the scheduler wait forever. Asked for by name,
            # a missing ACL is named (AuthorizationError) instead.
            await describe_topics(self.settings, [self.names.task_events], configs=False)
            async with asyncio.TaskGroup() as group:
                self.membership.supervise(group)
                await self.membership.prepare()
                if self.standby is not None:  # a newcomer takes its partitions over warm
                    everything = range(self.router.partitions)
                    restorable = (
                        await self.checkpoints.on_disk(self.names.tasks, everything)
                        if self.checkpoints is not None
                        else set()
                    )
                    await self.standby.warm(everything, later=restorable)
                    group.create_task(self.standby.run(), name="scheduler-standby")
                listener = MemberListener(
                    self.membership,
                    consumer=events,
                    topic=self.names.task_events,
                    assignor=self._assignor,
                    figures=self.figures,
                )
                events.subscribe([self.names.task_events], listener=listener)
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
            self.phase.changed()
            first = _first(group_error)
            raise first from first.__cause__
        except Exception:
            self.phase.move(Phase.FAILED)
            self.phase.changed()
            raise
        finally:
            self.membership.supervise(None)

    async def _tasks_loop(self, reader: TasksReader) -> None:
        """Fold the owned tasks partitions; publish what they call for."""
        writers = self.writers
        while True:
            await self.checkpointer.maybe(reader)
            moved, dead = await reader.fetch()
            if moved:
                async with writers.lock:
                    handed = writers.publish(self.fold.drain(), dead)
                await writers.await_batches(handed)
            reader.moved.set()

    async def _pools_loop(self) -> None:
        """Follow the pools topic: grants start the owned tasks they admit; as ledger owner,
        the wants read are granted in partition 0's transaction."""
        clients, writers = self.clients, self.writers
        channel = clients.pool_channel
        assert channel is not None
        while True:
            async with clients.pool_reads:
                touched = await channel.poll(clients.fetch_wait_ms)
            if touched or channel.leading:
                async with writers.lock:
                    handed = writers.publish(self.fold.drain(), [])
                await writers.await_batches(handed)

    # -- what the membership tells it (a MembershipShell) -----------------------------------

    def ownership_moved(self) -> None:
        """Partitions changed hands or phase: waiters look again."""
        self.phase.changed()

    def assignment_taken_over(self) -> None:
        """The assignment is taken over whole: a joining scheduler runs from now on."""
        if self.phase.is_(Phase.JOINING):
            self.phase.move(Phase.RUNNING)
            if self.standby is not None:
                self.standby.joined(self.owned)
            logger.info(
                "scheduler ready",
                extra={"group_id": self.group_id, "partitions": self.owned},
            )
        self.phase.changed()

    def partition_released(self, partition: int) -> None:
        """``partition`` is no longer this scheduler's: no lag of it."""
        self.housekeeping.forget(partition)

    # -- wiring -----------------------------------------------------------------------------

    def _pool_records(self) -> dict[int, list[Outgoing]]:
        return self.admission.records(self.table)

    def _group_member(self) -> GroupMetadata:
        """This scheduler's place in its group, which each round's offsets carry."""
        events = self.clients.events
        if events is None:  # not in the group: the coordinator refuses the round
            return GroupMetadata(self.group_id, -1, "", self.group_instance_id)
        return group_metadata(events)

    async def _drop_fenced(self) -> None:
        await self.membership.drop_fenced()

    def _dead(self, message: Any, error: str) -> DeadLetter:
        return dead_letter(message, error, member=self.group_id)


def _first(group: ExceptionGroup[Any]) -> BaseException:
    """The first error of a task group's failure, as the scheduler's own."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, KafkaError):
        lost = SchedulerError(f"scheduler lost the broker: {error}")
        lost.__cause__ = error  # the process tells a lost cluster (ridden out) by the cause
        return lost
    return error
