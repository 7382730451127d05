"""The scheduler: folds trigger events into task state and sends resumed tasks to workers.

It reads two streams into one :class:`~deferline.engine.TaskTable`:

- the compacted **tasks** topic, every partition, from the beginning, without a consumer
  group: it *is* the state (clients, workers and the scheduler itself write it), so a
  (re)started scheduler folds it to the end before deciding anything;
- every partition of the **tasks.events** topic (the events of every trigger queue, which
  triggerers copy there keyed by task), with offsets kept in the consumer group
  ``<prefix>scheduler``: committed only once what they caused is published, and never past
  an event still held pending.

Any number of schedulers may run; one is active (see :mod:`._lease`): it holds
partition 0 of the lease topic in the group ``<prefix>scheduler``. Standbys fold the tasks
topic as it grows and read no events; on takeover a standby starts the fenced producer,
folds the tasks topic's tail, takes the decisions the state calls for, and reads
tasks.events from the committed offsets.

Decisions go out in batches (see :mod:`._records` for where each record goes).

Plain aiokafka rather than faust tables: the tasks topic is written by several parties and is
already the changelog; pools are global (admission needs every task of a pool in one place);
and the event→task join needs no repartition topic when one process reads both topics.
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
from deferline.engine import Emit, Pools, TaskTable
from deferline.schemas import (
    DeadLetter,
    DeferlineError,
    RunTask,
    SchemaError,
    TaskStateRecord,
    TriggerEventRecord,
)
from deferline.topics import (
    Lifecycle,
    LogIdentity,
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
from ._checkpoint import SchedulerCheckpoint, _Checkpointing
from ._cli import scheduler_command
from ._lease import Outgoing, SchedulerFenced, SchedulerLease, SchedulerPublisher
from ._metrics import SchedulerCollector
from ._records import committable, dead_letter, orphan_letter, read_as, waves
from ._tasks_topic import _TasksTopic

__all__ = ["Scheduler", "SchedulerError", "SchedulerFenced", "scheduler_command"]

logger = logging.getLogger(__name__)

_BATCHES_AHEAD = 3
"""Folded batches handed to the producer, beyond the one being sent, before the fold waits."""


class SchedulerError(DeferlineError):
    """The scheduler could not read or publish (broker unreachable, topic missing...)."""


class Scheduler(_Checkpointing, _TasksTopic, Lifecycle):
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
        state_dir: directory of the local checkpoint of the task table (see
            :mod:`._checkpoint`); a restart restores it and folds only the tasks topic's tail.
            ``None``: no checkpoint, every start folds the whole topic. One process per
            directory (RocksDB locks it).
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
        self.table = TaskTable(pools=pools)
        self.group_id = group_id or f"{settings.topic_prefix}scheduler"
        self.orphan_check_interval = orphan_check_interval
        self.commit_interval = commit_interval
        self.max_records = max_records
        self.topic_refresh_interval = topic_refresh_interval
        self.lease_timeout = lease_timeout
        self.transactions = transactions
        self.finished_retention = finished_retention
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_max_age = checkpoint_max_age
        self._checkpoint = SchedulerCheckpoint(state_dir) if state_dir is not None else None
        self._checkpoints_off = False
        self._checkpointed_at = 0.0
        self._saved_positions: dict[int, int] | None = None
        self._identity: LogIdentity | None = None
        self.checkpoint_mismatches = 0
        self._writing: asyncio.Future[bool] | None = None
        self._tasks_idle = False
        self.restored_tasks = 0
        self.restore_seconds: float | None = None
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(self))
        self._metrics = (
            MetricsServer(self.registry, host=metrics_host, port=metrics_port)
            if metrics_port is not None
            else None
        )
        self._worker_queues = {"default", *worker_queues}
        self._ensured_worker_queues: set[str] = set()
        self._publisher = SchedulerPublisher(
            settings, transactional_id=self.group_id, group_id=self.group_id
        )
        self._lease: SchedulerLease | None = None
        self._tasks: AIOKafkaConsumer | None = None
        self._events: AIOKafkaConsumer | None = None
        self._task_tps: list[TopicPartition] = []
        self._tasks_pos: dict[TopicPartition, int] = {}
        self._tasks_moved = asyncio.Event()
        # Values of task states this scheduler published and has not read back yet.
        self._written: dict[bytes, TaskStateRecord] = {}
        self._events_done: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        # Where the event partitions ended at a takeover without transactions.
        self._reread: dict[TopicPartition, int] = {}
        self._publish_lock = asyncio.Lock()
        # Apache Kafka answers a fetch once data arrives: a long wait only saves idle CPU.
        # Tansu holds every fetch for the whole wait: there it bounds the latency the
        # scheduler adds, so it stays short. Chosen at start from the brokers' API versions.
        self._fetch_wait_ms = 100
        # The last batch handed to the producer; each batch is sent after the one before it.
        self._in_flight: asyncio.Task[None] | None = None
        self._main: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._active = asyncio.Event()
        self._acquired = asyncio.Event()
        self._lead: asyncio.Task[None] | None = None
        self.recovered_records = 0
        self.recovery_seconds: float | None = None
        self.takeovers = 0
        self.takeover_seconds: float | None = None
        self.bad_records = self.published = 0
        self.lag: dict[str, int] = {"tasks": 0, "events": 0}

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on, once started."""
        return self._metrics.port if self._metrics is not None else None

    @property
    def ready(self) -> bool:
        """True once the tasks topic is folded and the scheduler is in the lease group."""
        return self._ready.is_set()

    @property
    def active(self) -> bool:
        """True while this scheduler holds the lease and applies events."""
        return self._active.is_set()

    @property
    def transactional(self) -> bool:
        """True when the active scheduler writes in Kafka transactions."""
        return self._publisher.transactional

    async def wait_ready(self) -> None:
        """Wait until :attr:`ready`; raises if the scheduler failed first."""
        await self._wait_for(self._ready)

    async def wait_active(self) -> None:
        """Wait until :attr:`active`; raises if the scheduler failed first."""
        await self._wait_for(self._active)

    async def _wait_for(self, event: asyncio.Event) -> None:
        waiter = asyncio.ensure_future(event.wait())
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
            if self._checkpoint is not None:
                self._checkpoint.open()
                self.table.track_changes()
            await ensure_topics(
                self.settings, topic_specs(self.settings, worker_queues=self._worker_queues)
            )
            self._ensured_worker_queues |= self._worker_queues
            if self._metrics is not None:
                await self._metrics.start()
            if await answers_fetches_early(self.settings):
                self._fetch_wait_ms = LONG_POLL_MS
            self._tasks = self._consumer()
            await self._tasks.start()
        except CheckpointError as exc:
            await self._close()
            raise SchedulerError(f"cannot open the scheduler checkpoint: {exc}") from exc
        except KafkaError as exc:
            await self._close()
            raise SchedulerError(f"cannot connect the scheduler: {exc}") from exc
        except BaseException:
            await self._close()
            raise
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
        for client in (self._lease, self._tasks):
            if client is not None:
                await client.stop()
        self._lease = self._tasks = None
        if self._metrics is not None:
            await self._metrics.stop()
        if self._checkpoint is not None:
            await self._settle_checkpoint()
            self._checkpoint.close()
        self._ready.clear()

    # -- loops ----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._recover()
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
                group.create_task(self._tasks_loop(), name="scheduler-tasks")
                group.create_task(self._lease.poll_forever(), name="scheduler-lease")
                group.create_task(self._leadership_loop(), name="scheduler-leadership")
                group.create_task(self._housekeeping_loop(), name="scheduler-housekeeping")
                self._ready.set()
                logger.info(
                    "scheduler ready (standby until it holds the lease)",
                    extra={
                        "tasks": len(self.table),
                        "recovered_records": self.recovered_records,
                        "recovery_seconds": self.recovery_seconds,
                        "group_id": self.group_id,
                    },
                )
        except KafkaError as exc:
            raise SchedulerError(f"scheduler lost the broker: {exc}") from exc

    async def _tasks_partitions(self) -> set[int]:
        assert self._tasks is not None
        deadline = time.monotonic() + 30.0
        while True:
            partitions = self._tasks.partitions_for_topic(self.names.tasks)
            if partitions:
                return set(partitions)
            if time.monotonic() > deadline:
                raise SchedulerError(f"topic {self.names.tasks} has no partitions")
            await client_of(self._tasks).force_metadata_update()

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
                self._checkpoints_off = True  # a publish may have failed halfway
                await self._step_down()
                raise failure

    async def _take_over(self) -> None:
        began = time.monotonic()
        try:
            # Fences the previous leader first (its open transaction is aborted), so the
            # tasks topic's end read next already holds everything it managed to commit.
            await self._publisher.start(transactions=self.transactions)
            await self._tasks_caught_up()
            async with self._publish_lock:
                self._events_done.clear()
                self._committed.clear()
                self._active.set()
                await self._publish(self.table.drain())
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
                "transactional": self._publisher.transactional,
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
        self._reread = {}
        if self._publisher.transactional or self._events is None:
            return  # a batch's states, RunTasks and offsets committed together, or not at all
        assigned = list(self._events.assignment())
        if assigned:
            self._reread = await self._events.end_offsets(assigned)

    async def _step_down(self) -> None:
        """Stop applying events, after the batch in flight (called before the lease moves)."""
        lead, self._lead = self._lead, None
        async with self._publish_lock:
            was_active = self._active.is_set()
            self._active.clear()
            if lead is not None and not lead.done():
                lead.cancel()
        if lead is not None:
            await asyncio.wait({lead})
        in_flight, self._in_flight = self._in_flight, None
        sent = True
        if in_flight is not None:
            await asyncio.wait({in_flight})  # the batch handed to the producer goes out
            sent = not in_flight.cancelled() and in_flight.exception() is None
        events, self._events = self._events, None
        if events is not None:
            if was_active and sent and not self._publisher.transactional:
                with contextlib.suppress(KafkaError):
                    await self._commit()
            await events.stop()
        await self._publisher.stop()
        self._written.clear()  # what was not read back yet is read (and decoded) as any record
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
                    if not self._active.is_set():
                        return
                    dead: list[DeadLetter] = []
                    read: dict[TopicPartition, int] = {}
                    for tp, messages in batches.items():
                        for message in messages:
                            trace_receive(tp.topic, message.value, message.headers)
                            bad = self._fold_event(
                                message.value,
                                ref=(tp, message.offset),
                                resend=message.offset < self._reread.get(tp, 0),
                            )
                            if bad is not None:
                                dead.append(self._dead(message, bad))
                        if messages:
                            read[tp] = messages[-1].offset + 1
                    self._events_done.update(read)
                    out = self.table.drain()
                    handed.append(self._start_publish(out, dead, offsets=True))
                if self._publisher.transactional:
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
                    if not self._active.is_set():
                        return
                    if self._publisher.transactional:
                        # Handed over, not awaited: chained after a batch in flight, waiting
                        # for it here would stop the fold for as long (up to the time the
                        # broker takes to complete the previous transaction, 0.5 s seen).
                        if committing is not None and committing.done():
                            committing.result()  # a failed commit stops the loop, as a batch does
                        committing = self._start_publish([], offsets=True)
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
            self._committed[tp] = offset
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
        assert self._tasks is not None
        while True:
            await asyncio.sleep(self.orphan_check_interval)
            generation = self.table.mark_generation()
            await self._tasks_caught_up()
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
        active = self._active.is_set()
        if active:
            letters = [
                orphan_letter(event, ref, now=self._task_now(event), member=self.group_id)
                for event, ref in orphans
            ]
            self._start_publish([], letters)
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

    def _task_now(self, event: TriggerEventRecord) -> str:
        record = self.table.get(event.task.ti_key)
        if record is None:
            return "not on the tasks topic"
        on = f" on trigger {record.trigger_id}" if record.trigger_id else ""
        return f"{record.state}{on}"

    async def _refresh_events_lag(self) -> None:
        assigned = list(self._events.assignment()) if self._events is not None else []
        ends = await self._events.end_offsets(assigned) if self._events and assigned else {}
        self.lag["events"] = sum(
            max(0, ends[tp] - self._events_done.get(tp, self._committed.get(tp, ends[tp])))
            for tp in assigned
        )

    # -- folding and publishing -------------------------------------------------------------

    def _fold_event(self, value: bytes | None, *, ref: object, resend: bool = False) -> str | None:
        if value is None:
            return None
        try:
            self.table.apply(read_as(value, TriggerEventRecord), ref=ref, resend=resend)
        except SchemaError as exc:
            return self._bad(exc, live=True)
        return None

    def _bad(self, exc: SchemaError, *, live: bool) -> str | None:
        self.bad_records += 1
        logger.warning("unreadable record skipped: %s", exc, extra={"field": exc.field})
        # Tasks records read during recovery were dead-lettered when first read live.
        return f"{type(exc).__name__}: {exc}" if live else None

    def _dead(self, message: Any, error: str) -> DeadLetter:
        return dead_letter(message, error, member=self.group_id)

    async def _publish(
        self, out: Sequence[Emit], dead: Sequence[DeadLetter] = (), *, offsets: bool = False
    ) -> None:
        """Publish ``out`` after every batch started before it. Call with the publish lock."""
        sent = self._start_publish(out, dead, offsets=offsets)
        if sent is not None:
            await asyncio.shield(sent)  # cancelled or not, the batch goes out

    def _start_publish(
        self, out: Sequence[Emit], dead: Sequence[DeadLetter] = (), *, offsets: bool = False
    ) -> asyncio.Task[None] | None:
        """Hand ``out`` to the producer, after the batch in flight; returns its task.

        Synchronous up to the task, so a batch is encoded, and its event offsets are taken,
        at the moment of the drain that made it (an event still pending then is not
        committed past, even if a later fold resolves it). Records go out in waves:
        CancelRequests (the "removed" record that follows one is the proof it was sent),
        task states, then RunTasks (a worker's "running" must land after "queued"). In a
        transaction the waves and the event offsets commit together; without, each wave is
        acknowledged before the next. Call with the publish lock."""
        commit = self._committable() if offsets and self._publisher.transactional else {}
        if not out and not dead and not commit:
            return None
        queues = {e.record.worker_queue for e in out if isinstance(e.record, RunTask)}
        batch = waves(self.names, out, dead, written=self._written)
        task = asyncio.create_task(
            self._send_after(self._in_flight, queues, batch, commit), name="scheduler-publish"
        )
        self._in_flight = task
        return task

    async def _send_after(
        self,
        previous: asyncio.Task[None] | None,
        queues: set[str],
        batch: tuple[list[Outgoing], list[Outgoing], list[Outgoing]],
        commit: dict[TopicPartition, int],
    ) -> None:
        if previous is not None:
            await asyncio.shield(previous)  # raises its error: nothing goes out past it
        for worker_queue in sorted(queues):
            await self._ensure_worker_queue(worker_queue)
        try:
            await self._publisher.publish(batch, commit)
        except KafkaError as exc:
            raise SchedulerError(f"cannot publish scheduler decisions: {exc}") from exc
        self._committed.update(commit)
        self.published += sum(len(wave) for wave in batch)

    async def _settle(self) -> None:
        """Wait until every batch handed to the producer is sent (raises a failed one's error)."""
        if self._in_flight is not None:
            await asyncio.shield(self._in_flight)

    async def _ensure_worker_queue(self, worker_queue: str) -> None:
        if worker_queue in self._ensured_worker_queues:
            return
        await ensure_topics(self.settings, topic_specs(self.settings, worker_queues=[worker_queue]))
        self._ensured_worker_queues.add(worker_queue)

    def _committable(self) -> dict[TopicPartition, int]:
        return committable(self._events_done, self.table.pending_refs(), self._committed)

    async def _commit(self) -> None:
        """Commit event offsets through the lease member (brokers without transactions)."""
        lease = self._lease
        offsets = self._committable()  # taken now: what is folded is handed to the producer
        await self._settle()  # and is sent before its offsets are committed
        if not offsets or lease is None or not lease.held:
            return
        await lease.commit(offsets)
        self._committed.update(offsets)
