"""The scheduler: folds trigger events into task state and sends resumed tasks to workers.

It reads two streams into one :class:`~deferline.engine.TaskTable`:

- the compacted **tasks** topic, every partition, from the beginning (or each partition's
  local checkpoint), without a consumer group: it *is* the state (clients, workers and the
  scheduler itself write it), so a (re)started scheduler folds it to the end before deciding
  anything;
- every partition of the **tasks.events** topic (the events of every trigger queue, which
  triggerers copy there keyed by task), with offsets kept in the consumer group
  ``<prefix>scheduler``: committed only once what they caused is published, and never past
  an event still held pending.

Any number of schedulers may run; one is active (see :mod:`._lease`): it holds
partition 0 of the lease topic in the group ``<prefix>scheduler``. Standbys fold the tasks
topic as it grows and read no events; on takeover a standby starts the fenced producer,
folds the tasks topic's tail, takes the decisions the state calls for, and reads
tasks.events from the committed offsets.

The parts, each owning its state: :class:`~._fold.TaskFold` (the table, no I/O),
:class:`~._tasks_topic.TasksReader` (the tasks consumer and its positions),
:class:`~._checkpoint.Checkpoints` (one database per tasks partition),
:class:`~._publishing.DecisionChain` (batches sent one after another) and
:class:`~._publishing.EventOffsets`, :class:`~._lease.SchedulerLease` (membership) and
:class:`~._lease.SchedulerPublisher` (the fenced producer). :class:`Scheduler` is the I/O
shell that runs their loops; its lifecycle is :class:`~._phase.Phase`.

Plain aiokafka rather than faust tables: the tasks topic is written by several parties and is
already the changelog; pools are global (admission needs every task of a pool in one place);
and the event→task join needs no repartition stage of its own: triggerers write each event,
keyed by task, to tasks.events, which has the tasks topic's partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.engine import Pools, TableDelta, TaskTable
from deferline.schemas import DeadLetter, EventFields
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    describe_topics,
    ensure_topics,
    make_consumer,
    topic_specs,
    trace_receive,
)
from prometheus_client import CollectorRegistry

from .._aiokafka import client_of
from .._local_state import CheckpointError
from .._metrics import MetricsServer
from ..triggerer import LONG_POLL_MS, answers_fetches_early
from ._checkpoint import Checkpoints
from ._cli import scheduler_command
from ._fold import TaskFold
from ._lease import SchedulerFenced, SchedulerLease, SchedulerPublisher
from ._metrics import SchedulerCollector
from ._phase import Phase, PhaseMachine
from ._publishing import DecisionChain, EventOffsets, SchedulerError
from ._records import dead_letter, orphan_letter
from ._tasks_topic import TasksReader

__all__ = ["Scheduler", "SchedulerError", "SchedulerFenced", "scheduler_command"]

logger = logging.getLogger(__name__)

_BATCHES_AHEAD = 3
"""Folded batches handed to the producer, beyond the one being sent, before the fold waits."""


class Scheduler(Lifecycle):
    """Fold the tasks and tasks.events topics into task state; publish decisions while active.

    Args:
        settings: connection and topic layout.
        pools: slot counts per pool (default: ``default_pool`` with 128 slots, like Airflow).
        worker_queues: worker queues whose topics are created at start; others are created
            the first time a task names them.
        group_id: consumer group of the lease and the event offsets; also the transactional
            id; default ``<prefix>scheduler``.
        metrics_port: serve Prometheus metrics on this port (0: any free port; None: off).
        orphan_check_interval: how often events held pending are checked against the tasks
            topic's end; one that still has no deferral once the scheduler has read past it
            is dropped as an orphan (for instance a DeferRequest published by another system).
        commit_interval: seconds between offset commits of tasks.events when the broker
            has no transactions (with them, offsets go in every batch's transaction).
        topic_refresh_interval: seconds between looks for new partitions of tasks.events.
        max_records: most records folded per fetch (and so per published batch).
        lease_timeout: group session timeout: how long a silent active scheduler keeps the
            lease before a standby takes over.
        transactions: write in Kafka transactions (True), never (False), or when the broker
            has them (None).
        finished_retention: seconds (by record time) a finished task stays in memory.
        state_dir: directory of the local checkpoints of the task table, one database per
            tasks partition (see :mod:`._checkpoint`); a restart restores them and folds only
            the tasks topic's tail. ``None``: no checkpoint, every start folds the whole
            topic. Schedulers on one host may share it: a partition's database is used by
            the one process that holds it (RocksDB locks it), the others fold that partition
            from the topic.
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
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        orphan_check_interval: float = 5.0,
        commit_interval: float = 1.0,
        topic_refresh_interval: float = 10.0,
        max_records: int = 10_000,
        lease_timeout: float = 10.0,
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
        self.orphan_check_interval = orphan_check_interval
        self.commit_interval = commit_interval
        self.max_records = max_records
        self.topic_refresh_interval = topic_refresh_interval
        self.lease_timeout = lease_timeout
        self.transactions = transactions
        self.finished_retention = finished_retention
        self.fold = TaskFold(pools)
        self.checkpoints = (
            Checkpoints(state_dir, interval=checkpoint_interval, max_age=checkpoint_max_age)
            if state_dir is not None
            else None
        )
        self.offsets = EventOffsets()
        self.publisher = SchedulerPublisher(
            settings, transactional_id=self.group_id, group_id=self.group_id
        )
        self.chain = DecisionChain(settings, self.publisher, self.fold, self.offsets)
        self.phase = PhaseMachine()
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(self))
        self._metrics = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )
        self._worker_queues = {"default", *worker_queues}
        self._reader: TasksReader | None = None
        self._lease: SchedulerLease | None = None
        self._events: AIOKafkaConsumer | None = None
        self._publish_lock = asyncio.Lock()
        # Apache Kafka answers a fetch once data arrives: a long wait only saves idle CPU.
        # Tansu holds every fetch for the whole wait: there it bounds the latency the
        # scheduler adds, so it stays short. Chosen at start from the brokers' API versions.
        self._fetch_wait_ms = 100
        self._main: asyncio.Task[None] | None = None
        self._acquired = asyncio.Event()
        self._lead: asyncio.Task[None] | None = None
        self.takeovers = 0
        self.takeover_seconds: float | None = None
        self.lag: dict[str, int] = {"tasks": 0, "events": 0}
        self.events_lag: dict[int, int] = {}  # per tasks.events partition read

    # -- figures ----------------------------------------------------------------------------

    @property
    def table(self) -> TaskTable:
        return self.fold.table

    @property
    def bad_records(self) -> int:
        return self.fold.bad_records

    @property
    def published(self) -> int:
        return self.chain.published

    @property
    def recovered_records(self) -> int:
        return self._reader.recovered_records if self._reader is not None else 0

    @property
    def recovery_seconds(self) -> float | None:
        return self._reader.recovery_seconds if self._reader is not None else None

    @property
    def restore_seconds(self) -> float | None:
        return self.checkpoints.restore_seconds if self.checkpoints is not None else None

    @property
    def restored_tasks(self) -> int:
        return self.checkpoints.restored_tasks if self.checkpoints is not None else 0

    @property
    def checkpoint_mismatches(self) -> int:
        return self.checkpoints.mismatches if self.checkpoints is not None else 0

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on, once started."""
        return self._metrics.port if self._metrics is not None else None

    @property
    def ready(self) -> bool:
        """True once the tasks topic is folded and the scheduler is in the lease group."""
        return self.phase.is_(Phase.STANDBY, Phase.ACTIVE)

    @property
    def active(self) -> bool:
        """True while this scheduler holds the lease and applies events."""
        return self.phase.is_(Phase.ACTIVE)

    @property
    def transactional(self) -> bool:
        """True when the active scheduler writes in Kafka transactions."""
        return self.publisher.transactional

    async def wait_ready(self) -> None:
        """Wait until :attr:`ready`; raises if the scheduler failed first."""
        await self._wait_for(Phase.STANDBY, Phase.ACTIVE)

    async def wait_active(self) -> None:
        """Wait until :attr:`active`; raises if the scheduler failed first."""
        await self._wait_for(Phase.ACTIVE)

    async def _wait_for(self, *phases: Phase) -> None:
        waiter = asyncio.ensure_future(self.phase.reach(*phases))
        watch: set[asyncio.Future[Any]] = {waiter}
        if self._main is not None:
            watch.add(self._main)
        try:
            done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._main is not None and self._main in done:
            await self._main  # raises its error
            raise SchedulerError("the scheduler stopped first")

    async def start(self) -> None:
        """Create missing topics, connect, and start folding (returns before catch-up)."""
        if self._main is not None:
            return
        try:
            await ensure_topics(
                self.settings, topic_specs(self.settings, worker_queues=self._worker_queues)
            )
            self.chain.ensured_queues |= self._worker_queues
            if self._metrics is not None:
                await self._metrics.start()
            if await answers_fetches_early(self.settings):
                self._fetch_wait_ms = LONG_POLL_MS
            tasks = self._consumer()
            self._reader = TasksReader(
                tasks, self.fold, max_records=self.max_records, dead=self._dead
            )
            await tasks.start()
        except KafkaError as exc:
            await self._close()
            raise SchedulerError(f"cannot connect the scheduler: {exc}") from exc
        except BaseException:
            await self._close()
            raise
        self.phase.move(Phase.RECOVERING)
        self._main = asyncio.create_task(self._run(), name="deferline-scheduler")

    async def stop(self) -> None:
        """Stop applying, commit what is published, leave the group, disconnect. Idempotent."""
        main, self._main = self._main, None
        try:
            if main is not None:
                await self._last_checkpoint(main)
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

    async def _close(self) -> None:
        await self._step_down()
        for client in (self._lease, self._reader.consumer if self._reader else None):
            if client is not None:
                await client.stop()
        self._lease = None
        if self._metrics is not None:
            await self._metrics.stop()
        if self.checkpoints is not None:
            await self.checkpoints.settle()
            self.checkpoints.close()
        self.phase.move(Phase.STOPPED)

    # -- loops ----------------------------------------------------------------------------

    async def _run(self) -> None:
        reader = self._reader
        assert reader is not None
        try:
            try:
                if self.checkpoints is not None:
                    self.table.track_changes()
                await reader.recover(
                    self.names.tasks,
                    await self._tasks_partitions(reader.consumer),
                    self.checkpoints,
                    prefix=self.settings.topic_prefix,
                    group=self.group_id,
                )
            except CheckpointError as exc:
                raise SchedulerError(f"cannot open the scheduler checkpoint: {exc}") from exc
            self._lease = SchedulerLease(
                self.settings,
                topic=self.names.scheduler_lease,
                group_id=self.group_id,
                session_timeout=self.lease_timeout,
                on_acquired=self._acquired.set,
                on_lost=self._step_down,
            )
            await self._lease.start()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._tasks_loop(reader), name="scheduler-tasks")
                group.create_task(self._lease.poll_forever(), name="scheduler-lease")
                group.create_task(self._leadership_loop(), name="scheduler-leadership")
                group.create_task(self._housekeeping_loop(), name="scheduler-housekeeping")
                self.phase.move(Phase.STANDBY)
                logger.info(
                    "scheduler ready (standby until it holds the lease)",
                    extra={
                        "tasks": len(self.table),
                        "recovered_records": reader.recovered_records,
                        "recovery_seconds": reader.recovery_seconds,
                        "group_id": self.group_id,
                    },
                )
        except KafkaError as exc:
            self.phase.move(Phase.FAILED)
            raise SchedulerError(f"scheduler lost the broker: {exc}") from exc
        except Exception:
            self.phase.move(Phase.FAILED)
            raise

    async def _tasks_partitions(self, consumer: AIOKafkaConsumer) -> set[int]:
        deadline = time.monotonic() + 30.0
        while True:
            partitions = consumer.partitions_for_topic(self.names.tasks)
            if partitions:
                return set(partitions)
            if time.monotonic() > deadline:
                raise SchedulerError(f"topic {self.names.tasks} has no partitions")
            await client_of(consumer).force_metadata_update()

    async def _tasks_loop(self, reader: TasksReader) -> None:
        """Fold the tasks topic, active or not; publish what it calls for while active."""
        while True:
            await self._maybe_checkpoint(reader)
            moved, dead = await reader.fetch()
            if moved and self.active:
                async with self._publish_lock:
                    if self.active:
                        await self.chain.publish(self.fold.drain(), dead)
            reader.moved.set()

    # -- leadership ---------------------------------------------------------------------------

    async def _leadership_loop(self) -> None:
        """Run the active role each time the lease is won, until it is lost."""
        while True:
            await self._acquired.wait()
            self._acquired.clear()
            lead = asyncio.create_task(self._take_over(), name="scheduler-active")
            self._lead = lead
            try:
                await asyncio.wait({lead})
            finally:
                if not lead.done():
                    lead.cancel()
                    await asyncio.wait({lead})
            failure = None if lead.cancelled() else lead.exception()
            if failure is not None:
                if self.checkpoints is not None:
                    self.checkpoints.off = True  # a publish may have failed halfway
                await self._step_down()
                raise failure

    async def _take_over(self) -> None:
        reader = self._reader
        assert reader is not None
        began = time.monotonic()
        try:
            # Fences the previous leader first (its open transaction is aborted), so the
            # tasks topic's end read next already holds everything it managed to commit.
            await self.publisher.start(transactions=self.transactions)
            await reader.caught_up()
            async with self._publish_lock:
                self.offsets.clear()
                self.phase.move(Phase.ACTIVE)
                await self.chain.publish(self.fold.drain())
            self._events = self._consumer()
            await self._events.start()
            await self._follow_event_partitions()
            await self._mark_reread()
        except KafkaError as exc:
            raise SchedulerError(f"scheduler could not take over: {exc}") from exc
        self.takeovers += 1
        self.takeover_seconds = time.monotonic() - began
        logger.info(
            "scheduler active",
            extra={
                "group_id": self.group_id,
                "transactional": self.publisher.transactional,
                "takeover_seconds": round(self.takeover_seconds, 3),
                "tasks": len(self.table),
            },
        )
        await self._events_loop()

    async def _mark_reread(self) -> None:
        """Without transactions, remember where the event partitions end at takeover.

        Events below that were read before, by a predecessor that may have died between a
        batch's task states and its RunTasks: folding them again re-sends the RunTask of a
        task still ``queued`` on one of them (see ``TaskTable.apply(resend=...)``).
        """
        self.offsets.reread = {}
        if self.publisher.transactional or self._events is None:
            return  # a batch's states, RunTasks and offsets committed together, or not at all
        assigned = list(self._events.assignment())
        if assigned:
            self.offsets.reread = await self._events.end_offsets(assigned)

    async def _step_down(self) -> None:
        """Stop applying events, after the batch in flight (called before the lease moves)."""
        lead, self._lead = self._lead, None
        async with self._publish_lock:
            was_active = self.active
            if was_active:
                self.phase.move(Phase.STANDBY)
            if lead is not None and not lead.done():
                lead.cancel()
        if lead is not None:
            await asyncio.wait({lead})
        in_flight, self.chain.in_flight = self.chain.in_flight, None
        sent = True
        if in_flight is not None:
            await asyncio.wait({in_flight})  # the batch handed to the producer goes out
            sent = not in_flight.cancelled() and in_flight.exception() is None
        events, self._events = self._events, None
        self.events_lag = {}
        if events is not None:
            if was_active and sent and not self.publisher.transactional:
                with contextlib.suppress(KafkaError):
                    await self._commit()
            await events.stop()
        await self.publisher.stop()
        self.fold.forget_unread_writes()
        if was_active:
            logger.info("scheduler standing by", extra={"group_id": self.group_id})

    async def _events_loop(self) -> None:
        assert self._events is not None
        last_commit = last_refresh = time.monotonic()
        committing: asyncio.Task[None] | None = None
        handed: deque[asyncio.Task[None] | None] = deque()
        while True:
            batches = await self._events.getmany(timeout_ms=1000, max_records=self.max_records)
            if batches:
                began = time.monotonic()
                async with self._publish_lock:
                    if not self.active:
                        return
                    dead: list[DeadLetter] = []
                    read: dict[TopicPartition, int] = {}
                    for tp, messages in batches.items():
                        for message in messages:
                            trace_receive(tp.topic, message.value, message.headers)
                            bad = self.fold.event(
                                message.value,
                                ref=(tp, message.offset),
                                resend=message.offset < self.offsets.reread.get(tp, 0),
                            )
                            if bad is not None:
                                dead.append(self._dead(message, bad))
                        if messages:
                            read[tp] = messages[-1].offset + 1
                    self.offsets.done.update(read)
                    out = self.fold.drain()
                    handed.append(self.chain.start(out, dead, offsets=True))
                if self.publisher.transactional:
                    last_commit = time.monotonic()  # the batch's transaction carries its offsets
                logger.debug(
                    "events batch folded",
                    extra={
                        "events": sum(len(messages) for messages in batches.values()),
                        "out": len(out),
                        "fold_seconds": round(time.monotonic() - began, 4),
                    },
                )
                # The next batches are fetched and folded while this one is sent (each
                # goes out after the one before it): the fold, not the broker's time to
                # complete a transaction before the next may begin, sets the pace. At most
                # _BATCHES_AHEAD are handed over and unsent; a failed one's error stops us.
                while len(handed) > _BATCHES_AHEAD:
                    oldest = handed.popleft()
                    if oldest is not None:
                        await asyncio.shield(oldest)  # a step-down lets it finish
            now = time.monotonic()
            if now - last_commit >= self.commit_interval:
                # Offsets that moved without output (orphans dropped, pending resolved).
                async with self._publish_lock:
                    if not self.active:
                        return
                    if self.publisher.transactional:
                        # Handed over, not awaited: chained after a batch in flight, waiting
                        # for it here would stop the fold for as long (up to the time the
                        # broker takes to complete the previous transaction, 0.5 s seen).
                        if committing is not None and committing.done():
                            committing.result()  # a failed commit stops the loop, as a batch does
                        committing = self.chain.start([], offsets=True)
                    else:
                        await self._commit()
                last_commit = now
            if now - last_refresh >= self.topic_refresh_interval:
                await self._follow_event_partitions()
                last_refresh = now

    async def _follow_event_partitions(self) -> None:
        """Read every partition of tasks.events, assigned by hand (the active scheduler sees
        every event: pools are global); new ones from the group's committed offset."""
        events, lease = self._events, self._lease
        assert events is not None
        assert lease is not None
        topic = self.names.task_events
        cluster = await client_of(events).fetch_all_metadata()
        wanted = {TopicPartition(topic, p) for p in cluster.partitions_for_topic(topic) or ()}
        if not wanted:
            # Kafka leaves topics this principal may not describe out of the listing: ask
            # for it by name, so a missing ACL is named (AuthorizationError) rather than
            # waited on as "no events topic yet".
            await describe_topics(self.settings, [topic], configs=False)
        current = set(events.assignment())
        if wanted <= current:
            return
        positions = {tp: await events.position(tp) for tp in current}
        added = sorted(wanted - current)
        committed = await lease.committed(added)
        events.assign(sorted(wanted | current))
        for tp, offset in positions.items():
            events.seek(tp, offset)
        fresh = [tp for tp in added if tp not in committed]
        if fresh:
            await events.seek_to_beginning(*fresh)
        for tp, offset in committed.items():
            events.seek(tp, offset)
            self.offsets.committed[tp] = offset
        logger.info(
            "reading event partitions",
            extra={
                "group_id": self.group_id,
                "added": [f"{tp.topic}:{tp.partition}" for tp in added],
            },
        )

    async def _housekeeping_loop(self) -> None:
        """Dead-letter events that can never apply, forget finished tasks past retention,
        refresh lag."""
        reader = self._reader
        assert reader is not None
        while True:
            await asyncio.sleep(self.orphan_check_interval)
            generation = self.table.mark_generation()
            await reader.caught_up()
            self.lag["tasks"] = 0  # just caught up with the end read before the wait
            async with self._publish_lock:
                await self._dead_letter_orphans(generation)
            self.table.forget_finished(self.finished_retention)
            await self._refresh_events_lag()

    async def _dead_letter_orphans(self, generation: int) -> None:
        """Events held since before ``generation`` closed still have no deferral, though the
        tasks topic is now folded past the end it had after them: dead-letter them, each
        with the reason (their offsets are committed only after the dead letters are sent).
        A standby only forgets them: it did not commit past them, so the active scheduler
        reads them again. Call with the publish lock."""
        orphans = self.table.expire_pending(generation)
        if not orphans:
            return
        active = self.active
        if active:
            letters = [
                orphan_letter(event, ref, now=self._task_now(event), member=self.group_id)
                for event, ref in orphans
            ]
            self.chain.start([], letters)
        fate = "dead-lettered" if active else "forgotten (standby)"
        for event, _ in orphans:
            logger.info(
                "event without a deferral on the tasks topic %s",
                fate,
                extra={
                    "trigger_id": event.trigger_id,
                    "task": str(event.task),
                    "event_id": event.event_id,
                },
            )
        logger.warning(
            "events without a deferral on the tasks topic %s", fate, extra={"count": len(orphans)}
        )

    def _task_now(self, event: EventFields) -> str:
        record = self.table.get(event.task.ti_key)
        if record is None:
            return "not on the tasks topic"
        on = f" on trigger {record.trigger_id}" if record.trigger_id else ""
        return f"{record.state}{on}"

    async def _refresh_events_lag(self) -> None:
        assigned = list(self._events.assignment()) if self._events is not None else []
        ends = await self._events.end_offsets(assigned) if self._events and assigned else {}
        done, committed = self.offsets.done, self.offsets.committed
        self.events_lag = {
            tp.partition: max(0, ends[tp] - done.get(tp, committed.get(tp, ends[tp])))
            for tp in assigned
        }
        self.lag["events"] = sum(self.events_lag.values())

    # -- checkpoints --------------------------------------------------------------------------

    def _capture(self, reader: TasksReader) -> tuple[TableDelta, dict[int, int]] | None:
        """The checkpoint to write if now is a consistent point (see :mod:`._checkpoint`):
        between two fetches, no fold in progress, nothing drained and unsent, no batch on
        its way to the broker, and the active role not failed. Does not yield."""
        lead = self._lead
        if (
            self.checkpoints is None
            or not reader.tps
            or self._publish_lock.locked()
            or (lead is not None and lead.done())
            or self.table.unpublished
            or not self.chain.sent
        ):
            return None
        return self.checkpoints.capture(self.table, reader.partition_positions())

    async def _maybe_checkpoint(self, reader: TasksReader) -> None:
        """Checkpoint if the interval has passed (called by the tasks loop between fetches)."""
        if self.checkpoints is None or not self.checkpoints.due():
            return
        async with self._publish_lock:
            pass  # let a fold in progress finish
        in_flight = self.chain.in_flight
        if in_flight is not None:
            await asyncio.wait({in_flight})  # and the batch it handed over; the capture
            # below does not yield, and skips this turn if another batch went out meanwhile
        captured = self._capture(reader)
        self.checkpoints.tried()
        if captured is not None:
            await self.checkpoints.write(self.table, *captured)

    async def _last_checkpoint(self, main: asyncio.Task[None]) -> None:
        """At stop: capture now if the tasks loop waits between fetches (otherwise the last
        periodic checkpoint stands), stop ``main``, then write it after any write in flight."""
        reader = self._reader
        captured = (
            self._capture(reader)
            if reader is not None and reader.idle and not main.done()
            else None
        )
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await main
        if self.checkpoints is None or not await self.checkpoints.settle():
            return
        if captured is not None:
            await self.checkpoints.write(self.table, *captured)

    # -- records ------------------------------------------------------------------------------

    def _dead(self, message: Any, error: str) -> DeadLetter:
        return dead_letter(message, error, member=self.group_id)

    async def _commit(self) -> None:
        """Commit event offsets through the lease member (brokers without transactions)."""
        lease = self._lease
        offsets = self.offsets.committable(self.table.pending_refs())  # taken now: what is
        await self.chain.settle()  # folded is handed over, and sent before it is committed
        if not offsets or lease is None or not lease.held:
            return
        await lease.commit(offsets)
        self.offsets.committed.update(offsets)
